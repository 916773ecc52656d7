"""Cache mode `replica-aware`: tensors omitted per replica, after the replica is chosen.

Real (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU): the stage-0 frontend built by vllm-omni's
`_initialize_stages` with `OMNISTAGE_FRONTEND_CACHE=replica-aware` (the operator's env), the chat
path (`render_chat_async`, the processor-only frontend cache, `_build_add_request_message`), the
stage-0 `StagePool` (round robin, `add_client` / `remove_client` as the membership controller
calls them), the head-side client class `StageEngineCoreClient` with its real `add_request_async`
(and the plugin's wrappers), vLLM's `MsgpackEncoder` / `MsgpackDecoder(OmniEngineCoreRequest)`,
each replica's real `MultiModalReceiverCache` and vLLM's own miss answer
(`EngineCoreProc._handle_mm_cache_miss`). Stood in: the EngineCore process, the client's ZMQ
sockets and its constructor (tests/support/engine_stack.py's `WireReplica`).

Every scenario checks two figures: requests that failed (a cache-miss error reached the
orchestrator) and stale requests (a feature the replica fed its encoder differs from the tensor
the frontend processed for that request). Both must be 0, and the mode must really omit tensors
(otherwise it is processor-only with extra steps).

Negative controls: with `OMNISTAGE_DISABLE_PATCHES=replica_aware_cache` the tests marked
"regression" fail (nothing is omitted, the report says processor-only); in-file controls switch
off one part of the patch (the drop on restart, the re-send on a miss) and show misses or errors.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

from omnistage_engine_patches import _patching, contract, report
from omnistage_engine_patches.patches import replica_aware_cache
from vllm import SamplingParams
from vllm.multimodal.cache import MultiModalCache, MultiModalProcessorOnlyCache
from vllm.renderers.params import ChatParams
from vllm.v1.engine import FinishReason

from tests.support.engine_stack import WireReplica, pixel_digest, stage0_engine_builder

from .test_frontend_cache import chat_messages

PATCH = replica_aware_cache.NAME

# The GPU reproduction's shape (seed 000): 28 chat requests over two replicas, round robin, fresh
# media and repeats of them (there: 10 of 28 failed with vLLM's sender cache on the frontend).
SEQUENCE_28 = [0, 1, 2, 2, 2, 3, 3, 0, 1, 0, 0, 1, 1, 4, 4, 4, 4, 2, 3, 5, 5, 0, 5, 1, 4, 2, 3, 3]


# test_forced_receiver_eviction's plan, worked out by hand for caches of 2.5 images: replica 0 holds
# [3,4] -> [4,5] -> [5,3] -> [3,4] -> hit; replica 1 [3] -> [3,4] -> [4,5] -> [5,3]: one omission.
OMITTED_WITH_EVICTION = 1


class AwareDeployment:
    """A replica-aware head: the real frontend and stage-0 pool, each replica a WireReplica."""

    def __init__(self, engine: Any, vllm_config: Any, *, send_delay: Any = None) -> None:
        self.engine, self.vllm_config, self.send_delay = engine, vllm_config, send_delay
        self.pool = engine.stage_pools[0]
        self.replicas: dict[int, WireReplica] = {}
        for rid in self.pool.live_replica_ids():
            self.attach(rid)
        self.sent: dict[str, Any] = {}  # request id -> the full request the orchestrator keeps
        self.routed: dict[str, int] = {}
        self.errors: list[str] = []
        self.finished: list[str] = []
        self._n = 0

    # ---- membership, as MembershipController does it ----
    def attach(self, rid: int | None = None, addr: str | None = None) -> int:
        """A registration: a new head-side client (and a fresh engine behind it)."""
        rid = self.pool.num_replicas if rid is None else rid
        replica = WireReplica(self.vllm_config, rid, send_delay=self.send_delay)
        addr = addr or replica.client.client_addresses["input_address"]
        replica.client.client_addresses["input_address"] = addr
        self.pool.add_client(addr, replica.client, replica_id=rid)
        self.replicas[rid] = replica
        return rid

    def detach(self, rid: int) -> str:
        """`_detach_replica`: `remove_client`, then the client's `shutdown()`."""
        client = self.replicas[rid].client
        addr = client.client_addresses["input_address"]
        self.pool.remove_client(addr)
        client.shutdown()
        return addr

    # ---- the request path ----
    async def render(self, images: list[int]) -> tuple[str, Any]:
        self._n += 1
        request_id = f"chatcmpl-{self._n}"
        messages = [m for image in images for m in chat_messages(image)]
        renderer = self.engine.input_processor.renderer
        (_conversation,), (prompt,) = await renderer.render_chat_async([messages], ChatParams())
        msg = self.engine._build_add_request_message(
            request_id, prompt, sampling_params_list=[SamplingParams(max_tokens=4)])
        return request_id, msg.prompt

    async def submit(self, images: list[int] | int, to: int | None = None) -> str:
        """Render, pick, hand the request to the chosen replica's client (StagePool.submit_initial's tail)."""
        request_id, request = await self.render([images] if isinstance(images, int) else images)
        return await self.dispatch(request_id, request, to)

    async def dispatch(self, request_id: str, request: Any, to: int | None = None) -> str:
        rid = to if to is not None else self.pool.select_replica_id(request_id)
        self.sent[request_id], self.routed[request_id] = request, rid
        await self.pool._llm_client(rid).add_request_async(request)
        return request_id

    async def settle(self) -> None:
        """Every replica processes its inbox; the head reads every output (where misses are handled)."""
        busy = True
        while busy:
            busy = False
            for replica in list(self.replicas.values()):
                busy |= replica.drain() > 0
                while not replica.client.outputs_queue.empty():
                    busy = True
                    outputs = await replica.client.get_output_async()
                    for eco in outputs.outputs:
                        if eco.finish_reason == FinishReason.ERROR:
                            self.errors.append(eco.request_id)
                        elif eco.finish_reason is not None:
                            self.finished.append(eco.request_id)

    # ---- the figures ----
    def stale(self) -> list[str]:
        """Requests whose replica used other features than the frontend processed for them."""
        out = []
        for request_id, request in self.sent.items():
            used = self.replicas[self.routed[request_id]].used.get(request_id)
            if used is None:
                continue  # not served (an error, counted there)
            truth = [pixel_digest(f.data) for f in request.mm_features]
            if [pixel_digest(f.data) for f in used] != truth or "no-tensor" in truth:
                out.append(request_id)
        return out

    def misses(self) -> int:
        return sum(len(r.misses) for r in self.replicas.values())

    def omitted(self) -> int:
        d = replica_aware_cache.dispatch()
        return d.stats["items_omitted"] if d is not None else 0


