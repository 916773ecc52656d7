"""Defect 2: scoping stage-0 multimodal UUIDs must never write back into the caller's prompt.

Requests go through vllm-omni's real `AsyncOmniEngine.add_request` (which calls the real
`_build_add_request_message`: `_scope_stage0_multimodal_cache_to_replica`,
`_ensure_stage_replica_mm_uuids`, then `InputProcessor.process_inputs` with the real Omni
renderer and Qwen2-VL processor on a tiny checkpoint without weights). The engine object is made
with `object.__new__` and initialised by vllm-omni's own `_initialize_stages` (conftest
`build_stage0_engine`): stage 0 has two replicas in one runtime, so the real `StagePool` routes
round robin (replica 0, 1, 0, 1, ...). Stand-ins: the stage runtime and replicas' head-side
clients (they would launch EngineCores), and the engine's request queue, a `queue.Queue` in
place of the janus queue whose consumer is the orchestrator thread; the test reads the message
`add_request` enqueued from it.

The key a request is cached under is the stage-0 `mm_hash` of its feature (vLLM uses a supplied
UUID as the hash): the frontend processor cache, the replica's receiver cache, the encoder cache
and the prefix cache are all keyed by it.

Tests marked "regression" fail when the patch is off:
    OMNISTAGE_DISABLE_PATCHES=uuid_scope pytest tests/engine/test_uuid_scope.py
Tests marked "unchanged" pin behaviour the patch must not alter; they pass either way.
"""

from __future__ import annotations

import copy
import inspect
import queue
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

from omnistage_engine_patches import _patching, patches
from omnistage_engine_patches.patches import uuid_scope
from vllm.multimodal.hasher import MultiModalHasher
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine

from tests.support.engine_stack import Replica, make_image, pixel_digest, stage0_engine_builder
from tests.support.tiny_models import IMAGE_PROMPT

PATCH = uuid_scope.NAME


class Head:
    """A stage-0 frontend (real engine object) with two replicas and their receiver caches."""

    def __init__(self, engine: Any, vllm_config: Any) -> None:
        self.engine = engine
        # Stand-in for the janus request queue (its consumer, the orchestrator thread, is not
        # running here): add_request's only use of it is `request_queue.sync_q.put(msg)`.
        engine.request_queue = SimpleNamespace(sync_q=queue.Queue())
        self.replicas = {rid: Replica(vllm_config, rid) for rid in engine.stage_pools[0].live_replica_ids()}
        self._n = 0

    def add_request(self, prompt: Any, *, streaming: bool = False) -> Any:
        self._n += 1
        request_id = f"req-{self._n}"
        if streaming:
            self.engine.add_streaming_update(request_id, prompt)
        else:
            self.engine.add_request(request_id, prompt)
        return self.engine.request_queue.sync_q.get_nowait()

    def deliver(self, msg: Any) -> str:
        """Route the request as the orchestrator's `StagePool.pick` does in a single runtime (the
        replica scoping preselected, else round robin); return the tensor the replica would use."""
        rid = self.engine.stage_pools[0].select_replica_id(msg.request_id)
        return pixel_digest(self.replicas[rid].receive(msg.prompt)[0].data)


def key(msg: Any) -> str:
    """The cache key of the request's (single) image."""
    (feature,) = msg.prompt.mm_features
    return feature.mm_hash


def content_hash(head: Head, image: int) -> str:
    """What `_ensure_stage_replica_mm_uuids` hashes an image to (blake3 over model id + media)."""
    return MultiModalHasher.hash_kwargs("blake3", model_id=head.engine.model, image=make_image(image))


