"""Patch ``engine_liveness``: a stage engine that goes silent is kept, not killed.

vllm-omni 0.30.0's coordinator marks a replica ERROR once its heartbeats are ``omni_heartbeat_timeout``
seconds late, and publishes only UP replicas. The head's membership watcher
(``MembershipController._watch_replica_list``) cannot tell that from a replica that said DOWN, so
it detaches it: ``handle_unregister`` -> ``_detach_replica`` -> ``client.shutdown()``. For the
head's own stage-0 engine that shutdown kills a live process which nothing restarts; for a remote
replica it strands a live engine the head never attaches again. A VM pause, a CPU-throttled
container, a long first compile or a network blip is enough (issue 26: ``make demo`` lost its only
live engine that way).

With this patch:

* ``OmniCoordinator.get_active_replicas`` (the coordinator's child process is forked from the head
  after the plugin loaded, so the wrapper is there too) publishes ERROR replicas beside the UP
  ones. Every upstream reader keeps only ``status == UP`` (the load balancer, the watcher), so
  routing is unchanged: a silent replica gets no new request.
* ``MembershipController.handle_unregister``, called by the watcher, leaves a replica the
  coordinator lists as ERROR attached (a leave still detaches it): *silent*, unroutable, its
  requests in flight waiting for it. When its heartbeats
  resume the coordinator lists it UP again and it is routable at once. A replica that said DOWN
  (a graceful exit), or whose ERROR entry the coordinator dropped (600 s of silence), is detached
  as upstream does. Requests in flight on a silent engine wait: within the client's own timeout
  (the HTTP client disconnects, vLLM aborts them), or until the operator makes the replica leave.
* ``OmniBase._live_replica_count`` (what the head's ``/health`` counts per stage) leaves a silent
  replica out: ``/health``, the head pod's readiness, then means "this head can route a request to
  a live engine of every stage" (issue 26). Upstream a silent replica counts as live until the
  watcher kills it; here it is kept, so without this a head whose engines are all silent would
  stay Ready and answer each request with "no live replica".
* ``MembershipController._watch_replica_list`` runs a second loop beside it that notes when each
  attached replica went silent and came back, logs both, and bumps the membership epoch, so the
  operator's cheap conditional probe sees the change (the listing shows ``coordinatorStatus:
  silent``).

The head's own engine that really died (its process exited: vLLM's client marks it dead, the
orchestrator evicts it) is what :func:`local_engine` reports, and the head's liveness path
(``contract.LIVE_PATH``) answers 503 for it, so the kubelet restarts the head.

Switch it off with ``OMNISTAGE_DISABLE_PATCHES=engine_liveness`` (the negative control).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any

from .. import contract
from .._patching import ORCHESTRATOR, SILENT, Target, ours, referent, shape_problem, wrap

logger = logging.getLogger("omnistage_engine_patches.engine_liveness")

NAME = contract.ENGINE_LIVENESS

WATCH_INTERVAL_S = 0.5  # as upstream's watcher

#: True in the membership watcher's task and the unregister tasks it spawns (asyncio copies the
#: context into a task it creates): only the watcher's unregister of a silent replica is skipped. A
#: leave (the operator's, through membership_ops) detaches a silent replica like any other.
_FROM_WATCHER: contextvars.ContextVar[bool] = contextvars.ContextVar("omnistage_from_watcher", default=False)


def silent_since(controller: Any) -> dict[tuple[int, str], float]:
    """(stage, input address) -> monotonic time it went silent, for attached replicas now silent."""
    return controller.__dict__.setdefault(SILENT, {})


def hub_statuses(controller: Any) -> dict[tuple[int, str], str]:
    """(stage, input address) -> "up" or "silent", as the coordinator last published them."""
    hub = getattr(controller, "_hub", None)
    if hub is None:
        return {}
    from vllm_omni.distributed.omni_coordinator.messages import ReplicaStatus

    out = {}
    for rep in hub.get_replica_list().replicas:
        if rep.status == ReplicaStatus.UP:
            out[(rep.stage_id, rep.input_addr)] = contract.COORD_UP
        elif rep.status == ReplicaStatus.ERROR:
            out[(rep.stage_id, rep.input_addr)] = contract.COORD_SILENT
    return out


def _attached(controller: Any) -> dict[tuple[int, str], int]:
    """(stage, input address) -> replica id, for every client attached to a stage pool."""
    from vllm_omni.engine.stage_pool import StagePool

    out = {}
    for stage_id, pool in enumerate(getattr(controller, "_stage_pools", None) or []):
        for replica_id, client in enumerate(pool.clients):
            addr = StagePool._client_input_addr(client) if client is not None else None
            if addr is not None:
                out[(stage_id, addr)] = replica_id
    return out


def _bump(controller: Any) -> None:
    orch = referent(controller, ORCHESTRATOR)
    if orch is None:
        return
    from . import membership  # the epoch lives in membership's state

    membership.state_of(orch).bump()


async def _watch_silence(controller: Any) -> None:
    """Note each attached replica's silence and its return; bump the epoch on either."""
    while not controller._shutdown_event.is_set():
        try:
            statuses = hub_statuses(controller)
            attached = _attached(controller)
            silent = silent_since(controller)
            now = time.monotonic()
            changed = False
            for key, replica_id in attached.items():
                if statuses.get(key) == contract.COORD_SILENT and key not in silent:
                    silent[key] = now
                    changed = True
                    logger.warning(
                        "stage %d replica %d (%s): heartbeats stopped past the heartbeat timeout; kept "
                        "attached and unroutable until they resume (its requests in flight wait)",
                        key[0],
                        replica_id,
                        key[1],
                    )
                elif statuses.get(key) == contract.COORD_UP and key in silent:
                    logger.warning(
                        "stage %d replica %d (%s): heartbeats resumed after %.1fs of silence; routable again",
                        key[0],
                        replica_id,
                        key[1],
                        now - silent.pop(key),
                    )
                    changed = True
            for key in [k for k in silent if k not in attached]:
                del silent[key]  # detached meanwhile (DOWN, a leave, a dead engine)
                changed = True
            if changed:
                _bump(controller)
        except asyncio.CancelledError:
            raise
        except Exception:  # a liveness note must never stop the watcher beside it
            logger.exception("engine liveness: silence watch iteration failed")
        await asyncio.sleep(WATCH_INTERVAL_S)


