"""Defect 1: the shared stage-0 frontend must not use an IPC sender cache when replicas can differ.

Everything here is the real vllm 0.30.0 / vllm-omni 0.30.0 code on the CPU:

* the frontend is the stage-0 input processor and Omni renderer that vllm-omni's own
  `OmniEngineBase._initialize_stages` builds (via the `build_stage0_engine` fixture; the only
  stand-ins are the stage runtime, which would launch EngineCores on GPUs, and the replicas'
  head-side clients; see tests/support/engine_stack.py);
* requests take the `/v1/chat/completions` route: `renderer.render_chat_async` (multimodal
  processing and the frontend cache, before any replica is chosen), then
  `AsyncOmniEngine._build_add_request_message`, then the stage-0 `StagePool` picks a replica
  (round robin);
* each replica's receiver is what its EngineCore builds: `engine_receiver_cache_from_config`
  (`MultiModalReceiverCache` for lru) or `worker_receiver_cache_from_config`
  (`ShmObjectStoreReceiverCache` for shm), fed the request's `mm_features` exactly like
  `EngineCore.preprocess_add_request` does.

Tests marked "regression" fail when the patch is off:
    OMNISTAGE_DISABLE_PATCHES=frontend_cache pytest tests/engine/test_frontend_cache.py
Tests marked "unchanged" pin behaviour the patch must not alter; they pass either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from typing import Any

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

from omnistage_engine_patches import _patching, patches
from omnistage_engine_patches.patches import frontend_cache
from vllm import SamplingParams
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.cache import (
    MultiModalCache,
    MultiModalCacheMissError,
    MultiModalProcessorOnlyCache,
    MultiModalProcessorSenderCache,
    MultiModalReceiverCache,
    ShmObjectStoreReceiverCache,
    ShmObjectStoreSenderCache,
)
from vllm.multimodal.registry import MultiModalRegistry
from vllm.renderers.params import ChatParams

from tests.support.engine_stack import (
    InertStageClient,
    Replica,
    image_data_url,
    pixel_digest,
    stage0_engine_builder,
)

PATCH = frontend_cache.NAME


def chat_messages(image: int) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                {"type": "text", "text": "describe the image"},
            ],
        }
    ]


class Deployment:
    """One stage-0 frontend (a real engine) plus the replicas its pool routes to."""

    def __init__(self, engine: Any, vllm_config: Any) -> None:
        self.engine = engine
        self.vllm_config = vllm_config
        self.pool = engine.stage_pools[0]
        self.replicas = {rid: Replica(vllm_config, rid) for rid in self.pool.live_replica_ids()}
        self._n = 0

    @property
    def frontend_cache(self) -> Any:
        return self.engine.input_processor.renderer.mm_processor_cache

    def join(self) -> int:
        """A replica registers after startup (what MembershipController.handle_register does)."""
        rid = self.pool.num_replicas
        client = InertStageClient(rid)
        self.pool.add_client(client.client_addresses["input_address"], client, replica_id=rid)
        self.replicas[rid] = Replica(self.vllm_config, rid)
        return rid

    def render(self, image: int) -> Any:
        """The chat route up to the engine request: render (frontend cache) -> engine message."""
        self._n += 1
        request_id = f"chatcmpl-{self._n}"
        renderer = self.engine.input_processor.renderer
        (_conversation,), (engine_prompt,) = asyncio.run(
            renderer.render_chat_async([chat_messages(image)], ChatParams())
        )
        # The serving layer passes per-stage sampling params with every request.
        msg = self.engine._build_add_request_message(
            request_id, engine_prompt, sampling_params_list=[SamplingParams(max_tokens=4)]
        )
        return request_id, msg.prompt

    def send(self, image: int, to: int | None = None) -> tuple[int, str, Any]:
        """Render, route (round robin unless `to`), deliver; return (replica, outcome, request)."""
        request_id, request = self.render(image)
        rid = to if to is not None else self.pool.select_replica_id(request_id)
        try:
            features = self.replicas[rid].receive(request)
        except MultiModalCacheMissError:
            return rid, "cache-miss", request
        return rid, pixel_digest(features[0].data), request


@pytest.fixture(scope="module")
def reference_pixels(make_vllm_config) -> dict[int, str]:
    """Each test image's tensor fingerprint, from a frontend with caching disabled."""
    with pytest.MonkeyPatch.context() as mp:
        vllm_config = make_vllm_config("multimodal", mm_processor_cache_gb=0)
        engine = stage0_engine_builder(mp)(vllm_config, replicas=1)
        reference = Deployment(engine, vllm_config)
        digests = {i: reference.send(i)[1] for i in range(8)}
    assert len(set(digests.values())) == len(digests)  # distinct images give distinct tensors
    return digests