def aware_deployment(build_stage0_engine, make_vllm_config, monkeypatch, *, replicas=2, distributed=True,
                     send_delay=None, mode=contract.CACHE_REPLICA_AWARE, **model_kwargs) -> AwareDeployment:
    monkeypatch.setenv(contract.FRONTEND_CACHE_ENV, mode)
    vllm_config = make_vllm_config("multimodal", **model_kwargs)
    engine = build_stage0_engine(vllm_config, replicas=replicas, distributed=distributed)
    return AwareDeployment(engine, vllm_config, send_delay=send_delay)


@pytest.fixture
def aware(build_stage0_engine, make_vllm_config, monkeypatch):
    def make(**kwargs: Any) -> AwareDeployment:
        return aware_deployment(build_stage0_engine, make_vllm_config, monkeypatch, **kwargs)

    yield make
    replica_aware_cache.activate(None)  # the next test's head builds its own frontend


def item_bytes(make_vllm_config) -> int:
    """The size of one processed test image, as the receiver accounts it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(contract.FRONTEND_CACHE_ENV, raising=False)
        vllm_config = make_vllm_config("multimodal", mm_processor_cache_gb=0)
        d = AwareDeployment(stage0_engine_builder(mp)(vllm_config, replicas=1), vllm_config)
        _, request = asyncio.run(d.render([3]))
    return MultiModalCache.get_item_size(request.mm_features[0].data)


def assert_clean(d: AwareDeployment) -> None:
    assert d.errors == [], f"requests failed: {d.errors}"
    assert d.stale() == [], f"stale features: {d.stale()}"
    assert sorted(d.finished) == sorted(set(d.sent)), "every request finished exactly once"


# ---- the seed scenarios ----------------------------------------------------------------------
@pytest.mark.parametrize("distributed", [True, False], ids=["regression-distributed-2", "regression-static-2"])
def test_sequence_of_28_on_two_replicas(aware, distributed):
    d = aware(replicas=2, distributed=distributed)
    assert type(d.engine.input_processor.renderer.mm_processor_cache) is MultiModalProcessorOnlyCache

    async def run() -> None:
        for image in SEQUENCE_28:
            await d.submit(image)
            await d.settle()

    asyncio.run(run())
    assert_clean(d)
    assert d.misses() == 0
    assert {d.routed[r] for r in d.sent} == {0, 1}
    # 6 distinct images, each sent in full once per replica at most: the rest is omitted.
    assert d.omitted() == len(SEQUENCE_28) - sum(
        len({img for img, rid in zip(SEQUENCE_28, [d.routed[r] for r in d.sent]) if rid == k}) for k in (0, 1)
    ), d.omitted()
    full_sends = len(SEQUENCE_28) - d.omitted()
    assert full_sends <= 12


def test_replica_joining_mid_sequence(aware):
    d = aware(replicas=1)

    async def run() -> None:
        for image in SEQUENCE_28[:10]:
            await d.submit(image)
        await d.settle()
        newcomer = d.attach()  # registers after the frontend has seen every image
        for image in SEQUENCE_28[10:]:
            await d.submit(image)
        await d.settle()
        assert any(d.routed[r] == newcomer for r in list(d.sent)[10:])

    asyncio.run(run())
    assert_clean(d)
    assert d.misses() == 0
    assert d.omitted() > 0  # the mode omits tensors (processor-only would not)


@pytest.mark.parametrize("negative_control", [False, True], ids=["regression", "control-mirror-kept-on-restart"])
def test_replica_leaves_and_a_new_one_reuses_its_address(aware, monkeypatch, negative_control):
    """Replica 1 leaves; a new engine registers from the same IP and address and takes its slot.
    The control keeps the old client (and so its mirror) for the new engine, with the drop on
    shutdown switched off: the mirror then claims tensors the new engine never received."""
    d = aware(replicas=2)

    async def run() -> None:
        for image in (0, 1, 2, 0, 1, 2):
            await d.submit(image)
        await d.settle()
        old = d.replicas[1]
        if negative_control:  # keep the mirror when the client shuts down (still drop it on a miss)
            drop = replica_aware_cache.ReplicaAwareDispatch.drop
            monkeypatch.setattr(replica_aware_cache.ReplicaAwareDispatch, "drop",
                                lambda self, client, why: None if "shut down" in why else drop(self, client, why))
        addr = d.detach(1)
        if negative_control:  # a fresh engine behind the old client object (and its mirror)
            old.inbox, old.used, old.misses, old._built, old._cache = [], {}, [], False, None
            d.pool.add_client(addr, old.client, replica_id=1)
        else:
            d.attach(1, addr=addr)
        for image in (0, 1, 2, 0, 1, 2):
            await d.submit(image, to=1)
        await d.settle()

    asyncio.run(run())
    assert d.omitted() > 0
    if negative_control:
        assert d.misses() > 0  # the replica got omitted tensors it never had
        assert d.errors == [] and d.stale() == []  # ... and the re-send on a miss still served them
    else:
        assert_clean(d)
        assert d.misses() == 0


def test_retry_on_another_replica_is_rebuilt_from_full_items(aware):
    """The same request, sent stripped to replica 0, is re-dispatched to replica 1 (as a retry
    after replica 0 went away): replica 1 gets the tensor; the request the head keeps was never
    stripped."""
    d = aware(replicas=2)

    async def run() -> None:
        await d.submit(4, to=0)
        request_id, request = await d.render([4])
        await d.dispatch(request_id, request, to=0)  # omitted for replica 0 (it holds it)
        await d.settle()
        before = d.replicas[1].wire_bytes
        d.routed[request_id] = 1
        await d.pool._llm_client(1).add_request_async(request)  # the re-dispatch, same object
        await d.settle()
        assert d.replicas[1].wire_bytes - before > MultiModalCache.get_item_size(request.mm_features[0].data) / 2
        assert request.mm_features[0].data is not None  # the kept request still has its tensor

    asyncio.run(run())
    assert d.errors == [] and d.stale() == []
    assert d.misses() == 0
    assert d.omitted() == 1


def test_forced_receiver_eviction(aware, make_vllm_config):
    """Caches with room for two images: the mirror evicts what the receiver evicts, so an image
    that fell out of the replica's cache is sent in full again (no miss)."""
    size = item_bytes(make_vllm_config)
    d = aware(replicas=2, mm_processor_cache_gb=2.5 * size / 2**30)
    plan = [(3, 0), (4, 0), (5, 0), (3, 1), (3, 0), (4, 1), (5, 1), (3, 1), (4, 0), (4, 0)]

    async def run() -> None:
        for image, rid in plan:
            await d.submit(image, to=rid)
            await d.settle()
            # The mirror and the receiver hold the same keys, in the same LRU order.
            mirror = replica_aware_cache.dispatch().mirror(d.replicas[rid].client)
            assert mirror.keys() == list(d.replicas[rid].cache._cache.keys())

    asyncio.run(run())
    assert_clean(d)
    assert d.misses() == 0
    assert d.replicas[0].cache._cache.currsize <= 2.5 * size  # evictions happened
    assert d.omitted() == OMITTED_WITH_EVICTION


