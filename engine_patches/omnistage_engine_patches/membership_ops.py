"""The live head's membership operations (what :mod:`.membership_routes` serves): list
(:mod:`.membership_listing`), join, leave and hold (:mod:`.membership_departures`).

This module reads and changes the real vllm-omni 0.30.0 objects of a distributed head and holds
no membership truth of its own beyond what :mod:`.patches.membership` keeps (which pod a replica
belongs to, which replicas departed, an epoch):

* ``OmniMasterServer`` routes: every (stage, replica id) the head ever allocated, the host each
  replica registered from (``replica_host``), which slots are head-local, which have registered
  (and, from the stage config each registered with, the patch outcomes its process reported:
  :mod:`.registration_report`).
  Routes are never removed and replica ids never reused, so this table only grows with churn;
* the coordinator's view through the head's ``OmniCoordClientForHub`` (only UP replicas are
  published, so a replica is ``up`` or ``absent``);
* ``StagePool``: attached head-side clients, request affinity (= requests in flight);
* ``MembershipController``: the upstream detach path (``handle_unregister``), reused as is;
* the stat logger, through :mod:`.metric_series` (metric series at join, removed at leave).

Everything that reads or mutates those objects runs on the orchestrator's event loop (the loop
that owns them, where inference output processing also runs): :meth:`LiveHead.run` hands each
operation over with ``asyncio.run_coroutine_threadsafe``. Whatever an operation costs stalls
serving, so none of them walks the route table in Python: the default listing reads only the
candidates it can list (head-local, attached, and registered-but-not-departed keys, the last
kept up to date from the master's new registrations only), requests in flight are counted once
per pool, ``?all=true`` is paged, and join/leave by IP filter one copy of the routes at C speed.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Awaitable, Callable
from itertools import compress, repeat
from typing import Any

from . import contract, metric_series, report
from ._patching import LOOP, outcomes
from .membership_departures import POLL_SECONDS, Departures
from .membership_listing import MembershipError
from .patches import membership
from .patches.membership import Key, held_of

logger = logging.getLogger("omnistage_engine_patches.membership")

MAX_WAIT_SECONDS = 60.0


class LiveHead(Departures):
    """One distributed head's membership: its live objects found from its engine client, the
    listing (HeadReads), join here, leave and hold (Departures), each run on the orchestrator's loop."""

    @classmethod
    def locate(cls, engine_client: Any) -> LiveHead:
        if not membership.enabled():
            outcome = outcomes().get(membership.NAME)
            reason = outcome.reason if outcome is not None else "the plugin was not loaded in this process"
            raise MembershipError(503, "MembershipPatchDisabled",
                                  f"patch {membership.NAME!r} is not active: {reason}")
        engine = getattr(engine_client, "engine", engine_client)
        pools = getattr(engine, "stage_pools", None)
        orch = next((o for o in membership.running_orchestrators()
                     if pools is not None and o.stage_pools is pools), None)
        if orch is None:
            raise MembershipError(
                503, "EngineNotReady", "the head's orchestrator is not running (starting or stopped)"
            )
        loop = getattr(orch, LOOP, None)
        if loop is None or loop.is_closed():
            raise MembershipError(503, "EngineNotReady", "the head's orchestrator loop is not running")
        runtime = getattr(engine, "_runtime", None)
        get_master = getattr(runtime, "_get_omni_master_server", None)
        master = get_master() if callable(get_master) else None
        if master is None or getattr(orch, "_membership", None) is None:
            raise MembershipError(
                409, contract.E_NOT_DISTRIBUTED,
                "this head runs no OmniMasterServer (start it with --stage-id and a master address)",
            )
        for attr in ("_stage_routes", "_stage_configs", "_head_local_slots"):
            if not isinstance(getattr(master, attr, None), (dict, set)):
                raise MembershipError(501, "EngineShapeChanged", f"OmniMasterServer.{attr} changed shape")
        return cls(orch=orch, loop=loop, master=master, engine=engine, client=engine_client)

    async def run(self, fn: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
        """Run ``fn()`` on the orchestrator loop and wait for it (bounded). The caller going away
        (an HTTP client timing out) or the wait expiring does not cancel it, so an operation is
        never left half-done; a retried call finds its result (calls are idempotent)."""
        try:
            current = asyncio.get_running_loop()
        except RuntimeError:
            current = None
        if current is self.loop:
            return await fn()
        future = asyncio.run_coroutine_threadsafe(fn(), self.loop)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except TimeoutError as err:
            raise MembershipError(
                503,
                "EngineBusy",
                f"the orchestrator did not answer within {timeout:.0f}s; "
                "the operation continues, retry to see its result",
            ) from err

    def _check_stage(self, stage_id: int) -> None:
        if self._pool(stage_id) is None:
            raise MembershipError(404, "UnknownStage", f"stage {stage_id} is not served by this head",
                                  stage=stage_id, stages=self._stage_ids())

    @staticmethod
    def _routes_from(routes: dict[Key, Any], stage_id: int, ip: str) -> list[int]:
        hosts = map(operator.attrgetter("replica_host"), routes.values())  # C speed: no Python loop
        return sorted(rid for sid, rid in compress(routes.keys(), map(operator.eq, hosts, repeat(ip)))
                      if sid == stage_id)

    async def join(self, stage_id: int, pod: str, ip: str, wait_seconds: float = 5.0) -> dict[str, Any]:
        # Defence in depth: the operator joins nothing while the head's stage-0 frontend runs a
        # sender cache (a replica routed through it may miss tensors it never received).
        unsafe = report.frontend_cache_unsafe(self.client)
        if unsafe:
            raise MembershipError(409, contract.E_FRONTEND_CACHE_UNSAFE, unsafe, stage=stage_id, ip=ip)
        wait_seconds = max(0.0, min(float(wait_seconds), MAX_WAIT_SECONDS))

        async def op() -> dict[str, Any]:
            self._check_stage(stage_id)
            routes = self._routes()
            state = self.state
            pool = self._pool(stage_id)
            deadline = time.monotonic() + wait_seconds
            while True:
                candidates = [rid for rid in self._routes_from(routes, stage_id, ip)
                              if not state.has_left((stage_id, rid))]
                attached = [rid for rid in candidates if metric_series.attached(pool, rid)]
                if attached or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(POLL_SECONDS)
                routes = self._routes()  # a registration may have arrived meanwhile
            if not candidates:
                raise MembershipError(
                    404,
                    contract.E_REPLICA_NOT_REGISTERED,
                    f"no stage-{stage_id} replica has registered from {ip} yet (retry)",
                    stage=stage_id,
                    ip=ip,
                )
            if not attached:
                newest = candidates[-1]
                if all(state.departed.get((stage_id, rid)) == contract.DETACHED for rid in candidates):
                    raise MembershipError(
                        409, contract.E_REPLICA_DETACHED,
                        f"the replica registered from {ip} (id {newest}) was dropped by the head "
                        "(DOWN, heartbeat timeout or dead engine); restart it so it registers again",
                        stage=stage_id, ip=ip, replicaId=newest,
                    )
                raise MembershipError(
                    409, contract.E_REPLICA_NOT_ATTACHED,
                    f"replica {newest} registered from {ip} but the head has not attached it yet (retry)",
                    stage=stage_id, ip=ip, replicaId=newest,
                )
            replica_id = attached[-1]
            key = (stage_id, replica_id)
            owner = state.pods.get(key)
            if owner is not None and owner != pod:
                raise MembershipError(
                    409, "ReplicaOwnedByOtherPod",
                    f"replica {replica_id} from {ip} belongs to pod {owner!r}; leave it first",
                    stage=stage_id, replicaId=replica_id, pod=owner,
                )
            held = held_of(pool)
            if owner is None or replica_id in held:
                state.pods[key] = pod
                held.discard(replica_id)  # routable from the next pick on
                state.bump()
            if metric_series.enabled():
                metric_series.register_replica_series(self.orch, stage_id, replica_id)
            return {**self._header(), **self._entry(key, self._hub_up(), {}), "replicaIds": attached}

        return await self.run(op, timeout=wait_seconds + 30.0)


__all__ = ["LiveHead", "MembershipError"]