def deployment(build_stage0_engine, make_vllm_config, *, replicas: int, distributed: bool, **model_kwargs):
    vllm_config = make_vllm_config("multimodal", **model_kwargs)
    engine = build_stage0_engine(vllm_config, replicas=replicas, distributed=distributed)
    return Deployment(engine, vllm_config)


RUNTIME = {"static": False, "distributed": True}


# ---- the engine-to-builder wiring -----------------------------------------------------------
@pytest.mark.parametrize(
    ("runtime", "replicas", "expected"),
    [
        pytest.param("static", 1, MultiModalProcessorSenderCache, id="unchanged-static-1-replica"),
        pytest.param("static", 2, MultiModalProcessorOnlyCache, id="regression-static-2-replicas"),
        pytest.param("static", 3, MultiModalProcessorOnlyCache, id="regression-static-3-replicas"),
        pytest.param("distributed", 0, MultiModalProcessorOnlyCache, id="regression-distributed-0-replicas"),
        pytest.param("distributed", 1, MultiModalProcessorOnlyCache, id="regression-distributed-1-replica"),
        pytest.param("distributed", 2, MultiModalProcessorOnlyCache, id="regression-distributed-2-replicas"),
    ],
)
def test_stage0_frontend_cache_class(build_stage0_engine, make_vllm_config, runtime, replicas, expected):
    """vllm-omni's own _initialize_stages -> build_stage0_input_processor -> renderer cache."""
    d = deployment(build_stage0_engine, make_vllm_config, replicas=replicas, distributed=RUNTIME[runtime])
    # The engine passed its mode to the runtime factory as vllm-omni does (wiring sanity).
    assert d.engine.stand_in_runtime.kwargs["single_stage_mode"] is RUNTIME[runtime]
    assert type(d.frontend_cache) is expected
    # The renderer's processor really holds that cache (the object the chat path consults).
    assert d.engine.input_processor.renderer.mm_processor.cache is d.frontend_cache


# ---- LRU sender vs. replicas on the chat path ----------------------------------------------
@pytest.mark.parametrize(
    ("runtime", "replicas"),
    [
        pytest.param("static", 1, id="unchanged-static-1-receiver"),
        pytest.param("static", 2, id="regression-static-2-receivers"),
        pytest.param("static", 3, id="regression-static-3-receivers"),
        pytest.param("distributed", 2, id="regression-distributed-2-receivers"),
        pytest.param("distributed", 3, id="regression-distributed-3-receivers"),
    ],
)
def test_lru_repeated_media_round_robin(
    build_stage0_engine, make_vllm_config, reference_pixels, runtime, replicas
):
    """The same new image, again and again, round robin: every replica must get its tensor.

    The sender cache omits the tensor on its second sight of the image; the replica the request
    lands on has never seen it and raises MultiModalCacheMissError (the "stop, error, stop" of
    the GPU reproduction). With one receiver the shadow is exact, which is why local single
    replica deployments keep the sender cache.
    """
    d = deployment(build_stage0_engine, make_vllm_config, replicas=replicas, distributed=RUNTIME[runtime])
    outcomes = [d.send(image)[:2] for image in (0, 0, 0, 1, 0, 1, 1)]
    expected = [reference_pixels[image] for image in (0, 0, 0, 1, 0, 1, 1)]
    assert [o for _, o in outcomes] == expected, outcomes
    assert {rid for rid, _ in outcomes} == set(range(replicas))  # every replica was exercised


@pytest.mark.parametrize("initial", [1, 2], ids=lambda n: f"regression-distributed-start-{n}")
def test_replica_joining_later_receives_tensors(
    build_stage0_engine, make_vllm_config, reference_pixels, initial
):
    """A distributed head starts with 1 or 2 replicas and warms its frontend; then a headless
    replica joins. Media the frontend has seen must still reach the newcomer.

    (A start with 0 stage-0 replicas is covered by the wiring table above: vllm-omni 0.30.0
    cannot serve from an empty stage-0 pool, `_build_add_request_message` reads
    `stage_metadata[0]`, which `_initialize_stages` fills from the replicas present.)
    """
    d = deployment(build_stage0_engine, make_vllm_config, replicas=initial, distributed=True)
    for rid in list(d.replicas):
        assert d.send(2, to=rid)[1] == reference_pixels[2]  # warm: every existing replica has it
    newcomer = d.join()
    rid, outcome, _ = d.send(2, to=newcomer)
    assert (rid, outcome) == (newcomer, reference_pixels[2])
    # And the frontend cache chosen at startup was already the one that made this safe.
    assert type(d.frontend_cache) is MultiModalProcessorOnlyCache