@pytest.mark.parametrize("negative_control", [False, True], ids=["regression", "control-miss-not-handled"])
def test_a_reported_miss_drops_the_mirror_and_resends_in_full(aware, monkeypatch, negative_control):
    """The replica loses its cache behind the head's back (e.g. its receiver was reset): the next
    stripped request misses; the head drops that replica's mirror and re-sends in full, and the
    orchestrator never sees the error. The control passes outputs through unhandled."""
    d = aware(replicas=1)
    if negative_control:
        async def passthrough(dispatch_, client, outputs):
            return outputs

        monkeypatch.setattr(replica_aware_cache, "_after_outputs", passthrough)

    async def run() -> None:
        for image in (0, 1, 0, 1):
            await d.submit(image)
        await d.settle()
        d.replicas[0].cache.clear_cache()  # the forced eviction the head cannot see
        # Two requests in flight before the first miss comes back: both were stripped with the
        # old mirror, both miss, both are re-sent. Afterwards the mirror is right again.
        await d.submit(0)
        await d.submit(1)
        await d.settle()
        for image in (2, 0, 1):
            await d.submit(image)
            await d.settle()

    asyncio.run(run())
    if negative_control:  # the error reaches the orchestrator (vllm-omni 0.30.0's behaviour), and
        assert d.errors and d.misses() >= 2  # the stale mirror keeps omitting: the next one misses too
        return
    assert d.misses() == 2  # the two in flight after the reset, and no other
    assert_clean(d)
    stats = replica_aware_cache.dispatch().stats
    assert stats["misses_resent"] == 2 and stats["misses_passed_on"] == 0


