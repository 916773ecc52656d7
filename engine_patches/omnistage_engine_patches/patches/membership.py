"""Patch ``membership``: the hooks a distributed vllm-omni head needs for the membership endpoint.

This module only changes upstream behaviour through wrappers and keeps the small state the
engine lacks; the operations that read and change a live head (list, join, leave) live in
:mod:`.membership_ops`, the HTTP layer in :mod:`.membership_routes`. The split keeps what runs inside
vllm-omni's own code paths (every pick, every attach) apart from what runs once per API call.

Switch it off with ``OMNISTAGE_DISABLE_PATCHES=membership``. The wrappers (upstream behaviour is
kept unless noted):

* ``OrchestratorBase.run``: records the running orchestrator and its loop, so the endpoint can
  find them from ``app.state.engine_client.engine`` (same ``stage_pools`` list object), and fixes
  the distributed head's shutdown (see :func:`_stop_watcher_on_shutdown`);
* ``StagePool._collect_serviceable_replicas`` (every fresh pick): leaves out replicas that are
  draining, so new requests stop going there while the ones bound to them (sticky affinity)
  finish; and, when the head's environment sets ``contract.ROUTE_JOINED_ONLY_ENV=1`` (the
  operator does), replicas *held* until the operator joins them;
* ``MembershipController._do_register`` (a replica's own registration attaches it): holds the
  replica when the gate above is on, bumps the membership epoch, forgets a stale "detached"
  mark, records a registration the head failed to attach as detached, and detaches at once a
  replica that was told to leave while its attach was in flight
  (otherwise it would come back as a zombie member). It sits *outside* ``replica_metrics``'s
  wrapper of the same function (``patches/__init__.py`` applies that one first): the zombie detach removes
  the series that wrapper has just registered;
* ``MembershipController._detach_replica``: records that the head dropped a replica on its own
  (DOWN, heartbeat timeout, dead engine) and clears its drain and hold marks.

Only head-side replicas attached through ``_do_register`` (registered after startup) are held:
the head's own local replicas, and remote replicas the head's startup plan waited for, never go
through it, so they stay routable.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .. import contract, metric_series
from .._patching import (
    DRAINING,
    HELD,
    LOOP,
    MEMBERSHIP_STATE,
    ORCHESTRATOR,
    Target,
    applied,
    ours,
    referent,
    shape_problem,
    wrap,
)

logger = logging.getLogger("omnistage_engine_patches.membership")

NAME = contract.MEMBERSHIP

#: How many leave results are kept in full, for idempotent answers to a repeated leave. Older
#: ones shrink to their identity (``MembershipState.departed`` keeps *that* a replica left).
MAX_LEFT_RECORDS = 4096
#: How many of the replicas the head detached on its own the default listing shows until a leave
#: answers them (the newest): the operator acts on each within a pass or two, so this is room for a
#: burst, and a head nobody cleans up after still lists a bounded number.
MAX_DETACHED_LISTED = 64

Key = tuple[int, int]  # (stage id, replica id), the OmniMasterServer's route key


@dataclass
class MembershipState:
    """What the engine does not know itself. Lives on the orchestrator, dies with the head."""

    epoch: int = 0
    #: (stage, replica) -> the pod the operator joined it as.
    pods: dict[Key, str] = field(default_factory=dict)
    #: (stage, replica) -> LEFT or DETACHED, for every replica that ever departed. Never pruned:
    #: replica ids are never reused, and a forgotten departure would list an old replica as
    #: ``registered`` again (the master keeps every route and its registration forever). One
    #: small entry per departure, far less than the route, ports and config upstream keeps for it.
    departed: dict[Key, str] = field(default_factory=dict)
    #: The newest MAX_LEFT_RECORDS leave results, oldest first.
    left_records: OrderedDict[Key, dict[str, Any]] = field(default_factory=OrderedDict)
    locks: dict[Key, asyncio.Lock] = field(default_factory=dict)
    #: Keys that registered with the master and have not departed: with the attached and the
    #: head-local ones, all the default listing can show. ``membership_ops`` adds registrations
    #: (reading only the master's new ones, see ``registrations_seen``); departures remove them
    #: here, so the listing never walks the ever-growing route table.
    registered_open: set[Key] = field(default_factory=set)
    #: (how many of the master's registrations were read, the last one read).
    registrations_seen: tuple[int, Key | None] = (0, None)
    #: Keys the head detached on its own and the operator has not made leave yet: listed (state
    #: DETACHED) so the operator can replace a pod whose engine the head dropped, or tell the head
    #: to forget it (a leave turns it LEFT and unlisted). Small: a leave empties it.
    detached_open: dict[Key, None] = field(default_factory=dict)  # insertion-ordered: the newest last

    def bump(self) -> None:
        self.epoch += 1

    def has_left(self, key: Key) -> bool:
        return self.departed.get(key) == contract.LEFT

    def remember_left(self, key: Key, record: dict[str, Any]) -> None:
        self.departed[key] = contract.LEFT
        self.registered_open.discard(key)
        self.detached_open.pop(key, None)
        self.left_records[key] = record
        self.left_records.move_to_end(key)
        while len(self.left_records) > MAX_LEFT_RECORDS:
            old, _ = self.left_records.popitem(last=False)
            self.pods.pop(old, None)
            self.locks.pop(old, None)

    def left_record(self, key: Key) -> dict[str, Any]:
        """The recorded leave result, or its identity once the details were dropped."""
        record = self.left_records.get(key)
        if record is not None:
            return record
        return {"stage": key[0], "replicaId": key[1], "pod": self.pods.get(key), "state": contract.LEFT,
                "detached": True, "recordExpired": True}

    def remember_detached(self, key: Key) -> None:
        if not self.has_left(key):
            self.departed[key] = contract.DETACHED
            self.detached_open[key] = None
            while len(self.detached_open) > MAX_DETACHED_LISTED:
                del self.detached_open[next(iter(self.detached_open))]
        self.registered_open.discard(key)

    def forget_detached(self, key: Key) -> None:
        if self.departed.get(key) == contract.DETACHED:
            del self.departed[key]
        self.detached_open.pop(key, None)


_ORCHESTRATORS: weakref.WeakSet[Any] = weakref.WeakSet()


def running_orchestrators() -> list[Any]:
    """Orchestrators whose ``run`` is executing in this process."""
    return list(_ORCHESTRATORS)


def enabled() -> bool:
    return applied(NAME)


def state_of(orch: Any) -> MembershipState:
    state = getattr(orch, MEMBERSHIP_STATE, None)
    if state is None:
        state = MembershipState()
        setattr(orch, MEMBERSHIP_STATE, state)
    return state


def draining_of(pool: Any) -> set[int]:
    """Replica ids of ``pool`` that get no fresh picks while their requests finish (a leave)."""
    return pool.__dict__.setdefault(DRAINING, set())


def held_of(pool: Any) -> set[int]:
    """Replica ids of ``pool`` held unroutable until the operator joins them."""
    return pool.__dict__.setdefault(HELD, set())


def route_joined_only() -> bool:
    """The head's gate: replicas that register after startup get traffic only once joined."""
    return os.environ.get(contract.ROUTE_JOINED_ONLY_ENV, "").strip() == "1"