def test_receiver_eviction(build_stage0_engine, make_vllm_config, reference_pixels):
    """regression: a replica evicts an image it had; the frontend's shadow still lists it
    (another replica's delivery refreshed it there), so the sender omits the tensor and the
    replica that evicted it misses. Each cache has room for two processed images.

    Routing is explicit (as a least-queue-length or affinity policy may route); the frontend
    cannot mirror the eviction order of several receivers whatever the policy.
    """
    probe = deployment(build_stage0_engine, make_vllm_config, replicas=1, distributed=False)
    item_bytes = MultiModalCache.get_item_size(probe.render(3)[1].mm_features[0].data)
    cache_gb = 2.5 * item_bytes / 2**30  # room for two processed images, not three
    d = deployment(
        build_stage0_engine, make_vllm_config, replicas=2, distributed=False, mm_processor_cache_gb=cache_gb
    )
    plan = [(3, 0), (4, 0), (5, 0), (3, 1), (3, 0)]  # (image, replica)
    outcomes, keys = [], []
    for step, (image, rid) in enumerate(plan):
        if step == len(plan) - 1:
            # Replica 0 received image 3 at step 0 and has evicted it since (steps 1-2).
            assert outcomes[0] == (0, reference_pixels[3])
            assert keys[0] not in d.replicas[0].cache._cache
        rid_, outcome, request = d.send(image, to=rid)
        outcomes.append((rid_, outcome))
        keys.append(request.mm_features[0].mm_hash)
    assert outcomes == [(rid, reference_pixels[image]) for image, rid in plan], outcomes


# ---- SHM sender ----------------------------------------------------------------------------
@pytest.fixture
def shm_ring(monkeypatch):
    # Page-locked ("pinned") host memory needs a CUDA driver; the real SHM receiver runs in GPU
    # workers and pins the tensors it decodes. Here, without a GPU, decode into ordinary memory.
    from vllm.v1 import serial_utils

    monkeypatch.setattr(serial_utils, "PIN_MEMORY", False)
    created: list[Any] = []
    yield created
    for cache in created:  # unlink the ring this test's frontend created
        with contextlib.suppress(FileNotFoundError):
            cache._shm_cache.ring_buffer.shared_memory.unlink()


def shm_deployment(build_stage0_engine, make_vllm_config, shm_ring, *, replicas, distributed):
    d = deployment(
        build_stage0_engine,
        make_vllm_config,
        replicas=replicas,
        distributed=distributed,
        mm_processor_cache_type="shm",
    )
    if isinstance(d.frontend_cache, ShmObjectStoreSenderCache):
        shm_ring.append(d.frontend_cache)
    return d


def test_shm_single_local_replica_unchanged(
    build_stage0_engine, make_vllm_config, shm_ring, reference_pixels
):
    """unchanged: one local replica keeps the SHM sender; repeated media resolve through the ring."""
    d = shm_deployment(build_stage0_engine, make_vllm_config, shm_ring, replicas=1, distributed=False)
    assert type(d.frontend_cache) is ShmObjectStoreSenderCache
    assert type(d.replicas[0].cache) is ShmObjectStoreReceiverCache
    outcomes = [d.send(image)[1] for image in (0, 0, 1, 0)]
    assert outcomes == [reference_pixels[i] for i in (0, 0, 1, 0)]


