"""What a live head's membership listing reads (GET contract.MEMBERSHIP_PATH, :mod:`.membership_routes`):
the head's live objects (``HeadReads``: the master's routes and registrations, the stage pools,
the coordinator's UP replicas) and the read model built from them (``snapshot``). The commands
(join, leave) and the bridge onto the orchestrator's loop are :mod:`.membership_ops`'.

Everything here runs on the orchestrator's event loop and stalls serving while it runs, so none of
it walks the route table in Python: the default listing reads only the candidates it can list
(head-local, attached, and registered-but-not-departed keys), requests in flight are counted once
per pool, and ``?all=true`` is paged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import operator
import time
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from itertools import compress, islice, repeat
from typing import Any

from . import contract, metric_series, report
from .patches import engine_liveness, membership, registration_report
from .patches.membership import Key, draining_of, held_of, state_of

DEFAULT_PAGE = 500  # ?all=true page size
MAX_PAGE = 1000


class MembershipError(Exception):
    """An answer for the caller: HTTP status, a stable error code, a message, details."""

    def __init__(self, status: int, code: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.details = status, code, message, details

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, **self.details}


def client_addr(client: Any) -> str | None:
    from vllm_omni.engine.stage_pool import StagePool

    return StagePool._client_input_addr(client) if client is not None else None


def live_replica_ids(pool: Any) -> list[int]:
    """Ids of attached clients. ``pool.clients`` has a slot per replica id ever attached (never
    shrinks), so this runs at C speed instead of a Python loop over every slot."""
    clients = pool.clients
    return list(compress(range(len(clients)), map(operator.is_not, clients, repeat(None))))


class InFlight:
    """Requests in flight per replica of one pool, counted once (C-speed ``Counter``) instead of
    walking every affinity row per replica. Head-side routing state: a request's affinity row
    lives from ``pick()`` until the orchestrator releases its bindings (finished, aborted or
    failed); the legacy ``_request_bindings`` map is counted too."""

    def __init__(self, pool: Any) -> None:
        self.by_addr = Counter((getattr(pool, "_affinity", None) or {}).values())
        self.by_replica = Counter((getattr(pool, "_request_bindings", None) or {}).values())

    def of(self, replica_id: int, addr: str | None) -> int:
        return (self.by_addr[addr] if addr is not None else 0) + self.by_replica[replica_id]


def _parse_cursor(text: str) -> Key:
    """``"<stage>:<replicaId>"``, the ``next`` of a previous ``?all=true`` page."""
    stage, sep, replica = text.partition(":")
    if not sep or not stage.isdigit() or not replica.isdigit():
        message = "after must be '<stage>:<replicaId>' (the 'next' of the previous page)"
        raise MembershipError(422, "InvalidQuery", message, fields=[{"field": "after", "message": message}])
    return int(stage), int(replica)


def _cursor(key: Key) -> str:
    return f"{key[0]}:{key[1]}"


@dataclass
class HeadReads:
    """The live objects of one distributed head (membership_ops.LiveHead.locate finds them) and the
    listing read from them."""

    orch: Any
    loop: asyncio.AbstractEventLoop
    master: Any
    engine: Any = None
    client: Any = None  # what locate() was given (app.state.engine_client), for the engine report

    # ---- reads (orchestrator loop) ----

    @property
    def state(self) -> membership.MembershipState:
        return state_of(self.orch)

    def _pool(self, stage_id: int) -> Any | None:
        pools = self.orch.stage_pools
        return pools[stage_id] if 0 <= stage_id < len(pools) else None

    def _locked(self) -> Any:
        """The master's ``_alloc_lock``: its registration thread adds routes and registrations
        and fills ``replica_host`` under it. Single-key reads need no lock (nothing is removed)."""
        lock = getattr(self.master, "_alloc_lock", None)
        return lock if lock is not None else contextlib.nullcontext()

    def _routes(self) -> dict[Key, Any]:
        """One consistent copy of the master's routes, for the operations that walk them (a
        C-level copy: the lock is held well under a millisecond at tens of thousands)."""
        with self._locked():
            return dict(self.master._stage_routes)

    def _stage_ids(self) -> list[int]:
        return list(range(len(self.orch.stage_pools)))

    def _open_registrations(self) -> set[Key]:
        """``state.registered_open`` brought up to date with the master's registrations.

        The master's ``_stage_configs`` only grows (upstream never removes a registration, and
        dicts keep insertion order), so only the entries added since the last call are read: the
        common case, nothing new, costs a length and a last-key check. Should the table ever
        shrink or change otherwise, it is read whole once."""
        state = self.state
        configs = self.master._stage_configs
        with self._locked():
            seen, seen_last = state.registrations_seen
            n = len(configs)
            last = next(reversed(configs)) if n else None
            if n == seen and last == seen_last:
                new: list[Key] = []
            elif n > seen:
                new = list(islice(configs, seen, None))  # the skipped prefix is walked in C
            else:
                new = list(configs)
                state.registered_open.clear()
        state.registrations_seen = (n, last)
        departed = state.departed
        state.registered_open.update(key for key in new if key not in departed)
        return state.registered_open

    def _hub_up(self) -> dict[str, Any]:
        """Input address -> the coordinator's entry: UP ones, and ERROR ones (engine_liveness
        publishes those, as silent)."""
        hub = getattr(self.orch._membership, "_hub", None)
        if hub is None:
            return {}
        return {rep.input_addr: rep for rep in hub.get_replica_list().replicas}

    def liveness_digest(self) -> str:
        """What the coordinator last published of each engine (address and status, not its queue
        length), as a short digest for the listing's ETag. A plain read of the hub's cached list,
        safe from any thread."""
        states = sorted((addr, str(getattr(rep, "status", "up"))) for addr, rep in self._hub_up().items())
        return hashlib.sha256(repr(states).encode()).hexdigest()[:12]

    def _entry(self, key: Key, up: dict[str, Any], in_flight: dict[int, InFlight]) -> contract.Member:
        stage_id, replica_id = key
        state = self.state
        alloc = self.master._stage_routes.get(key)
        pool = self._pool(stage_id)
        client = None
        if pool is not None and 0 <= replica_id < len(pool.clients):
            client = pool.clients[replica_id]
        addr = client_addr(client) or getattr(alloc, "input_bind_address", None)
        draining = pool is not None and replica_id in draining_of(pool)
        registered = key in self.master._stage_configs
        departed = state.departed.get(key)
        if departed == contract.LEFT:
            status = contract.LEFT
        elif client is not None:
            status = contract.DRAINING if draining else contract.ATTACHED
        elif departed == contract.DETACHED:
            status = contract.DETACHED
        else:
            status = contract.REGISTERED if registered else contract.PENDING
        rep = up.get(addr) if addr else None
        coord = contract.COORD_ABSENT if rep is None else (
            contract.COORD_UP if getattr(rep, "status", "up") == "up" else contract.COORD_SILENT)
        silent_at = engine_liveness.silent_since(self.orch._membership).get((stage_id, addr)) \
            if coord == contract.COORD_SILENT else None
        if pool is not None and stage_id not in in_flight:
            in_flight[stage_id] = InFlight(pool)
        entry: contract.Member = {
            "stage": stage_id,
            "replicaId": replica_id,
            "host": getattr(alloc, "replica_host", None),
            "pod": state.pods.get(key),
            "local": key in self.master._head_local_slots,
            "state": status,
            "registered": registered,
            "attached": client is not None,
            "held": client is not None and replica_id in held_of(pool),
            "coordinatorStatus": coord,
            "queueLength": int(rep.queue_length) if rep is not None else None,
            "inFlight": in_flight[stage_id].of(replica_id, addr) if pool is not None else 0,
            "draining": draining,
            "metricsRegistered": metric_series.series_registered(self.orch, stage_id, replica_id),
        }
        # What the replica's own process reported at registration (registration_report). It is
        # there from the member's first listing on and never changes (auto-assign never hands a
        # registered key out again; the head's own explicit-id registrations carry no report), so
        # it needs no epoch bump and the listing's ETag stays right.
        if silent_at is not None:
            entry["silentSeconds"] = round(time.monotonic() - silent_at, 1)
        patches = registration_report.reported(self.master._stage_configs.get(key)) if registered else None
        if patches is not None:
            entry["patches"] = patches
        return entry

    def _header(self) -> dict[str, Any]:
        return {
            "bootId": report.BOOT_ID,
            "epoch": self.state.epoch,
            "distributed": True,
            "metricsEnabled": getattr(self.orch, "_stat_logger", None) is not None
            and metric_series.enabled(),
        }

    def _listed_candidates(self) -> set[Key]:
        """Keys that can be in the default listing: head-local, attached, registered but not
        departed, and detached by the head on its own (until a leave). Built from sets that hold only
        those, so the work does not grow with the
        departed replicas' routes (only ``live_replica_ids`` walks the pool's slots, in C)."""
        with self._locked():
            local = set(self.master._head_local_slots)
        attached: set[Key] = set()
        for stage_id, pool in enumerate(self.orch.stage_pools):
            attached.update(zip(repeat(stage_id), live_replica_ids(pool)))
        routes = self.master._stage_routes
        detached = set(self.state.detached_open)
        return {key for key in local | attached | self._open_registrations() | detached if key in routes}

    # ---- operations ----

    async def snapshot(self, include_all: bool = False, *, limit: int = DEFAULT_PAGE,
                       after: str | None = None) -> dict[str, Any]:
        """The listing. Default: head-local replicas and those registered, attached or draining.
        ``include_all``: every route in (stage, replica id) order, one page of at most ``limit``
        entries after the cursor ``after`` (the ``next`` of the previous page, ``"S:R"``)."""
        limit = max(1, min(int(limit), MAX_PAGE))
        after_key = _parse_cursor(after) if after else None

        async def op() -> dict[str, Any]:
            up = self._hub_up()
            in_flight: dict[int, InFlight] = {}
            stages: dict[str, list[dict[str, Any]]] = {str(sid): [] for sid in self._stage_ids()}
            next_cursor = None
            if include_all:
                keys = sorted(self._routes())  # insertion order is almost sorted: timsort is ~linear
                start = bisect_right(keys, after_key) if after_key is not None else 0
                page = keys[start:start + limit]
                if start + limit < len(keys):
                    next_cursor = _cursor(page[-1])
                for key in page:  # a route of a stage without a pool still gets listed
                    stages.setdefault(str(key[0]), []).append(self._entry(key, up, in_flight))
            else:
                for key in sorted(self._listed_candidates()):
                    entry = self._entry(key, up, in_flight)
                    if entry["local"] or entry["state"] in contract.LISTED_STATES:
                        stages.setdefault(str(key[0]), []).append(entry)
            return {**self._header(), "stages": stages, "next": next_cursor}

        return await self.run(op)