def local_engine(orch: Any, master: Any | None) -> tuple[str, str]:
    """(state, why) of the head's own stage-0 engine: contract.LOCAL_LIVE, LOCAL_SILENT or LOCAL_GONE.

    Its slots are the master's head-local ones on a distributed head, every slot on a static one.
    Gone: no client in any of them (evicted after its process died, or detached), or vLLM's client
    says the engine is dead."""
    pools = getattr(orch, "stage_pools", None) or []
    if not pools:
        return contract.LOCAL_LIVE, "the engine is not built yet"
    pool = pools[0]
    if master is not None:
        slots = [rid for sid, rid in getattr(master, "_head_local_slots", ()) if sid == 0]
    else:
        slots = list(range(len(pool.clients)))
    if not slots:
        return contract.LOCAL_LIVE, "the head runs no stage-0 engine of its own"
    controller = getattr(orch, "_membership", None)
    statuses = hub_statuses(controller) if controller is not None else {}
    from vllm_omni.engine.stage_pool import StagePool

    for rid in slots:
        client = pool.clients[rid] if rid < len(pool.clients) else None
        if client is None:
            continue
        if getattr(getattr(client, "resources", None), "engine_dead", False):
            return contract.LOCAL_GONE, f"stage-0 replica {rid}: its engine process died"
        addr = StagePool._client_input_addr(client)
        if statuses.get((0, addr)) == contract.COORD_SILENT:
            return contract.LOCAL_SILENT, f"stage-0 replica {rid}: heartbeats late past the heartbeat timeout"
        return contract.LOCAL_LIVE, f"stage-0 replica {rid} attached"
    return contract.LOCAL_GONE, f"stage-0 replica {slots[0]}: detached or evicted (its engine is gone)"


def silent_clients(pool: Any, counted: Any) -> int:
    """How many of the pool's clients for which `counted(client)` holds the coordinator lists as
    silent (0 where the pool belongs to no running orchestrator with a coordinator: a static head
    judges nothing here)."""
    from vllm_omni.engine.stage_pool import StagePool

    from . import membership

    orch = next((o for o in membership.running_orchestrators()
                 if any(p is pool for p in getattr(o, "stage_pools", None) or [])), None)
    controller = getattr(orch, "_membership", None)
    if controller is None:
        return 0
    statuses = hub_statuses(controller)
    stage_id = getattr(pool, "stage_id", None)
    return sum(1 for client in pool.clients if client is not None and counted(client)
               and statuses.get((stage_id, StagePool._client_input_addr(client))) == contract.COORD_SILENT)


def install() -> str | None:
    from vllm_omni.distributed.omni_coordinator.messages import ReplicaList, ReplicaStatus
    from vllm_omni.distributed.omni_coordinator.omni_coordinator import OmniCoordinator
    from vllm_omni.engine.membership_controller import MembershipController
    from vllm_omni.entrypoints.omni_base import OmniBase

    targets = (
        Target(OmniCoordinator, "get_active_replicas", ("self",)),
        Target(MembershipController, "handle_unregister", ("self", "stage_id", "input_addr"), more=True,
               coroutine=True),
        Target(MembershipController, "_watch_replica_list", ("self",), coroutine=True),
        Target(OmniBase, "_live_replica_count", ("self", "pool")),
    )
    problem = shape_problem(*targets)
    if problem:
        return problem
    if ours(NAME, *targets):
        return None

    @wrap(OmniCoordinator, "get_active_replicas", NAME)
    def get_active_replicas(orig, self):
        listed = orig(self)
        with self._lock:
            silent = [rep for rep in self._replicas.values() if rep.status == ReplicaStatus.ERROR]
        return ReplicaList(replicas=[*listed.replicas, *silent], timestamp=listed.timestamp)

    @wrap(MembershipController, "handle_unregister", NAME)
    async def handle_unregister(orig, self, stage_id, input_addr, *args, **kwargs):
        if _FROM_WATCHER.get() and hub_statuses(self).get((stage_id, input_addr)) == contract.COORD_SILENT:
            return None  # silent, not gone: _watch_silence says so once
        return await orig(self, stage_id, input_addr, *args, **kwargs)

    @wrap(OmniBase, "_live_replica_count", NAME)
    def _live_replica_count(orig, self, pool):
        live = orig(self, pool)
        if not live:
            return live
        try:
            silent = silent_clients(pool, lambda client: not self._replica_is_dead(client))
        except Exception:  # never fail /health on our own error: count as upstream does
            logger.warning("engine liveness: the silent replicas could not be counted", exc_info=True)
            return live
        return live - silent

    @wrap(MembershipController, "_watch_replica_list", NAME)
    async def _watch_replica_list(orig, self):
        watch = asyncio.create_task(_watch_silence(self), name="omnistage-silence-watch")
        _FROM_WATCHER.set(True)  # this task's context, and the unregister tasks it spawns
        try:
            return await orig(self)
        finally:
            watch.cancel()

    return None


__all__ = ["NAME", "hub_statuses", "local_engine", "silent_since"]
