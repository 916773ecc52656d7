"""The head's departures: a replica leaves (drained, then detached for good) or is held (drained and
kept attached, unroutable, under no pod name: a standby one join away). Mixed into
:class:`.membership_ops.LiveHead`, which runs them on the orchestrator's loop; what crosses the wire
is :mod:`.membership_routes`'."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from . import contract, metric_series
from .membership_listing import HeadReads, InFlight, MembershipError, client_addr
from .patches.membership import Key, draining_of, held_of

logger = logging.getLogger("omnistage_engine_patches.membership")

MAX_DRAIN_SECONDS = 3600.0
POLL_SECONDS = 0.05


async def _in_flight_after(pool: Any, replica_id: int, client: Any, deadline: float) -> int:
    """The replica's requests in flight once none is left, the deadline passed, or the head dropped it
    (DOWN: nothing left to wait for)."""
    addr = client_addr(client)
    while InFlight(pool).of(replica_id, addr) > 0 and time.monotonic() < deadline:
        if pool.clients[replica_id] is not client:
            break
        await asyncio.sleep(POLL_SECONDS)
    return InFlight(pool).of(replica_id, addr)


class Departures(HeadReads):
    """leave and hold, and how a call names its replica (_resolve)."""

    # LiveHead's: the orchestrator loop's runner, the stage check and the route filter.
    run: Callable[..., Awaitable[Any]]
    _check_stage: Callable[[int], None]
    _routes_from: Callable[[dict[Key, Any], int, str], list[int]]

    def _remote(self, stage_id: int, replica_id: int | None, pod: str | None, ip: str | None,
                verb: str) -> Key:
        """The replica a leave or hold names; never the head's own (it runs inside the head)."""
        self._check_stage(stage_id)
        key = self._resolve(stage_id, replica_id, pod, ip)
        if key in self.master._head_local_slots:
            raise MembershipError(409, "HeadLocalReplica", f"replica {key[1]} runs inside the head; it "
                                  f"cannot {verb}", replicaId=key[1])
        return key

    def _resolve(self, stage_id: int, replica_id: int | None, pod: str | None, ip: str | None) -> Key:
        state = self.state
        if replica_id is not None:
            key = (stage_id, replica_id)
            if key not in self.master._stage_routes:
                raise MembershipError(404, "UnknownReplica", f"stage {stage_id} has no replica {replica_id}",
                                      stage=stage_id, replicaId=replica_id)
            owner = state.pods.get(key)
            if pod and owner is not None and owner != pod:
                raise MembershipError(
                    409,
                    "PodMismatch",
                    f"replica {replica_id} belongs to pod {owner!r}, not {pod!r}",
                    stage=stage_id,
                    replicaId=replica_id,
                    pod=owner,
                )
            return key
        pool = self._pool(stage_id)

        def rank(key: Key) -> tuple[bool, bool, int]:
            # Prefer a replica still in the membership, then an attached one, then the newest.
            return (not state.has_left(key), metric_series.attached(pool, key[1]), key[1])

        if pod:
            keys = [k for k, p in state.pods.items() if p == pod and k[0] == stage_id]
            if keys:
                return max(keys, key=rank)
        if ip:
            keys = [(stage_id, rid) for rid in self._routes_from(self._routes(), stage_id, ip)]
            if keys:
                return max(keys, key=rank)
        raise MembershipError(
            404,
            "UnknownReplica",
            f"no stage-{stage_id} replica matches pod={pod!r} ip={ip!r}",
            stage=stage_id,
            pod=pod,
            ip=ip,
        )

    async def leave(self, stage_id: int, *, replica_id: int | None = None, pod: str | None = None,
                    ip: str | None = None, drain_timeout: float = 30.0) -> dict[str, Any]:
        drain_timeout = max(0.0, min(float(drain_timeout), MAX_DRAIN_SECONDS))

        async def op() -> dict[str, Any]:
            key = self._remote(stage_id, replica_id, pod, ip, "leave")
            state = self.state
            lock = state.locks.setdefault(key, asyncio.Lock())
            async with lock:  # a concurrent leave for the same replica waits, then sees "left"
                if state.has_left(key):
                    return {**self._header(), **state.left_record(key), "alreadyLeft": True}
                record = await self._leave_locked(key, drain_timeout)
                state.remember_left(key, record)
                state.bump()
                return {**self._header(), **record, "alreadyLeft": False}

        return await self.run(op, timeout=drain_timeout + 30.0)

    async def hold(self, stage_id: int, *, replica_id: int | None = None, pod: str | None = None,
                   ip: str | None = None, drain_timeout: float = 30.0) -> dict[str, Any]:
        """A joined replica stands by: no new request is routed to it, the ones in flight finish
        (waited for up to ``drain_timeout``), and it stays attached, held and under no pod name, until
        a join routes to it again. Unlike a leave nothing is detached: a replica process registers
        once, so one that left can never serve again, and one that is held is one join away."""
        drain_timeout = max(0.0, min(float(drain_timeout), MAX_DRAIN_SECONDS))

        async def op() -> dict[str, Any]:
            key = self._remote(stage_id, replica_id, pod, ip, "stand by")
            state = self.state
            async with state.locks.setdefault(key, asyncio.Lock()):  # a leave of the same replica waits
                departed = state.departed.get(key)
                if departed is not None:
                    code = contract.E_REPLICA_LEFT if departed == contract.LEFT else \
                        contract.E_REPLICA_DETACHED
                    raise MembershipError(409, code, f"replica {key[1]} is {departed}: it cannot stand by (a "
                                          "replica process registers once); start a new pod", stage=stage_id,
                                          replicaId=key[1])
                record = await self._hold_locked(key, drain_timeout)
                return {**self._header(), **record}

        return await self.run(op, timeout=drain_timeout + 30.0)

    async def _hold_locked(self, key: Key, drain_timeout: float) -> dict[str, Any]:
        stage_id, replica_id = key
        state = self.state
        pool = self._pool(stage_id)
        client = pool.clients[replica_id] if 0 <= replica_id < len(pool.clients) else None
        if client is None:
            raise MembershipError(409, contract.E_REPLICA_NOT_ATTACHED,
                                  f"replica {replica_id} is not attached: nothing to hold",
                                  stage=stage_id, replicaId=replica_id)
        started = time.monotonic()
        held = held_of(pool)
        if replica_id not in held or state.pods.get(key) is not None:
            # The same exclusion as a drain's, from the next pick on; the pod name goes, so a later
            # join (under any pod name) routes to it again.
            held.add(replica_id)
            state.pods.pop(key, None)
            state.bump()
            logger.info("stage %d replica %d held: standing by (drain %.1fs)", stage_id, replica_id,
                        drain_timeout)
        # Its requests in flight finish where they are (nothing is detached); waiting says when they did.
        in_flight = await _in_flight_after(pool, replica_id, client, started + drain_timeout)
        if in_flight == 0 and metric_series.enabled():
            # A standby has no series, as a replica never joined has none (a join makes them again).
            metric_series.remove_replica_series(self.orch, stage_id, replica_id)
        return {
            "stage": stage_id, "replicaId": replica_id, "pod": None, "state": contract.ATTACHED, "held": True,
            "host": getattr(self.master._stage_routes.get(key), "replica_host", None),
            "drained": in_flight == 0, "timedOut": in_flight > 0, "detached": False,
            "inFlightAtHold": in_flight, "waitedSeconds": round(time.monotonic() - started, 3),
            "metricsRegistered": metric_series.series_registered(self.orch, *key),
        }

    async def _leave_locked(self, key: Key, drain_timeout: float) -> dict[str, Any]:
        stage_id, replica_id = key
        state = self.state
        pool = self._pool(stage_id)
        client = pool.clients[replica_id] if 0 <= replica_id < len(pool.clients) else None
        started = time.monotonic()
        record: dict[str, Any] = {
            "stage": stage_id, "replicaId": replica_id, "pod": state.pods.get(key), "state": contract.LEFT,
            "host": getattr(self.master._stage_routes.get(key), "replica_host", None),
        }
        if client is None:
            # Never attached, or the head already dropped it (DOWN / heartbeat timeout): nothing
            # is routed to it and nothing is in flight there.
            if metric_series.enabled():
                metric_series.remove_replica_series(self.orch, stage_id, replica_id)
            return {
                **record,
                "drained": True,
                "timedOut": False,
                "detached": False,
                "inFlightAtDetach": 0,
                "waitedSeconds": 0.0,
                "metricsRegistered": metric_series.series_registered(self.orch, *key),
            }

        addr = client_addr(client)
        draining = draining_of(pool)
        draining.add(replica_id)  # 1. no new requests
        state.bump()
        logger.info("stage %d replica %d draining (timeout %.1fs)", stage_id, replica_id, drain_timeout)
        deadline = started + drain_timeout
        in_flight: int | None = None
        cleanup_error: str | None = None
        try:
            # 2. wait for the requests already routed there (bounded by the drain timeout)
            in_flight = await _in_flight_after(pool, replica_id, client, deadline)
            # 3. detach through the upstream path: affinity invalidated, client removed and shut
            #    down, requests still bound there failed with "stage replica disappeared", and
            #    the replica-removed callback (metric series removal) called.
            await self.orch._membership.handle_unregister(stage_id, addr)
        except BaseException as exc:
            if pool.clients[replica_id] is client:
                # Not detached: restore routing, so nothing is left half-applied. The exception
                # goes to the head's log only (a 500 answer reveals no exception text).
                draining.discard(replica_id)
                state.bump()
                if isinstance(exc, Exception):
                    logger.exception(
                        "stage %d replica %d: detach failed; routing restored", stage_id, replica_id
                    )
                    raise MembershipError(
                        500, "DetachFailed",
                        f"detaching replica {replica_id} failed; routing restored (see the head's log)",
                        replicaId=replica_id,
                    ) from exc
                raise
            if not isinstance(exc, Exception):
                raise
            # Detached, but failing the requests still bound there raised: report that it did.
            logger.exception("stage %d replica %d detached; its request cleanup failed", stage_id, replica_id)
            cleanup_error = str(exc) or type(exc).__name__
        finally:
            draining.discard(replica_id)
        in_flight = in_flight or 0
        if metric_series.enabled():
            metric_series.remove_replica_series(self.orch, stage_id, replica_id)  # idempotent
        waited = round(time.monotonic() - started, 3)
        logger.info("stage %d replica %d left (in flight at detach: %d, waited %.2fs)", stage_id, replica_id,
                    in_flight, waited)
        out = {**record, "drained": in_flight == 0, "timedOut": in_flight > 0, "detached": True,
               "inFlightAtDetach": in_flight, "waitedSeconds": waited,
               "metricsRegistered": metric_series.series_registered(self.orch, *key)}
        if cleanup_error is not None:
            out["cleanupError"] = cleanup_error
        return out