def prompt(image: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": make_image(image)}, **extra}


@pytest.fixture
def head(build_stage0_engine, make_vllm_config) -> Head:
    vllm_config = make_vllm_config("multimodal")
    return Head(build_stage0_engine(vllm_config, replicas=2), vllm_config)


@pytest.fixture(scope="module")
def reference_pixels(make_vllm_config) -> dict[int, str]:
    """Each image's processed tensor, from a frontend with caching disabled and one replica."""
    with pytest.MonkeyPatch.context() as mp:
        vllm_config = make_vllm_config("multimodal", mm_processor_cache_gb=0)
        reference = Head(stage0_engine_builder(mp)(vllm_config, replicas=1), vllm_config)
        digests = {i: reference.deliver(reference.add_request(prompt(i))) for i in range(4)}
    assert len(set(digests.values())) == len(digests)
    return digests


def single_scope(k: str) -> bool:
    return k.startswith("stage0:rep") and k.count("stage0:") == 1


# ---- regressions ---------------------------------------------------------------------------
def test_reused_template_gives_four_distinct_keys(head):
    """regression: a used template plus three copies with new media, over two replicas, give
    four distinct keys with a single `stage0:repN:` prefix each; the template keeps its value."""
    template = prompt(0)
    original = copy.copy(template)
    msgs = [head.add_request(template)]
    msgs += [head.add_request({**template, "multi_modal_data": {"image": make_image(i)}}) for i in (1, 2, 3)]
    keys = [key(m) for m in msgs]
    assert len(set(keys)) == 4, keys
    assert all(single_scope(k) for k in keys), keys
    assert [k.split(":")[1] for k in keys] == ["rep0", "rep1", "rep0", "rep1"]  # round robin
    assert [k.split(":", 2)[2] for k in keys] == [content_hash(head, i) for i in range(4)]
    assert "multi_modal_uuids" not in template
    assert template.keys() - {"additional_information"} == original.keys()  # see the unchanged test
    assert template["multi_modal_data"] is original["multi_modal_data"]


def test_reused_template_each_request_gets_its_own_media(head, reference_pixels):
    """regression: the consequence of the shared key. The replica (or the frontend cache) holds
    the first copy's tensors under that key and serves them for the next copy on that replica."""
    template = prompt(0)
    digests = [head.deliver(head.add_request(template))]
    for i in (1, 2, 3):
        digests.append(
            head.deliver(head.add_request({**template, "multi_modal_data": {"image": make_image(i)}}))
        )
    assert digests == [reference_pixels[i] for i in range(4)]


def test_user_uuids_are_scoped_without_touching_the_caller(head):
    """regression: user-supplied UUIDs are still replica-scoped for the cache, but the caller's
    dict and the original prompt later stages see keep the caller's values."""
    caller = prompt(0, multi_modal_uuids={"image": ["my-photo"]})
    first = head.add_request(caller)
    second = head.add_request(caller)  # the same dict again: a retry
    assert [key(first), key(second)] == ["stage0:rep0:my-photo", "stage0:rep1:my-photo"]
    assert caller["multi_modal_uuids"] == {"image": ["my-photo"]}
    for msg in (first, second):
        assert msg.original_prompt is caller  # downstream stages get the caller's (unscoped) dict


def test_retry_on_another_replica_gets_a_single_prefix(head):
    """regression: the same dict sent again lands on the other replica and is keyed by its own
    media there (the unpatched engine keyed it `stage0:rep1:stage0:rep0:<hash>`)."""
    caller = prompt(1)
    keys = [key(head.add_request(caller)) for _ in range(3)]
    h = content_hash(head, 1)
    assert keys == [f"stage0:rep0:{h}", f"stage0:rep1:{h}", f"stage0:rep0:{h}"]
    assert "multi_modal_uuids" not in caller


def test_copies_of_a_dict_carrying_a_key_this_process_wrote(head):
    """regression: a dict carrying a scoped key this process wrote (read back from a request,
    saved, or scoped before the fix) is copied and sent again. That `stageN:repM:` value is not a
    user UUID: a copy with the same media gets one prefix and its own hash, a copy with new media
    is keyed by the new media, never by the old hash."""
    old = content_hash(head, 0)
    written = key(head.add_request(prompt(0)))  # replica 0: this process writes stage0:rep0:<old>
    assert written == f"stage0:rep0:{old}"
    scoped = prompt(0, multi_modal_uuids={"image": [written]})
    retry = head.add_request(dict(scoped))  # replica 1
    same_media_elsewhere = head.add_request(dict(scoped))  # replica 0
    new_media = head.add_request({**scoped, "multi_modal_data": {"image": make_image(2)}})  # replica 1
    assert key(retry) == f"stage0:rep1:{old}"
    assert key(same_media_elsewhere) == f"stage0:rep0:{old}"
    assert key(new_media) == f"stage0:rep1:{content_hash(head, 2)}"
    assert scoped["multi_modal_uuids"] == {"image": [written]}  # the caller's dict as given


def test_a_user_uuid_shaped_like_an_engine_key_is_the_users(head):
    """A caller's own UUID that merely looks like `stageN:repM:...` (never written by this
    process) is kept and scoped like any user UUID, as upstream's fix keeps it: never dropped,
    never stripped."""
    mine = "stage3:rep7:customer-asset-42"
    assert mine not in uuid_scope.WRITTEN
    caller = prompt(0, multi_modal_uuids={"image": [mine]})
    msgs = [head.add_request(caller), head.add_request(dict(caller))]
    assert [key(m) for m in msgs] == [f"stage0:rep0:{mine}", f"stage0:rep1:{mine}"]
    assert caller["multi_modal_uuids"] == {"image": [mine]}
    reference = {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [None]},
                 "multi_modal_uuids": {"image": [mine]}}  # a UUID-only reference keeps the whole key
    assert key(head.add_request(reference)) == f"stage0:rep0:{mine}"


def test_uuid_only_reference_keeps_its_key_with_one_prefix(head, reference_pixels):
    """regression: an engine-scoped UUID with no media (vLLM's UUID-only reference to media the
    frontend cache holds) cannot be re-hashed: the engine's prefix is stripped so the reference
    is scoped exactly once and finds the cached item."""
    h = content_hash(head, 3)
    first = head.add_request(prompt(3))  # replica 0 caches image 3 under stage0:rep0:<h>
    assert head.deliver(first) == reference_pixels[3]
    head.deliver(head.add_request(prompt(1)))  # replica 1
    assert key(first) == f"stage0:rep0:{h}"
    reference = {
        "prompt": IMAGE_PROMPT,
        "multi_modal_data": {"image": [None]},
        "multi_modal_uuids": {"image": [key(first)]},  # the value an unpatched engine wrote back
    }
    msg = head.add_request(reference)  # replica 0 again
    assert key(msg) == f"stage0:rep0:{h}"
    assert head.deliver(msg) == reference_pixels[3]
    assert reference["multi_modal_uuids"] == {"image": [f"stage0:rep0:{h}"]}


