"""Engine-side membership of a distributed vllm-omni head: list, join, leave.

This module operates on the real vllm-omni 0.30.0 objects of the head process and holds no
membership truth of its own beyond what the engine lacks (which pod a replica belongs to, which
replicas were told to leave, an epoch):

* ``OmniMasterServer`` routes: every (stage, replica id) the head ever allocated, the host each
  replica registered from (``replica_host``), which slots are head-local, which have registered;
* the coordinator's view through the head's ``OmniCoordClientForHub`` (only UP replicas are
  published, so a replica is ``up`` or ``absent``);
* ``StagePool``: attached head-side clients, request affinity (= requests in flight);
* ``MembershipController``: the upstream detach path (``handle_unregister``), reused as is;
* the stat logger, through :mod:`.replica_metrics` (metric series at join, removed at leave).

Everything that reads or mutates those objects runs on the orchestrator's event loop (the loop
that owns them): the HTTP layer (:mod:`.membership_api`) hands each operation over with
``asyncio.run_coroutine_threadsafe`` and waits for the answer.

Patch ``membership`` (switch off with ``OMNISTAGE_DISABLE_PATCHES=membership``) installs the
hooks this needs, all as wrappers that keep upstream behaviour:

* ``OrchestratorBase.run``: records the running orchestrator and its loop, so the endpoint can
  find them from ``app.state.engine_client.engine`` (same ``stage_pools`` list object);
* ``StagePool._collect_serviceable_replicas``: leaves out replicas that are draining, so fresh
  picks (``pick``/``preselect_replica_id``) stop choosing them while requests already bound to
  them (sticky affinity) finish there;
* ``MembershipController._do_register`` / ``_detach_replica``: bump the membership epoch, forget
  stale "detached" marks, and detach at once a replica that was told to leave while its attach
  was still in flight (otherwise it would come back as a zombie member).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from . import replica_metrics
from ._patching import Outcome, apply_patch, mark, outcomes

logger = logging.getLogger("omnistage_engine_patches.membership")

PATCH = "membership"

#: A new value per head process: a changed boot id tells the operator the head restarted, and
#: that every replica registered with the previous process must be rolled.
BOOT_ID = uuid.uuid4().hex

# States of a replica in the listing.
PENDING = "pending"  # slot pre-allocated by the head, nobody registered yet
REGISTERED = "registered"  # registered with the master, head-side attach not done (yet)
ATTACHED = "attached"  # head-side client in the stage pool: routable when the coordinator says UP
DRAINING = "draining"  # attached, no new requests routed, waiting for in-flight ones
DETACHED = "detached"  # the head dropped it on its own (DOWN, heartbeat timeout, dead engine)
LEFT = "left"  # detached because of a leave call
LISTED_STATES = frozenset({REGISTERED, ATTACHED, DRAINING})

MAX_WAIT_SECONDS = 60.0
MAX_DRAIN_SECONDS = 3600.0
POLL_SECONDS = 0.05
_MAX_RECORDS = 4096  # bound on remembered left/detached replicas (replica ids are never reused)


class MembershipError(Exception):
    """An answer for the caller: HTTP status, a stable error code, a message, details."""

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, "bootId": BOOT_ID, **self.details}


@dataclass
class MembershipState:
    """What the engine does not know itself. Lives on the orchestrator, dies with the head."""

    epoch: int = 0
    pods: dict[tuple[int, int], str] = field(default_factory=dict)
    left: OrderedDict[tuple[int, int], dict[str, Any]] = field(default_factory=OrderedDict)
    detached: OrderedDict[tuple[int, int], float] = field(default_factory=OrderedDict)
    locks: dict[tuple[int, int], asyncio.Lock] = field(default_factory=dict)

    def bump(self) -> None:
        self.epoch += 1

    def remember_left(self, key: tuple[int, int], record: dict[str, Any]) -> None:
        self.left[key] = record
        self.left.move_to_end(key)
        while len(self.left) > _MAX_RECORDS:
            old, _ = self.left.popitem(last=False)
            self.pods.pop(old, None)
            self.locks.pop(old, None)

    def remember_detached(self, key: tuple[int, int]) -> None:
        self.detached[key] = time.time()
        while len(self.detached) > _MAX_RECORDS:
            self.detached.popitem(last=False)


_ORCHESTRATORS: weakref.WeakSet[Any] = weakref.WeakSet()


def enabled() -> bool:
    outcome = outcomes().get(PATCH)
    return bool(outcome and outcome.applied)


def state_of(orch: Any) -> MembershipState:
    state = getattr(orch, "_omnistage_membership", None)
    if state is None:
        state = MembershipState()
        orch._omnistage_membership = state
    return state


def _orchestrator_of_controller(controller: Any) -> Any | None:
    ref = getattr(controller, "_omnistage_orchestrator", None)
    return ref() if ref is not None else None


def _client_addr(client: Any) -> str | None:
    from vllm_omni.engine.stage_pool import StagePool

    return StagePool._client_input_addr(client) if client is not None else None


# --------------------------------------------------------------------------------------------
# The patch
# --------------------------------------------------------------------------------------------


async def _stop_watcher_on_shutdown(orch: Any, controller: Any) -> None:
    """Let a distributed head's orchestrator stop.

    In 0.30.0 ``OrchestratorBase.run`` gathers the membership watcher with its other tasks, but
    the watcher only stops on the controller's own shutdown event, which ``run`` sets after the
    gather returns: the gather never returns, ``OmniEngineBase.shutdown`` gives up after 30 s and
    defers the runtime's cleanup (master server, coordinator) to a thread that never finishes.
    Setting the controller's event when the orchestrator's is set ends the watcher within its
    0.5 s tick; ``run``'s own teardown (drain, ``controller.shutdown()``) then proceeds.
    """
    shutdown_event = getattr(orch, "_shutdown_event", None)
    controller_event = getattr(controller, "_shutdown_event", None)
    if not isinstance(shutdown_event, asyncio.Event) or not isinstance(controller_event, asyncio.Event):
        return
    await shutdown_event.wait()
    controller_event.set()


def _install() -> str | None:
    from vllm_omni.engine.membership_controller import MembershipController
    from vllm_omni.engine.orchestrator import OrchestratorBase
    from vllm_omni.engine.stage_pool import StagePool

    targets = {
        "OrchestratorBase.run": getattr(OrchestratorBase, "run", None),
        "StagePool._collect_serviceable_replicas": getattr(StagePool, "_collect_serviceable_replicas", None),
        "MembershipController._do_register": getattr(MembershipController, "_do_register", None),
        "MembershipController._detach_replica": getattr(MembershipController, "_detach_replica", None),
        "MembershipController.handle_unregister": getattr(MembershipController, "handle_unregister", None),
    }
    for label, fn in targets.items():
        if not callable(fn):
            return f"target changed shape: {label} is missing"
    params = {label: list(inspect.signature(fn).parameters) for label, fn in targets.items()}
    if not inspect.iscoroutinefunction(OrchestratorBase.run) or params["OrchestratorBase.run"] != ["self"]:
        return "target changed shape: async OrchestratorBase.run(self)"
    if params["StagePool._collect_serviceable_replicas"] != ["self"]:
        return "target changed shape: StagePool._collect_serviceable_replicas(self)"
    if params["MembershipController._do_register"] != ["self", "stage_id", "replica_id"]:
        return "target changed shape: MembershipController._do_register(self, stage_id, replica_id)"
    if params["MembershipController._detach_replica"] != ["self", "stage_id", "input_addr"]:
        return "target changed shape: MembershipController._detach_replica(self, stage_id, input_addr)"
    if params["MembershipController.handle_unregister"][:3] != ["self", "stage_id", "input_addr"]:
        return "target changed shape: MembershipController.handle_unregister(self, stage_id, input_addr, ...)"
    for attr in ("get_replica_id_by_addr", "get_client_by_addr", "remove_client", "_client_input_addr"):
        if not callable(getattr(StagePool, attr, None)):
            return f"target changed shape: StagePool.{attr} is missing"
    if any(replica_metrics.wrapped_by(fn, PATCH) for fn in targets.values()):
        return None  # our own wrappers are already in place

    orig_run = OrchestratorBase.run
    orig_collect = StagePool._collect_serviceable_replicas
    orig_do_register = MembershipController._do_register
    orig_detach = MembershipController._detach_replica

    @functools.wraps(orig_run)
    async def run(self):
        self._omnistage_loop = asyncio.get_running_loop()
        state_of(self)
        controller = getattr(self, "_membership", None)
        stopper = None
        if controller is not None:
            controller._omnistage_orchestrator = weakref.ref(self)
            stopper = asyncio.create_task(_stop_watcher_on_shutdown(self, controller), name="omnistage-membership-stop")
        _ORCHESTRATORS.add(self)
        try:
            return await orig_run(self)
        finally:
            _ORCHESTRATORS.discard(self)
            self._omnistage_loop = None
            if stopper is not None:
                stopper.cancel()

    @functools.wraps(orig_collect)
    def _collect_serviceable_replicas(self):
        candidates = orig_collect(self)
        draining = getattr(self, "_omnistage_draining", None)
        if draining:
            candidates = [(info, rid) for info, rid in candidates if rid not in draining]
        return candidates

    @functools.wraps(orig_do_register)
    async def _do_register(self, stage_id, replica_id):
        input_addr = await orig_do_register(self, stage_id, replica_id)
        orch = _orchestrator_of_controller(self)
        if input_addr is None or orch is None:
            return input_addr
        state, key = state_of(orch), (stage_id, replica_id)
        state.detached.pop(key, None)
        state.bump()
        if key in state.left:
            # The operator asked this replica to leave while the head was still attaching it.
            logger.info("stage %d replica %d attached after it was told to leave: detaching", stage_id, replica_id)
            self._detach_replica(stage_id, input_addr)
            if replica_metrics.enabled():
                replica_metrics.remove_replica_series(orch, stage_id, replica_id)
            return None  # _register_once then records nothing for it
        return input_addr

    @functools.wraps(orig_detach)
    def _detach_replica(self, stage_id, input_addr):
        pool = self._pool_for_stage_id(stage_id)
        replica_id = pool.get_replica_id_by_addr(input_addr) if pool is not None else None
        was_attached = pool is not None and pool.get_client_by_addr(input_addr) is not None
        try:
            return orig_detach(self, stage_id, input_addr)
        finally:
            orch = _orchestrator_of_controller(self)
            if orch is not None and replica_id is not None:
                draining = getattr(pool, "_omnistage_draining", None)
                if draining is not None:
                    draining.discard(replica_id)
                if was_attached and pool.get_client_by_addr(input_addr) is None:
                    state = state_of(orch)
                    if (stage_id, replica_id) not in state.left:
                        state.remember_detached((stage_id, replica_id))
                    state.bump()

    OrchestratorBase.run = mark(run, PATCH)
    StagePool._collect_serviceable_replicas = mark(_collect_serviceable_replicas, PATCH)
    MembershipController._do_register = mark(_do_register, PATCH)
    MembershipController._detach_replica = mark(_detach_replica, PATCH)
    return None


def apply() -> Outcome:
    return apply_patch(PATCH, _install)


# --------------------------------------------------------------------------------------------
# The head: locating the live objects
# --------------------------------------------------------------------------------------------


@dataclass
class Head:
    """The live objects of one distributed head, as found from its engine client."""

    orch: Any
    loop: asyncio.AbstractEventLoop
    master: Any
    engine: Any = None

    @classmethod
    def locate(cls, engine_client: Any) -> Head:
        if not enabled():
            reason = (outcomes().get(PATCH) or Outcome(PATCH, False, "not applied")).reason
            raise MembershipError(503, "MembershipPatchDisabled", f"patch {PATCH!r} is not active: {reason}")
        engine = getattr(engine_client, "engine", engine_client)
        pools = getattr(engine, "stage_pools", None)
        orch = next((o for o in list(_ORCHESTRATORS) if pools is not None and o.stage_pools is pools), None)
        if orch is None:
            raise MembershipError(503, "EngineNotReady", "the head's orchestrator is not running (starting or stopped)")
        loop = getattr(orch, "_omnistage_loop", None)
        if loop is None or loop.is_closed():
            raise MembershipError(503, "EngineNotReady", "the head's orchestrator loop is not running")
        runtime = getattr(engine, "_runtime", None)
        get_master = getattr(runtime, "_get_omni_master_server", None)
        master = get_master() if callable(get_master) else None
        if master is None or getattr(orch, "_membership", None) is None:
            raise MembershipError(
                409, "NotDistributed", "this head runs no OmniMasterServer (start it with --stage-id and a master address)"
            )
        for attr in ("_stage_routes", "_stage_configs", "_head_local_slots"):
            if not isinstance(getattr(master, attr, None), (dict, set)):
                raise MembershipError(501, "EngineShapeChanged", f"OmniMasterServer.{attr} changed shape")
        return cls(orch=orch, loop=loop, master=master, engine=engine)

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
            raise MembershipError(503, "EngineBusy", f"the orchestrator did not answer within {timeout:.0f}s; "
                                  "the operation continues, retry to see its result") from err

    # ---- reads (orchestrator loop) ----

    def _pool(self, stage_id: int) -> Any | None:
        pools = self.orch.stage_pools
        return pools[stage_id] if 0 <= stage_id < len(pools) else None

    def _routes(self) -> dict[tuple[int, int], Any]:
        """A consistent copy of the master's routes (its registration thread adds to them under
        ``_alloc_lock``)."""
        lock = getattr(self.master, "_alloc_lock", None)
        if lock is None:
            return dict(self.master._stage_routes)
        with lock:
            return dict(self.master._stage_routes)

    def _stage_ids(self) -> list[int]:
        return sorted({sid for sid, _ in self._routes()})

    def _hub_up(self) -> dict[str, Any]:
        hub = getattr(self.orch._membership, "_hub", None)
        if hub is None:
            return {}
        return {rep.input_addr: rep for rep in hub.get_replica_list().replicas}

    @staticmethod
    def _in_flight(pool: Any, replica_id: int, addr: str | None) -> int:
        # Head-side routing state: a request's affinity row lives from pick() until the
        # orchestrator releases its bindings (finished, aborted or failed).
        affinity = getattr(pool, "_affinity", None) or {}
        bindings = getattr(pool, "_request_bindings", None) or {}
        return sum(1 for a in list(affinity.values()) if addr is not None and a == addr) + sum(
            1 for r in list(bindings.values()) if r == replica_id
        )

    def _entry(self, key: tuple[int, int], up: dict[str, Any]) -> dict[str, Any]:
        stage_id, replica_id = key
        state = state_of(self.orch)
        alloc = self._routes()[key]
        pool = self._pool(stage_id)
        client = None
        if pool is not None and 0 <= replica_id < len(pool.clients):
            client = pool.clients[replica_id]
        addr = _client_addr(client) or getattr(alloc, "input_bind_address", None)
        draining = pool is not None and replica_id in (getattr(pool, "_omnistage_draining", None) or ())
        registered = key in self.master._stage_configs
        if key in state.left:
            status = LEFT
        elif client is not None:
            status = DRAINING if draining else ATTACHED
        elif key in state.detached:
            status = DETACHED
        else:
            status = REGISTERED if registered else PENDING
        rep = up.get(addr) if addr else None
        return {
            "stage": stage_id,
            "replicaId": replica_id,
            "host": getattr(alloc, "replica_host", None),
            "pod": state.pods.get(key),
            "local": key in self.master._head_local_slots,
            "state": status,
            "registered": registered,
            "attached": client is not None,
            "coordinatorStatus": "up" if rep is not None else "absent",
            "queueLength": int(rep.queue_length) if rep is not None else None,
            "inFlight": self._in_flight(pool, replica_id, addr) if pool is not None else 0,
            "draining": draining,
            "metricsRegistered": replica_metrics.series_registered(self.orch, stage_id, replica_id),
        }

    def _header(self) -> dict[str, Any]:
        return {
            "bootId": BOOT_ID,
            "epoch": state_of(self.orch).epoch,
            "distributed": True,
            "metricsEnabled": getattr(self.orch, "_stat_logger", None) is not None and replica_metrics.enabled(),
        }

    # ---- operations ----

    async def snapshot(self, include_all: bool = False) -> dict[str, Any]:
        async def op() -> dict[str, Any]:
            up = self._hub_up()
            stages: dict[str, list[dict[str, Any]]] = {str(sid): [] for sid in self._stage_ids()}
            for key in sorted(self._routes()):
                entry = self._entry(key, up)
                if include_all or entry["local"] or entry["state"] in LISTED_STATES:
                    stages[str(key[0])].append(entry)
            return {**self._header(), "stages": stages}

        return await self.run(op)

    def _check_stage(self, stage_id: int) -> None:
        if stage_id not in self._stage_ids() or self._pool(stage_id) is None:
            raise MembershipError(404, "UnknownStage", f"stage {stage_id} is not served by this head",
                                  stage=stage_id, stages=self._stage_ids())

    def _routes_from(self, stage_id: int, ip: str) -> list[int]:
        return sorted(
            rid for (sid, rid), alloc in self._routes().items()
            if sid == stage_id and getattr(alloc, "replica_host", None) == ip
        )

    async def join(self, stage_id: int, pod: str, ip: str, wait_seconds: float = 5.0) -> dict[str, Any]:
        wait_seconds = max(0.0, min(float(wait_seconds), MAX_WAIT_SECONDS))

        async def op() -> dict[str, Any]:
            self._check_stage(stage_id)
            state = state_of(self.orch)
            pool = self._pool(stage_id)
            deadline = time.monotonic() + wait_seconds
            while True:
                candidates = [rid for rid in self._routes_from(stage_id, ip) if (stage_id, rid) not in state.left]
                attached = [rid for rid in candidates if replica_metrics._attached(pool, rid)]
                if attached or time.monotonic() >= deadline:
                    break
                await asyncio.sleep(POLL_SECONDS)
            if not candidates:
                raise MembershipError(
                    404, "ReplicaNotRegistered",
                    f"no stage-{stage_id} replica has registered from {ip} yet (retry)", stage=stage_id, ip=ip,
                )
            if not attached:
                newest = candidates[-1]
                if all((stage_id, rid) in state.detached for rid in candidates):
                    raise MembershipError(
                        409, "ReplicaDetached",
                        f"the replica registered from {ip} (id {newest}) was dropped by the head "
                        "(DOWN, heartbeat timeout or dead engine); restart it so it registers again",
                        stage=stage_id, ip=ip, replicaId=newest,
                    )
                raise MembershipError(
                    409, "ReplicaNotAttached",
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
            if owner is None:
                state.pods[key] = pod
                state.bump()
            if replica_metrics.enabled():
                replica_metrics.register_replica_series(self.orch, stage_id, replica_id)
            return {**self._header(), **self._entry(key, self._hub_up()), "replicaIds": attached}

        return await self.run(op, timeout=wait_seconds + 30.0)

    def _resolve(self, stage_id: int, replica_id: int | None, pod: str | None, ip: str | None) -> tuple[int, int]:
        state = state_of(self.orch)
        routes = self._routes()
        if replica_id is not None:
            key = (stage_id, replica_id)
            if key not in routes:
                raise MembershipError(404, "UnknownReplica", f"stage {stage_id} has no replica {replica_id}",
                                      stage=stage_id, replicaId=replica_id)
            owner = state.pods.get(key)
            if pod and owner is not None and owner != pod:
                raise MembershipError(409, "PodMismatch", f"replica {replica_id} belongs to pod {owner!r}, not {pod!r}",
                                      stage=stage_id, replicaId=replica_id, pod=owner)
            return key
        pool = self._pool(stage_id)

        def rank(key: tuple[int, int]) -> tuple[bool, bool, int]:
            # Prefer a replica still in the membership, then an attached one, then the newest.
            return (key not in state.left, replica_metrics._attached(pool, key[1]), key[1])

        if pod:
            keys = [k for k, p in list(state.pods.items()) if p == pod and k[0] == stage_id]
            if keys:
                return max(keys, key=rank)
        if ip:
            keys = [(stage_id, rid) for rid in self._routes_from(stage_id, ip)]
            if keys:
                return max(keys, key=rank)
        raise MembershipError(404, "UnknownReplica", f"no stage-{stage_id} replica matches pod={pod!r} ip={ip!r}",
                              stage=stage_id, pod=pod, ip=ip)

    async def leave(
        self,
        stage_id: int,
        *,
        replica_id: int | None = None,
        pod: str | None = None,
        ip: str | None = None,
        drain_timeout: float = 30.0,
    ) -> dict[str, Any]:
        drain_timeout = max(0.0, min(float(drain_timeout), MAX_DRAIN_SECONDS))

        async def op() -> dict[str, Any]:
            self._check_stage(stage_id)
            key = self._resolve(stage_id, replica_id, pod, ip)
            if key in self.master._head_local_slots:
                raise MembershipError(409, "HeadLocalReplica",
                                      f"replica {key[1]} runs inside the head; it cannot leave", replicaId=key[1])
            state = state_of(self.orch)
            lock = state.locks.setdefault(key, asyncio.Lock())
            async with lock:  # a concurrent leave for the same replica waits, then sees "left"
                if key in state.left:
                    return {**self._header(), **state.left[key], "alreadyLeft": True}
                record = await self._leave_locked(key, drain_timeout)
                state.remember_left(key, record)
                state.bump()
                return {**self._header(), **record, "alreadyLeft": False}

        return await self.run(op, timeout=drain_timeout + 30.0)

    async def _leave_locked(self, key: tuple[int, int], drain_timeout: float) -> dict[str, Any]:
        stage_id, replica_id = key
        state = state_of(self.orch)
        pool = self._pool(stage_id)
        client = pool.clients[replica_id] if 0 <= replica_id < len(pool.clients) else None
        started = time.monotonic()
        record: dict[str, Any] = {
            "stage": stage_id, "replicaId": replica_id, "pod": state.pods.get(key), "state": LEFT,
            "host": getattr(self._routes()[key], "replica_host", None),
        }
        if client is None:
            # Never attached, or the head already dropped it (DOWN / heartbeat timeout): nothing
            # is routed to it and nothing is in flight there.
            if replica_metrics.enabled():
                replica_metrics.remove_replica_series(self.orch, stage_id, replica_id)
            return {**record, "drained": True, "timedOut": False, "detached": False, "inFlightAtDetach": 0,
                    "waitedSeconds": 0.0, "metricsRegistered": replica_metrics.series_registered(self.orch, *key)}

        addr = _client_addr(client)
        draining = pool.__dict__.setdefault("_omnistage_draining", set())
        draining.add(replica_id)  # 1. no new requests
        state.bump()
        logger.info("stage %d replica %d draining (timeout %.1fs)", stage_id, replica_id, drain_timeout)
        deadline = started + drain_timeout
        in_flight: int | None = None
        cleanup_error: str | None = None
        try:
            # 2. wait for the requests already routed there (bounded by the drain timeout)
            while self._in_flight(pool, replica_id, addr) > 0 and time.monotonic() < deadline:
                if pool.clients[replica_id] is not client:
                    break  # the head dropped it meanwhile (DOWN): nothing left to wait for
                await asyncio.sleep(POLL_SECONDS)
            in_flight = self._in_flight(pool, replica_id, addr)
            # 3. detach through the upstream path: affinity invalidated, client removed and shut
            #    down, requests still bound there failed with "stage replica disappeared", and
            #    the replica-removed callback (metric series removal) called.
            await self.orch._membership.handle_unregister(stage_id, addr)
        except BaseException as exc:
            if pool.clients[replica_id] is client:
                # Not detached: restore routing, so nothing is left half-applied.
                draining.discard(replica_id)
                state.bump()
                if isinstance(exc, Exception):
                    raise MembershipError(
                        500, "DetachFailed", f"detaching replica {replica_id} failed: {exc}; routing restored",
                        replicaId=replica_id,
                    ) from exc
                raise
            if not isinstance(exc, Exception):
                raise
            # Detached, but failing the requests still bound there raised: report it.
            logger.exception("stage %d replica %d detached; its request cleanup failed", stage_id, replica_id)
            cleanup_error = str(exc) or type(exc).__name__
        finally:
            draining.discard(replica_id)
        in_flight = in_flight or 0
        if replica_metrics.enabled():
            replica_metrics.remove_replica_series(self.orch, stage_id, replica_id)  # idempotent
        waited = round(time.monotonic() - started, 3)
        logger.info("stage %d replica %d left (in flight at detach: %d, waited %.2fs)", stage_id, replica_id,
                    in_flight, waited)
        out = {**record, "drained": in_flight == 0, "timedOut": in_flight > 0, "detached": True,
               "inFlightAtDetach": in_flight, "waitedSeconds": waited,
               "metricsRegistered": replica_metrics.series_registered(self.orch, *key)}
        if cleanup_error is not None:
            out["cleanupError"] = cleanup_error
        return out


__all__ = [
    "BOOT_ID",
    "PATCH",
    "Head",
    "MembershipError",
    "MembershipState",
    "apply",
    "enabled",
    "state_of",
]
