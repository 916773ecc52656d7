"""Cache mode `replica-aware`: omit a tensor only for the replica that is known to hold it.

processor-only (defect 1's fix) sends every tensor to every replica, because vllm-omni renders a
request before it chooses a replica. This mode keeps that frontend (the processed items stay in
`MultiModalProcessorOnlyCache`, so the renderer always hands over full items) and takes the omit
decision later, per replica, at the last point before the request is encoded for the wire:

* **where**: `StageEngineCoreClientBase.add_request_async`, the head-side client of one replica.
  Every stage-0 submission reaches it after `StagePool.submit_initial`/`submit_update` picked the
  replica (`pick` / `select_replica_id`) and before vLLM's `AsyncMPClient._send_input` msgpack-encodes
  the request, so the replica is known and nothing is on the wire yet;
* **the mirror**: each client (one replica *registration*: a replica that leaves and comes back,
  even on the same IP, is a new client object) gets a `ReceiverMirror`: vLLM's own receiver
  algorithm (`BaseMultiModalReceiverCache.get_and_update_features`: touch every key of the
  request, then look up / insert in order), over vLLM's own LRU (`MultiModalCache.get_lru_cache`)
  with the same capacity (the stage-0 `mm_processor_cache_gb`) and the same item sizes
  (`MultiModalProcessorCacheItemMetadata`, what vLLM's one-engine sender cache stores). It holds
  keys and sizes, never tensors. An item the mirror holds goes without its tensor; the others go in
  full and enter the mirror, exactly as they enter the replica's `MultiModalReceiverCache`;
* **the request the orchestrator keeps is never touched**: the client encodes a copy with the
  omitted items' `data=None`, so a retry or re-dispatch to another replica starts from the
  frontend's full items and is stripped for *that* replica's mirror;
* **drops**: a replica that joins starts with an empty mirror (new client); `shutdown()` of the
  client (detach on leave/DOWN/heartbeat timeout, `evict_replica` on a dead engine) drops it; a
  cache miss the replica reports (`EngineCoreOutput.mm_cache_miss_hashes`, which vllm-omni 0.30.0
  ignores) drops it and the request is **re-sent in full** to the same replica, and the miss is
  removed from the outputs, so the orchestrator never sees it (`get_output_async` is the one
  place both the legacy poll loop and the event-driven dispatcher read outputs from). A second
  miss for the same request (impossible unless the replica's cache is smaller than the head's
  `mm_processor_cache_gb`) is passed through: the request fails as it would today, the mirror is
  empty, and the next request is sent in full;
* **order**: the mirror is updated and the copy encoded in one synchronous step: between the
  strip and `send_multipart` there is no `await` (checked at install: `_send_input` is a plain
  function that encodes and sends), so on the orchestrator's one event loop the mirror sees the
  requests in the order they enter the replica's socket; ZMQ keeps that order, and the replica's
  input thread runs `preprocess_add_request` (its receiver) in that order. After a drop the mirror
  is empty, which is always safe: an empty mirror is a suffix of the receiver's LRU order, and the
  two keep the suffix property from then on (every key of a request ends at the MRU end of both,
  and the receiver evicts what the mirror would evict, or earlier entries the mirror never had).

Which replica a request goes to is not decided here: vllm-omni's balancer picks it, or, with the
patch `replica_affinity` (replica_affinity.py), the replica whose mirror holds most of the
request's media (`ReplicaAwareDispatch.held_bytes`), within a load bound.

Only stage-0 clients of a head whose frontend was built for `replica-aware` (`activate`, called by
`frontend_cache` when it builds that frontend) are affected; every other client, and every head in
another mode, keeps upstream behaviour. If vLLM's client changed shape the patch records itself
`skipped` with the reason, the frontend stays processor-only (every tensor sent: safe), and the
engine report says `processor-only`, so the operator holds CacheConsistent False for a
`replica-aware` OmniStage.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import weakref
from collections import Counter, OrderedDict
from typing import Any

from .. import contract
from .._patching import Target, applied, mark, ours, shape_problem, wrap

NAME = contract.REPLICA_AWARE_CACHE
logger = logging.getLogger("omnistage_engine_patches.replica_aware_cache")

#: Full requests kept per replica for a re-send after a miss (dropped when the request finishes or is
#: aborted). They share the frontend's tensors (no copy), but hold them past the frontend cache's
#: eviction; the bound caps that. A request pushed out before its miss arrives fails as upstream does.
MAX_KEPT_REQUESTS = 1024


@functools.cache
def mirror_class() -> type:
    """`ReceiverMirror`, built on first use (vLLM is imported only where a frontend is built)."""
    from vllm.multimodal.cache import (
        BaseMultiModalReceiverCache,
        MultiModalCache,
        MultiModalProcessorCacheItemMetadata,
    )

    class ReceiverMirror(BaseMultiModalReceiverCache):
        """One replica's `MultiModalReceiverCache` as the frontend can know it: keys and sizes.

        `get_and_update_features` is the receiver's own (inherited); only the item step differs:
        where the receiver returns its cached tensor, the mirror returns None (omit it)."""

        def __init__(self, capacity_gb: float) -> None:
            super().__init__()
            self._cache = MultiModalCache.get_lru_cache(capacity_gb, MultiModalProcessorCacheItemMetadata)

        def get_and_update_item(self, mm_item: Any, mm_hash: str) -> Any:
            if self._cache.get(mm_hash) is not None:
                return None  # the replica holds it: omit the tensor
            if mm_item is None:
                return None  # already omitted upstream: nothing to learn, pass it on as it is
            self.cache_if_fits(self._cache, mm_hash, MultiModalProcessorCacheItemMetadata(mm_item, []))
            return mm_item

        def touch_receiver_cache_item(self, mm_hash: str, mm_item: Any = None) -> None:
            self._cache.touch(mm_hash)

        def clear_cache(self) -> None:
            self._cache.clear()

        def keys(self) -> list[str]:
            """LRU order, least recent first (what tests compare with the receiver's)."""
            return list(self._cache.keys())

        def held_bytes(self, keys: set[str]) -> int:
            """Bytes of `keys` the replica holds, read without touching the LRU order (`cache` is
            vLLM's read-only view): asking must not change what the replica is predicted to evict."""
            view = self._cache.cache
            return sum(view[k].item_size for k in keys if k in view)

    return ReceiverMirror


class ReplicaAwareDispatch:
    """The per-replica state of one stage-0 frontend: mirrors and the full requests a miss may
    need again. Keyed by the head-side client object (one registration of one replica)."""

    def __init__(self, capacity_gb: float) -> None:
        self.capacity_gb = capacity_gb
        self._mirrors: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._kept: weakref.WeakKeyDictionary[Any, OrderedDict[str, Any]] = weakref.WeakKeyDictionary()
        self._resent: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        self.stats: Counter[str] = Counter()
        # The orchestrator's loop is the only writer; the lock keeps a report or test reading
        # from another thread from seeing a half-updated mirror.
        self._lock = threading.Lock()

    def mirror(self, client: Any) -> Any:
        with self._lock:
            return self._mirror_of(client)

    def _mirror_of(self, client: Any) -> Any:  # with self._lock held
        mirror = self._mirrors.get(client)
        if mirror is None:  # a new registration: an empty mirror, as its receiver is empty
            mirror = self._mirrors[client] = mirror_class()(self.capacity_gb)
        return mirror

    def held_bytes(self, client: Any, features: Any) -> int:
        """Bytes of these features' items `client`'s replica is known to hold (0 without a mirror:
        a new, dropped or unknown registration holds nothing as far as the head knows)."""
        keys = {f.mm_hash or f.identifier for f in features or ()}  # the receiver's key
        with self._lock:
            mirror = self._mirrors.get(client)
            return mirror.held_bytes(keys) if mirror is not None else 0

    def outgoing(self, client: Any, request: Any) -> Any:
        """The request to encode for `client`: a copy without the tensors its mirror holds (the
        mirror is updated as the replica's receiver will be), or `request` itself when nothing
        is omitted."""
        features = getattr(request, "mm_features", None)
        if not features:
            return request
        import msgspec

        copies = [dataclasses.replace(f) for f in features]
        with self._lock:
            self._mirror_of(client).get_and_update_features(copies)  # the receiver's algorithm, on copies
        omitted = sum(1 for f, c in zip(features, copies) if f.data is not None and c.data is None)
        self.stats["items_sent"] += len(copies) - omitted
        self.stats["items_omitted"] += omitted
        if not omitted:
            return request
        self._keep(client, request)
        return msgspec.structs.replace(request, mm_features=copies)

    def _keep(self, client: Any, request: Any) -> None:
        with self._lock:
            kept = self._kept.setdefault(client, OrderedDict())
            kept[request.request_id] = request
            kept.move_to_end(request.request_id)
            while len(kept) > MAX_KEPT_REQUESTS:
                kept.popitem(last=False)

    def drop(self, client: Any, why: str) -> None:
        with self._lock:
            had = self._mirrors.pop(client, None)
        if had is not None:
            self.stats["mirrors_dropped"] += 1
            logger.info("replica-aware cache: mirror of stage-0 replica %s dropped (%s)",
                        getattr(client, "replica_id", "?"), why)

    def forget(self, client: Any, why: str) -> None:
        """The client is gone (shut down): drop its mirror and the requests kept for it."""
        self.drop(client, why)
        with self._lock:
            self._kept.pop(client, None)
            self._resent.pop(client, None)

    def finished(self, client: Any, request_ids: Any) -> None:
        with self._lock:
            kept, resent = self._kept.get(client), self._resent.get(client)
            for request_id in request_ids:
                if kept is not None:
                    kept.pop(request_id, None)
                if resent is not None:
                    resent.discard(request_id)

    def take_for_resend(self, client: Any, request_id: str) -> Any | None:
        """The full request to send again after a miss, once per request; None: let it fail."""
        with self._lock:
            resent = self._resent.setdefault(client, set())
            if request_id in resent:
                return None
            kept = self._kept.get(client)
            full = kept.pop(request_id, None) if kept is not None else None
            if full is not None:
                resent.add(request_id)
            return full


_DISPATCH: ReplicaAwareDispatch | None = None


def activate(capacity_gb: float | None) -> None:
    """Called when the stage-0 frontend is built: the stage-0 `mm_processor_cache_gb` (what every
    replica's receiver cache is built with) for a replica-aware frontend, None for any other (one
    head process builds one stage-0 frontend)."""
    global _DISPATCH
    if capacity_gb is None:
        _DISPATCH = None
        return
    _DISPATCH = ReplicaAwareDispatch(capacity_gb)
    logger.info("replica-aware stage-0 cache: per-replica mirrors of %.3g GiB receiver caches", capacity_gb)


def dispatch() -> ReplicaAwareDispatch | None:
    """The live dispatch, when this process's stage-0 frontend is replica-aware and the patch is in."""
    return _DISPATCH if applied(NAME) else None


def _stage0(dispatch_: ReplicaAwareDispatch | None, client: Any) -> bool:
    return dispatch_ is not None and getattr(client, "stage_id", None) == 0


async def _after_outputs(d: ReplicaAwareDispatch, client: Any, outputs: Any) -> Any:
    """Drop the mirror on a reported miss and re-send the request in full; forget finished ones."""
    items = getattr(outputs, "outputs", None) or []
    resend: list[Any] = []
    kept_outputs = []
    for eco in items:
        missed = getattr(eco, "mm_cache_miss_hashes", None)
        if not missed:
            kept_outputs.append(eco)
            continue
        d.stats["misses_reported"] += 1
        d.drop(client, f"it reported a cache miss for request {eco.request_id}: {list(missed)}")
        full = d.take_for_resend(client, eco.request_id)
        if full is None:
            d.stats["misses_passed_on"] += 1
            logger.warning("replica-aware cache: request %s missed again (or was never stripped here); "
                           "passing the error on", eco.request_id)
            kept_outputs.append(eco)
            continue
        resend.append(full)
    if resend:
        outputs.outputs = kept_outputs
        finished = getattr(outputs, "finished_requests", None)
        if finished:
            outputs.finished_requests = set(finished) - {r.request_id for r in resend}
        for full in resend:
            d.stats["misses_resent"] += 1
            await client.add_request_async(full)  # the mirror is empty: goes in full
    done = {eco.request_id for eco in kept_outputs if getattr(eco, "finish_reason", None) is not None}
    done |= set(getattr(outputs, "finished_requests", None) or ())
    if done:
        d.finished(client, done)
    return outputs


# Methods the client inherits from vLLM's AsyncMPClient that the patch defines on vllm-omni's base.
_WRAPPED_INHERITED = ("get_output_async", "abort_requests_async", "shutdown")


def install() -> str | None:
    try:
        from vllm.multimodal.cache import BaseMultiModalReceiverCache, MultiModalProcessorCacheItemMetadata
        from vllm.v1.engine import EngineCoreOutput
        from vllm.v1.engine.core_client import AsyncMPClient
        from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClientBase
    except ImportError as e:
        return f"target not importable ({e})"

    add_target = Target(StageEngineCoreClientBase, "add_request_async", ("self", "request"), coroutine=True)
    if ours(NAME, add_target):
        return None  # already in place (e.g. this module was reloaded)
    problem = shape_problem(add_target, *(Target(AsyncMPClient, attr) for attr in _WRAPPED_INHERITED))
    if problem:
        return problem
    add = add_target.get()
    for attr in _WRAPPED_INHERITED:
        if attr in StageEngineCoreClientBase.__dict__:
            return f"StageEngineCoreClientBase now defines {attr} itself: refusing to shadow it"
    if "mm_cache_miss_hashes" not in getattr(EngineCoreOutput, "__struct_fields__", ()):
        return "EngineCoreOutput has no mm_cache_miss_hashes field"
    if not callable(getattr(BaseMultiModalReceiverCache, "get_and_update_features", None)):
        return "BaseMultiModalReceiverCache.get_and_update_features is missing"
    if list(inspect.signature(MultiModalProcessorCacheItemMetadata.__init__).parameters) != [
        "self", "item", "prompt_updates"
    ]:
        return "MultiModalProcessorCacheItemMetadata changed shape"
    # The order guard: the strip and the encode must happen in one synchronous step (no await in
    # between), or the mirror could see requests in another order than the replica's socket.
    send = AsyncMPClient.__dict__.get("_send_input")
    upstream_add = AsyncMPClient.__dict__.get("add_request_async")
    try:
        send_src = inspect.getsource(send) if send is not None else ""
        upstream_src = inspect.getsource(upstream_add) if upstream_add is not None else ""
        add_src = inspect.getsource(add)
    except (OSError, TypeError) as e:
        return f"cannot read the target source to check its shape ({e})"
    if send is None or inspect.iscoroutinefunction(send) or "encoder.encode(request)" not in send_src \
            or "_send_input_message" not in send_src:
        return "AsyncMPClient._send_input no longer encodes and sends in one synchronous step"
    if "await self._send_input(" not in upstream_src:
        return "AsyncMPClient.add_request_async no longer goes straight to _send_input"
    if add_src.count("await") != 1 or "await super().add_request_async(request)" not in add_src:
        return "StageEngineCoreClientBase.add_request_async awaits something before it sends"

    @wrap(StageEngineCoreClientBase, "add_request_async", NAME)
    async def add_request_async(original_add: Any, self: Any, request: Any) -> None:
        d = dispatch()
        if _stage0(d, self):
            request = d.outgoing(self, request)
        await original_add(self, request)

    def get_output_async_of(cls_super: Any) -> Any:
        @functools.wraps(AsyncMPClient.get_output_async)
        async def get_output_async(self: Any) -> Any:
            outputs = await super(cls_super, self).get_output_async()
            d = dispatch()
            if _stage0(d, self) and outputs is not None:
                outputs = await _after_outputs(d, self, outputs)
            return outputs

        return get_output_async

    @functools.wraps(AsyncMPClient.abort_requests_async)
    async def abort_requests_async(self: Any, request_ids: list[str]) -> None:
        d = _DISPATCH
        if d is not None:
            d.finished(self, request_ids)  # an aborted request gets no final output to forget it by
        await super(StageEngineCoreClientBase, self).abort_requests_async(request_ids)

    @functools.wraps(AsyncMPClient.shutdown)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        d = _DISPATCH
        if d is not None:
            d.forget(self, "its client was shut down (replica detached, left or evicted)")
        return super(StageEngineCoreClientBase, self).shutdown(*args, **kwargs)

    StageEngineCoreClientBase.get_output_async = mark(get_output_async_of(StageEngineCoreClientBase), NAME)
    StageEngineCoreClientBase.abort_requests_async = mark(abort_requests_async, NAME)
    StageEngineCoreClientBase.shutdown = mark(shutdown, NAME)
    return None