def test_concurrent_requests_to_one_replica_keep_mirror_and_receiver_in_step(aware, make_vllm_config):
    """40 requests submitted concurrently to one replica, each send finishing after a random
    delay (a busy socket), over a cache with room for three images: no miss, no stale feature,
    and the mirror ends equal to the receiver."""
    size = item_bytes(make_vllm_config)
    rng = random.Random(11)
    d = aware(replicas=1, send_delay=lambda: rng.random() * 0.002, mm_processor_cache_gb=3.5 * size / 2**30)
    images = [rng.choice(range(6)) for _ in range(40)]

    async def run() -> None:
        await asyncio.gather(*(d.submit([img, (img + 1) % 6]) for img in images))
        await d.settle()

    asyncio.run(run())
    assert_clean(d)
    assert d.misses() == 0
    assert d.omitted() > 0
    mirror = replica_aware_cache.dispatch().mirror(d.replicas[0].client)
    assert mirror.keys() == list(d.replicas[0].cache._cache.keys())


def test_an_aborted_request_is_forgotten(aware):
    """A stripped request is kept for a possible re-send until it finishes; an abort (which gets no
    final output from the engine) forgets it too, so kept requests cannot pile up."""
    d = aware(replicas=1)

    async def run() -> None:
        await d.submit(0)
        await d.settle()
        request_id = await d.submit(0)  # stripped: kept
        dispatch_ = replica_aware_cache.dispatch()
        client = d.replicas[0].client
        assert request_id in dispatch_._kept[client]
        await client.abort_requests_async([request_id])
        assert request_id not in dispatch_._kept[client]
        client.shutdown()  # detach: the mirror and everything kept go
        assert client not in dispatch_._mirrors and client not in dispatch_._kept

    asyncio.run(run())