@pytest.mark.parametrize("replicas", [2, 3], ids=lambda n: f"regression-distributed-{n}-receivers")
def test_shm_sender_payload_reaches_replicas_in_other_pods(
    build_stage0_engine, make_vllm_config, shm_ring, reference_pixels, replicas
):
    """A distributed head with `mm_processor_cache_type: shm`: replica 0 runs on the head and
    shares its /dev/shm; headless replicas run in other pods and get only what crosses IPC.

    The SHM sender puts every tensor into the head's /dev/shm ring and sends an address: a
    replica in another pod lacks the tensor on every request. The processor-only frontend sends
    the tensor itself. (An SHM *receiver* in another pod cannot even open the head's ring, see
    the next test, which is why the operator never renders `shm` with dynamic membership.)
    """
    d = shm_deployment(build_stage0_engine, make_vllm_config, shm_ring, replicas=replicas, distributed=True)
    remote_payloads = []
    for image in (0, 1, 0, 1, 0, 1):
        request_id, request = d.render(image)
        rid = d.pool.select_replica_id(request_id)
        if rid != 0:  # replica 0 is head-local: it could read the head's ring
            remote_payloads.append((rid, image, pixel_digest(request.mm_features[0].data)))
    assert {rid for rid, _, _ in remote_payloads} == set(range(1, replicas))
    assert [p[2] for p in remote_payloads] == [reference_pixels[i] for _, i, _ in remote_payloads], (
        remote_payloads
    )


def test_shm_receiver_in_another_pod_cannot_open_the_head_ring(make_vllm_config, monkeypatch, shm_ring):
    """unchanged (a fact the operator relies on): a headless process names its own ring
    (vLLM derives the name per process tree), so its SHM receiver finds no ring to attach to."""
    vllm_config = make_vllm_config("multimodal", mm_processor_cache_type="shm")
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", "omnistage_test_other_pod_ring")
    with pytest.raises(FileNotFoundError):
        ShmObjectStoreReceiverCache(vllm_config, threading.Lock())


# ---- what the patch must leave alone -------------------------------------------------------
@pytest.mark.parametrize(
    ("runtime", "replicas"), [("static", 2), ("distributed", 1)], ids=["static-2", "distributed-1"]
)
def test_disabled_cache_stays_disabled(
    build_stage0_engine, make_vllm_config, reference_pixels, runtime, replicas
):
    """unchanged: mm_processor_cache_gb=0 means no frontend cache (and no receiver cache)."""
    d = deployment(
        build_stage0_engine,
        make_vllm_config,
        replicas=replicas,
        distributed=RUNTIME[runtime],
        mm_processor_cache_gb=0,
    )
    assert d.frontend_cache is None
    assert all(r.cache is None for r in d.replicas.values())
    assert [d.send(i)[1] for i in (0, 0, 0)] == [reference_pixels[0]] * 3


def test_existing_processor_only_configuration_unchanged(build_stage0_engine, make_vllm_config):
    """unchanged: a frontend vLLM already gives processor-only (several API server processes)."""
    vllm_config = make_vllm_config("multimodal")
    vllm_config.parallel_config._api_process_count = 2  # what --api-server-count 2 sets
    engine = build_stage0_engine(vllm_config, replicas=1)
    assert MultiModalRegistry._get_cache_type(MULTIMODAL_REGISTRY, vllm_config) == "processor_only"
    assert type(engine.input_processor.renderer.mm_processor_cache) is MultiModalProcessorOnlyCache


@pytest.mark.parametrize(
    ("runtime", "replicas"), [("static", 2), ("distributed", 1)], ids=["static-2", "distributed-1"]
)
def test_text_only_renderer_has_no_multimodal_cache(build_stage0_engine, make_vllm_config, runtime, replicas):
    """unchanged: a text-only model's renderer has no multimodal processor and no cache."""
    vllm_config = make_vllm_config("text")
    engine = build_stage0_engine(vllm_config, replicas=replicas, distributed=RUNTIME[runtime])
    renderer = engine.input_processor.renderer
    assert renderer.mm_processor is None
    assert renderer.mm_processor_cache is None
    msg = engine._build_add_request_message(
        "text-1", {"prompt": "hello world"}, sampling_params_list=[SamplingParams(max_tokens=4)]
    )
    assert msg.prompt.prompt_token_ids and not msg.prompt.mm_features


@pytest.mark.parametrize(
    ("runtime", "replicas"), [("static", 2), ("distributed", 1)], ids=["static-2", "distributed-1"]
)
def test_replica_receiver_caches_unchanged(build_stage0_engine, make_vllm_config, runtime, replicas):
    """unchanged: replicas keep their receiver caches; `_get_cache_type` is not patched."""
    d = deployment(build_stage0_engine, make_vllm_config, replicas=replicas, distributed=RUNTIME[runtime])
    assert not _patching.is_ours(MultiModalRegistry.__dict__["_get_cache_type"])
    assert MULTIMODAL_REGISTRY._get_cache_type(d.vllm_config) == "lru"
    assert all(type(r.cache) is MultiModalReceiverCache for r in d.replicas.values())