def _attach_failed(controller: Any, key: Key) -> None:
    """The head will not attach this registration (handshake failed, head shutting down): it is
    dropped, like a replica the head detaches. Otherwise it would stay ``registered`` for the
    life of the head (upstream attaches a registration once), in every default listing."""
    orch = referent(controller, ORCHESTRATOR)
    if orch is not None:
        state = state_of(orch)
        state.remember_detached(key)
        state.bump()


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


def install() -> str | None:
    from vllm_omni.engine.membership_controller import MembershipController
    from vllm_omni.engine.orchestrator import OrchestratorBase
    from vllm_omni.engine.stage_pool import StagePool

    targets = (
        Target(OrchestratorBase, "run", ("self",), coroutine=True),
        Target(StagePool, "_collect_serviceable_replicas", ("self",)),
        Target(MembershipController, "_do_register", ("self", "stage_id", "replica_id")),
        Target(MembershipController, "_detach_replica", ("self", "stage_id", "input_addr")),
        Target(MembershipController, "handle_unregister", ("self", "stage_id", "input_addr"), more=True),
    )
    problem = shape_problem(*targets, *(Target(StagePool, attr) for attr in (
        "get_replica_id_by_addr", "get_client_by_addr", "remove_client", "_client_input_addr")))
    if problem:
        return problem
    if ours(NAME, *targets):
        return None  # our own wrappers are already in place

    @wrap(OrchestratorBase, "run", NAME)
    async def run(orig, self):
        setattr(self, LOOP, asyncio.get_running_loop())
        state_of(self)
        controller = getattr(self, "_membership", None)
        stopper = None
        if controller is not None:
            setattr(controller, ORCHESTRATOR, weakref.ref(self))
            stopper = asyncio.create_task(
                _stop_watcher_on_shutdown(self, controller), name="omnistage-membership-stop"
            )
        _ORCHESTRATORS.add(self)
        try:
            return await orig(self)
        finally:
            _ORCHESTRATORS.discard(self)
            setattr(self, LOOP, None)
            if stopper is not None:
                stopper.cancel()

    @wrap(StagePool, "_collect_serviceable_replicas", NAME)
    def _collect_serviceable_replicas(orig, self):
        candidates = orig(self)
        # Runs on every fresh pick: both sets are empty unless a leave or the gate is active.
        draining = self.__dict__.get(DRAINING)
        held = self.__dict__.get(HELD)
        if draining or held:
            excluded = (draining or set()) | (held or set())
            candidates = [(info, rid) for info, rid in candidates if rid not in excluded]
        return candidates

    @wrap(MembershipController, "_do_register", NAME)
    async def _do_register(orig, self, stage_id, replica_id):
        pool = self._pool_for_stage_id(stage_id)
        orch = referent(self, ORCHESTRATOR)
        key = (stage_id, replica_id)
        # Held *before* upstream adds the client to the pool, so no pick can see it un-held.
        hold = (
            pool is not None and route_joined_only() and not (orch is not None and key in state_of(orch).pods)
        )
        if hold:
            held_of(pool).add(replica_id)
        try:
            input_addr = await orig(self, stage_id, replica_id)
        except BaseException:
            if hold:
                held_of(pool).discard(replica_id)
            _attach_failed(self, key)
            raise
        if input_addr is None:
            if hold:
                held_of(pool).discard(replica_id)
            _attach_failed(self, key)
            return input_addr
        if hold:
            logger.info("stage %d replica %d attached; held unroutable until the operator joins it",
                        stage_id, replica_id)
        orch = referent(self, ORCHESTRATOR)
        if orch is None:
            return input_addr
        state = state_of(orch)
        state.forget_detached(key)
        state.bump()
        if state.has_left(key):
            # The operator asked this replica to leave while the head was still attaching it.
            logger.info(
                "stage %d replica %d attached after it was told to leave: detaching", stage_id, replica_id
            )
            self._detach_replica(stage_id, input_addr)
            if metric_series.enabled():
                metric_series.remove_replica_series(orch, stage_id, replica_id)
            return None  # _register_once then records nothing for it
        return input_addr

    @wrap(MembershipController, "_detach_replica", NAME)
    def _detach_replica(orig, self, stage_id, input_addr):
        pool = self._pool_for_stage_id(stage_id)
        replica_id = pool.get_replica_id_by_addr(input_addr) if pool is not None else None
        was_attached = pool is not None and pool.get_client_by_addr(input_addr) is not None
        try:
            return orig(self, stage_id, input_addr)
        finally:
            if replica_id is not None:
                draining_of(pool).discard(replica_id)
                held_of(pool).discard(replica_id)
            orch = referent(self, ORCHESTRATOR)
            if orch is not None and replica_id is not None and was_attached and (
                pool.get_client_by_addr(input_addr) is None
            ):
                state = state_of(orch)
                state.remember_detached((stage_id, replica_id))
                state.bump()

    return None
__all__ = [
    "MAX_LEFT_RECORDS",
    "NAME",
    "MembershipState",
    "draining_of",
    "enabled",
    "held_of",
    "route_joined_only",
    "running_orchestrators",
    "state_of",
]