# ---- the report and the switch ---------------------------------------------------------------
def test_report_names_replica_aware(aware):
    """regression: the head reports the mode only while the dispatch really runs."""
    d = aware(replicas=2)
    r = report.build(d.engine)
    # With the patch off: mode processor-only (the operator then holds CacheConsistent False).
    assert r["frontendCache"] == {"cacheClass": "MultiModalProcessorOnlyCache", "mode": contract.CACHE_REPLICA_AWARE,
                                  "requested": contract.CACHE_REPLICA_AWARE,
                                  "replicaAware": dict(replica_aware_cache.dispatch().stats)}
    assert r["patches"][PATCH]["outcome"] == _patching.outcomes()[PATCH].outcome


def test_other_modes_never_strip(aware):
    """unchanged: a processor-only head sends every tensor, whatever the replicas hold."""
    d = aware(replicas=2, mode=contract.CACHE_PROCESSOR_ONLY)
    assert replica_aware_cache.dispatch() is None

    async def run() -> None:
        for image in (0, 0, 0, 0):
            await d.submit(image)
        await d.settle()

    asyncio.run(run())
    assert_clean(d)
    assert report.build(d.engine)["frontendCache"]["mode"] == contract.CACHE_PROCESSOR_ONLY


def test_patch_outcome_follows_the_switch(engine_patches):
    from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClientBase

    outcome = engine_patches[PATCH]
    assert outcome.applied is (not _patching.disabled(PATCH)), outcome
    assert _patching.is_ours(StageEngineCoreClientBase.__dict__["add_request_async"], PATCH) is outcome.applied


def test_changed_client_shape_makes_it_a_no_op(monkeypatch):
    """An upstream whose client awaits something before it sends (the order guard) is refused,
    and nothing is half-applied."""
    import inspect

    from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClientBase

    async def add_request_async(self, request):  # a reshaped target: an await before the send
        await asyncio.sleep(0)
        await super(StageEngineCoreClientBase, self).add_request_async(request)

    before = {k: StageEngineCoreClientBase.__dict__.get(k) for k in replica_aware_cache._WRAPPED_INHERITED}
    monkeypatch.setattr(StageEngineCoreClientBase, "add_request_async", add_request_async)
    for attr, fn in before.items():
        if fn is not None:
            monkeypatch.delattr(StageEngineCoreClientBase, attr)
    reason = replica_aware_cache.install()
    assert reason and "awaits something before it sends" in reason, reason
    assert StageEngineCoreClientBase.__dict__["add_request_async"] is add_request_async
    assert not set(replica_aware_cache._WRAPPED_INHERITED) & set(StageEngineCoreClientBase.__dict__)
    assert inspect.iscoroutinefunction(add_request_async)