def test_renderers_built_outside_stage_initialisation_unchanged(make_vllm_config):
    """unchanged: only the engine's shared stage-0 frontend is switched; a renderer built
    elsewhere (e.g. the orchestrator's lazily built downstream-stage processors) keeps vLLM's."""
    from vllm_omni.engine.stage_init_utils import build_stage0_input_processor

    processor = build_stage0_input_processor(make_vllm_config("multimodal"))
    assert type(processor.renderer.mm_processor_cache) is MultiModalProcessorSenderCache


# ---- the patch's own safety ----------------------------------------------------------------
def test_patch_outcome_follows_the_switch(engine_patches):
    """Applied through the plugin loader unless OMNISTAGE_DISABLE_PATCHES names it."""
    outcome = engine_patches[PATCH]
    assert outcome.applied is (not _patching.disabled(PATCH)), outcome
    wrapped = _patching.is_ours(MultiModalRegistry.__dict__["processor_cache_from_config"])
    assert wrapped is outcome.applied


def test_applying_twice_is_harmless(engine_patches):
    from vllm_omni.engine.omni_engine_base import OmniEngineBase

    before = (
        OmniEngineBase.__dict__["_initialize_stages"],
        MultiModalRegistry.__dict__["processor_cache_from_config"],
    )
    assert patches.BY_NAME[frontend_cache.NAME].apply() is engine_patches[PATCH]  # recorded once per process
    if engine_patches[PATCH].applied:
        assert frontend_cache.install() is None  # a second install sees its own wrappers
    after = (
        OmniEngineBase.__dict__["_initialize_stages"],
        MultiModalRegistry.__dict__["processor_cache_from_config"],
    )
    assert after == before


def _unwrapped(fn):
    return inspect.unwrap(fn) if _patching.is_ours(fn) else fn


def test_upstream_fix_makes_it_a_no_op(monkeypatch):
    """When vllm-omni itself already picks ProcessorOnly, install() refuses and changes nothing."""
    from vllm_omni.engine.omni_engine_base import OmniEngineBase

    def _initialize_stages(self, stage_init_timeout):  # an upstream that already fixed it
        self.input_processor = build_stage0_input_processor(  # noqa: F821
            self.stage_vllm_configs[0], cache_cls="MultiModalProcessorOnlyCache"
        )

    monkeypatch.setattr(OmniEngineBase, "_initialize_stages", _initialize_stages)
    ctor = _unwrapped(MultiModalRegistry.__dict__["processor_cache_from_config"])
    monkeypatch.setattr(MultiModalRegistry, "processor_cache_from_config", ctor)
    reason = frontend_cache.install()
    assert reason and "upstream already" in reason
    assert OmniEngineBase.__dict__["_initialize_stages"] is _initialize_stages
    assert MultiModalRegistry.__dict__["processor_cache_from_config"] is ctor


def test_changed_signature_makes_it_a_no_op(monkeypatch):
    from vllm_omni.engine.omni_engine_base import OmniEngineBase

    init = _unwrapped(OmniEngineBase.__dict__["_initialize_stages"])

    def processor_cache_from_config(self, vllm_config, *, role="frontend"):  # a reshaped target
        return None

    monkeypatch.setattr(OmniEngineBase, "_initialize_stages", init)
    monkeypatch.setattr(MultiModalRegistry, "processor_cache_from_config", processor_cache_from_config)
    reason = frontend_cache.install()
    assert reason and "changed shape" in reason, reason
    assert OmniEngineBase.__dict__["_initialize_stages"] is init  # nothing half-applied


def test_decision_reads_the_engine_state():
    """The rule itself: distributed always; otherwise more than one configured or pooled replica."""
    from types import SimpleNamespace

    def engine(distributed, configured, pooled):
        return SimpleNamespace(
            single_stage_mode=distributed,
            stage_configs=[SimpleNamespace(runtime_config={"num_replicas": configured})],
            stage_pools=[SimpleNamespace(num_replicas=pooled)],
        )

    assert frontend_cache.stage0_needs_processor_only(engine(True, 1, 0))
    assert frontend_cache.stage0_needs_processor_only(engine(False, 2, 2))
    assert frontend_cache.stage0_needs_processor_only(engine(False, 1, 2))
    assert not frontend_cache.stage0_needs_processor_only(engine(False, 1, 1))