def test_streaming_update_does_not_write_back(head):
    """regression: add_streaming_update goes through the same builder."""
    caller = prompt(2)
    msg = head.add_request(caller, streaming=True)
    assert single_scope(key(msg))
    assert "multi_modal_uuids" not in caller
    assert msg.original_prompt is caller


def test_failed_request_leaves_the_caller_untouched(head):
    """regression: processing fails after scoping (two images, one placeholder); the caller's
    dict must not keep the scoped UUIDs the unpatched engine wrote before raising."""
    caller = {"prompt": IMAGE_PROMPT, "multi_modal_data": {"image": [make_image(0), make_image(1)]}}
    with pytest.raises(Exception):  # noqa: B017  (whatever vLLM raises for the mismatch)
        head.add_request(caller)
    assert "multi_modal_uuids" not in caller


# ---- unchanged ------------------------------------------------------------------------------
def test_caller_side_effects_are_kept(head):
    """unchanged: what vllm-omni deliberately writes into the caller's dict (the global request
    id in `additional_information`) still reaches it; the message points at the caller's dict."""
    caller = prompt(1, additional_information={"meta": {}})
    msg = head.add_request(caller)
    assert caller["additional_information"]["global_request_id"] == [msg.request_id]
    assert msg.original_prompt is caller
    bare = prompt(2)
    head.add_request(bare)
    assert bare["additional_information"]["global_request_id"]  # created on the caller's dict


def test_single_replica_is_not_scoped(build_stage0_engine, make_vllm_config):
    """unchanged: with one stage-0 replica vllm-omni keys media by content alone."""
    vllm_config = make_vllm_config("multimodal")
    head = Head(build_stage0_engine(vllm_config, replicas=1), vllm_config)
    caller = prompt(0)
    keys = [key(head.add_request(caller)) for _ in range(2)]
    assert keys == [content_hash(head, 0)] * 2
    assert "multi_modal_uuids" not in caller


def test_rendered_chat_prompt_passes_through(head):
    """unchanged: an already rendered prompt (the chat path) has no multi_modal_data; it is not
    scoped, and the message carries the caller's object."""
    rendered = head.engine.input_processor.renderer.render_cmpl([prompt(1)])[0]
    msg = head.add_request(rendered)
    assert key(msg) == rendered["mm_hashes"]["image"][0]
    assert msg.original_prompt is rendered


# ---- the patch's own safety ----------------------------------------------------------------
def test_patch_outcome_follows_the_switch(engine_patches):
    outcome = engine_patches[PATCH]
    assert outcome.applied is (not _patching.disabled(PATCH)), outcome
    assert _patching.is_ours(AsyncOmniEngine.__dict__["_build_add_request_message"], uuid_scope.NAME) is outcome.applied


def test_applying_twice_is_harmless(engine_patches):
    before = AsyncOmniEngine.__dict__["_build_add_request_message"]
    assert patches.BY_NAME[uuid_scope.NAME].apply() is engine_patches[PATCH]
    if engine_patches[PATCH].applied:
        assert uuid_scope.install() is None  # sees its own wrapper, does not stack another
    assert AsyncOmniEngine.__dict__["_build_add_request_message"] is before


def _original_build():
    fn = AsyncOmniEngine.__dict__["_build_add_request_message"]
    return inspect.unwrap(fn) if _patching.is_ours(fn, uuid_scope.NAME) else fn


def test_upstream_fix_makes_it_a_no_op(monkeypatch):
    """An upstream that scopes a copy (no `prompt["multi_modal_uuids"] = ...`) is left alone."""

    def _ensure_stage_replica_mm_uuids(self, prompt, *, stage_id, replica_id):
        scoped = dict(prompt)
        scoped.update(multi_modal_uuids={})
        return scoped

    build = _original_build()
    monkeypatch.setattr(AsyncOmniEngine, "_build_add_request_message", build)
    monkeypatch.setattr(AsyncOmniEngine, "_ensure_stage_replica_mm_uuids", _ensure_stage_replica_mm_uuids)
    reason = uuid_scope.install()
    assert reason and "no longer writes" in reason
    assert AsyncOmniEngine.__dict__["_build_add_request_message"] is build


def test_changed_signature_makes_it_a_no_op(monkeypatch):
    def _build_add_request_message(self, request, *, prompt_override=None):
        return None

    monkeypatch.setattr(AsyncOmniEngine, "_build_add_request_message", _build_add_request_message)
    reason = uuid_scope.install()
    assert reason and "changed shape" in reason, reason
    assert AsyncOmniEngine.__dict__["_build_add_request_message"] is _build_add_request_message
