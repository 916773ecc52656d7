"""Cache mode `replica-aware`, patch `replica_affinity`: stage 0 prefers the replica that holds the media.

`replica_aware_cache` omits a tensor only for the replica whose mirror holds it, but vllm-omni's
stage-0 balancers (round robin, least-queue-length, random) know nothing of conversations, so each
conversation's media is sent once to every replica it visits. This patch steers the choice itself.

* **where**: `StagePool.submit_initial` (vllm_omni/engine/stage_pool.py:982), the one entry every
  fresh stage-0 request takes (orchestrator.py:2851 for a new request, 2940 for a CFG companion,
  duplex_orchestrator.py:402). Its `request` argument is already rendered: the orchestrator hands
  it the `OmniEngineCoreRequest` that `AsyncOmniEngine._build_add_request_message`
  (async_omni_engine.py:246) built with `input_processor.process_inputs` (:334), so `mm_features`
  (each item's `mm_hash`/`identifier`, the receiver's key) is known before the replica is chosen
  (orchestrator.py:2836 reads the same `prompt.mm_features`). The replica itself is chosen later,
  inside the original, by `_pick_or_select` (:1128) -> `pick` (:312, distributed) or
  `select_replica_id` (:568, legacy);
* **how**: the wrapper chooses a replica and *binds* the request to it the way upstream records
  its own choices (`bind`, :444, the distributed `_affinity`; `_request_bindings`, the legacy map
  `select_replica_id` writes at :601), then calls the original. Upstream's own sticky step then
  returns that replica (`pick`: :332-339 before any balancer; `select_replica_id`: :575-577), and
  everything after it (output processor, rollback and `release_binding` on a failed send, the
  replica-aware strip in the client) is upstream's and `replica_aware_cache`'s, unchanged;
* **which replica**: among the replicas upstream could pick right now (distributed:
  `_collect_serviceable_replicas`, :414, which `membership` filters for draining and held
  replicas; legacy: live and available), the one whose mirror holds the most bytes of the
  request's items (`ReplicaAwareDispatch.held_bytes`, read without touching the mirror's LRU
  order), **but only among those whose load is within the bound** below. Equal bytes: the less
  loaded one. When every replica holding something is over the bound, the least-loaded candidate
  takes the request (round robin, which ignores load, could hand it back to the busy holder). When
  no replica holds anything (a new conversation, every holder's mirror dropped) or the request has
  no multimodal items, nothing is bound and upstream's balancer picks as before, so new
  conversations keep spreading;
* **load**: the requests the head has bound to each replica and not yet released (legacy
  `_request_bindings` and distributed `_affinity`, what `replica_monitor_sample` counts at :490):
  the head's own count, updated on every pick and release. The heartbeat's `queue_length` that
  least-queue-length reads is up to 5 s old; affinity decisions come in bursts (every turn of
  every conversation), and a stale figure would let a burst pile onto one holder;
* **the bound**: `load <= least + max(2, ceil(25% of least))`, `least` the least-loaded
  candidate's load. The absolute 2 lets a conversation stay put at low load, where two more
  requests in a continuously batched engine cost little and a move costs every earlier item in
  full; the 25% caps the skew under sustained load (a holder carries at most about 1.25x the
  least-loaded replica's requests, plus 2). A replica over the bound gets no affinity traffic at
  all (only what upstream's balancer gives new conversations), so affinity can never pile
  everything on one replica;
* **left alone**: requests already bound to a serviceable replica (vllm-omni's preselection for
  raw prompts with `multi_modal_data`, async_omni_engine.py:193-244, whose keys are then scoped
  to that replica; a re-submission of a live request), CFG companions (`affinity_request_id`:
  they follow their parent upstream), stage >= 1 pools, requests without `mm_features`, and every
  head whose stage-0 frontend is not replica-aware (`replica_aware_cache.dispatch()` is None);
* **retries and drops**: a retry or re-dispatch after its replica went away goes through
  `submit_initial` again with the stale binding gone or unserviceable, and is steered among the
  replicas that are there; a replica that left, restarted or reported a miss has its mirror
  dropped (`replica_aware_cache`), so it holds 0 bytes and attracts nothing.

Never crashes vLLM: a steering error is logged and counted, and upstream's pick runs as if the
patch were absent. If vllm-omni's shape changed (signature, the sticky steps the binding relies
on, the binding maps), or `replica_aware_cache` was skipped (no mirrors to read), the patch records
itself `skipped` with the reason and routing is upstream's.
`OMNISTAGE_DISABLE_PATCHES=replica_affinity` switches it off alone; replica-aware stays correct.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections import Counter
from typing import Any

from .. import contract
from .._patching import Target, ours, outcomes, shape_problem, wrap
from . import replica_aware_cache

NAME = contract.REPLICA_AFFINITY
logger = logging.getLogger("omnistage_engine_patches.replica_affinity")

#: The load bound: a replica may take an affinity request while its load is at most the least
#: loaded candidate's plus max(ABSOLUTE_SLACK, ceil(RELATIVE_SLACK x that load)).
ABSOLUTE_SLACK = 2
RELATIVE_SLACK = 0.25

#: What the wrapper decided, for tests and the benchmark: `steered` (bound to a holder within the
#: bound), `over_bound` (every holder beyond the bound: bound to the least-loaded replica),
#: `no_holder` (nobody holds anything: upstream picks), `left_alone` (bound already, or one
#: candidate: upstream picks), `error` (upstream picks).
STATS: Counter[str] = Counter()


def load_bound(least: int) -> int:
    return least + max(ABSOLUTE_SLACK, math.ceil(RELATIVE_SLACK * least))


def _distributed(pool: Any) -> bool:
    # The condition `pick` itself uses to choose between its hub path and `select_replica_id`.
    return pool._hub is not None and pool._lb is not None


def candidates(pool: Any) -> list[int]:
    """The replicas upstream could pick for a fresh request right now."""
    if _distributed(pool):
        return [rid for _info, rid in pool._collect_serviceable_replicas()]
    return [rid for rid in pool.live_replica_ids() if pool.is_replica_available(rid)]


def in_flight(pool: Any) -> Counter[int]:
    """Requests bound to each replica and not released yet (the head's own load figure)."""
    request_ids = {*pool._request_bindings, *pool._affinity}
    return Counter(pool.get_bound_replica_id(r) for r in request_ids)


def choose(pool: Any, dispatch: Any, features: Any) -> int | None:
    """The replica holding most of these items among those within the load bound; the least
    loaded one when every holder is beyond it; None when nobody holds any (upstream's balancer
    decides). Records which in STATS."""
    cands = candidates(pool)
    if len(cands) < 2:
        STATS["left_alone"] += 1
        return None
    load = in_flight(pool)
    bound = load_bound(min(load[r] for r in cands))
    held = {r: dispatch.held_bytes(pool.clients[r], features) for r in cands}
    if not any(held.values()):
        STATS["no_holder"] += 1
        return None
    within = [r for r in cands if load[r] <= bound and held[r] > 0]
    if not within:  # every holder is over the bound: not upstream's pick, which may be a holder
        STATS["over_bound"] += 1
        return min(cands, key=lambda r: (load[r], -held[r]))
    STATS["steered"] += 1
    return max(within, key=lambda r: (held[r], -load[r]))


def _bind(pool: Any, request_id: str, replica_id: int) -> None:
    """Record the choice where upstream's own sticky step will find it."""
    if _distributed(pool):
        pool.bind(request_id, pool._client_input_addr(pool.clients[replica_id]))
    else:
        pool._request_bindings[request_id] = replica_id


def steer(pool: Any, request_id: str, request: Any) -> int | None:
    """Bind a fresh stage-0 multimodal request of a replica-aware head to the replica holding its
    media; return that replica, or None when upstream's pick decides."""
    d = replica_aware_cache.dispatch()
    features = getattr(request, "mm_features", None)
    if d is None or pool.stage_id != 0 or not features:
        return None
    bound = pool.get_bound_replica_id(request_id)
    if bound is not None and bound in candidates(pool):
        STATS["left_alone"] += 1  # preselected (scoped keys) or re-submitted while its replica lives
        return None
    choice = choose(pool, d, features)
    if choice is not None:
        _bind(pool, request_id, choice)
    return choice


def _steer_safely(pool: Any, request_id: str, request: Any) -> None:
    try:
        steer(pool, request_id, request)
    except Exception:  # a routing preference must never fail a request
        STATS["error"] += 1
        logger.warning("replica affinity: steering request %s failed; upstream's pick decides", request_id,
                       exc_info=True)


# Upstream source the binding relies on: (method, substrings that must be in it, in this order).
_SHAPE = (
    ("submit_initial", ("self._pick_or_select(", "add_request_async(")),
    ("_pick_or_select", ("self.pick(", "self.select_replica_id(")),
    ("pick", ("self._hub is None or self._lb is None", "self._affinity.get(request_id)", "self._lb.select(")),
    (
        "select_replica_id",
        ("self.get_bound_replica_id(request_id)", "self._request_bindings[request_id] = chosen"),
    ),
    ("get_bound_replica_id", ("self._request_bindings.get(request_id)", "self._affinity.get(request_id)")),
    ("bind", ("self._affinity[request_id] = input_addr",)),
)
_USED = ("live_replica_ids", "is_replica_available", "_collect_serviceable_replicas", "_client_input_addr")


def _shape_problem(stage_pool: type) -> str | None:
    """Why the binding would not be honoured by this StagePool, or None."""
    submit = Target(stage_pool, "submit_initial", ("self", "request_id", "req_state", "request"), more=True,
                    coroutine=True)
    problem = shape_problem(submit)
    if problem:
        return problem
    if "affinity_request_id" not in inspect.signature(submit.get()).parameters:
        return f"target changed shape: {submit.label} takes no affinity_request_id"
    for method, needles in _SHAPE:
        fn = getattr(stage_pool, method, None)
        if not callable(fn):
            return f"StagePool.{method} is missing"
        try:
            src = inspect.getsource(fn)
        except (OSError, TypeError) as e:
            return f"cannot read StagePool.{method} to check its shape ({e})"
        at = [src.find(n) for n in needles]
        if -1 in at or at != sorted(at):
            return f"StagePool.{method} changed shape (expected, in order: {', '.join(needles)})"
    for method in _USED:
        if not callable(getattr(stage_pool, method, None)):
            return f"StagePool.{method} is missing"
    return None


def install() -> str | None:
    # It steers by replica_aware_cache's mirrors (applied first): without them it would be in place and
    # never act (vLLM 0.32, where that patch is skipped). Disabled (its negative control) stays as it was.
    mirrors = outcomes().get(contract.REPLICA_AWARE_CACHE)
    if mirrors is not None and mirrors.outcome == contract.SKIPPED:
        return f"{contract.REPLICA_AWARE_CACHE} is skipped (its reason is its own): no mirrors to steer by"
    try:
        from vllm_omni.engine.stage_pool import StagePool
    except ImportError as e:
        return f"target not importable ({e})"

    problem = _shape_problem(StagePool)
    if problem:
        return problem
    if ours(NAME, Target(StagePool, "submit_initial")):
        return None  # already in place (e.g. this module was reloaded)

    @wrap(StagePool, "submit_initial", NAME)
    async def submit_initial(original: Any, self: Any, request_id: str, req_state: Any, request: Any,
                             *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("affinity_request_id") is None:  # a CFG companion follows its parent (upstream)
            _steer_safely(self, request_id, request)
        return await original(self, request_id, req_state, request, *args, **kwargs)

    return None
