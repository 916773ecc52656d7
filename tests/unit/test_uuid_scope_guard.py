"""Patch uuid_scope decides `upstream-fixed` by running upstream's scoping, not only by reading it.

vllm-omni 0.32 moved the scoping into a helper that returns a scoped copy
(vllm_omni/engine/async_engine_utils.py:43; docs/engine-versions.md): the write-back line the old guard
looked for is gone from `_ensure_stage_replica_mm_uuids`. That alone would also pass a helper that
still wrote into the caller's dict. The guard now runs the method on a probe and looks at the
caller's prompt. No vLLM: stand-in engines of each shape are put where install imports them."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
from omnistage_engine_patches import contract
from omnistage_engine_patches._patching import UpstreamFixed
from omnistage_engine_patches.patches import uuid_scope


class Message:  # StageSubmissionMessage's shape, as install checks it
    __struct_fields__ = ("prompt", "original_prompt")

    def __init__(self, prompt, original_prompt):
        self.prompt, self.original_prompt = prompt, original_prompt


def _scoped(prompt, stage_id, replica_id):
    uuids = prompt[uuid_scope.UUIDS_KEY]
    scoped = {m: [f"stage{stage_id}:rep{replica_id}:{u}" for u in v] for m, v in uuids.items()}
    return {**prompt, uuid_scope.UUIDS_KEY: scoped}


def _engine(shape: str) -> type:
    """A fresh AsyncOmniEngine stand-in (install wraps it) whose scoping has `shape`."""

    def scope_into_caller(prompt, *, stage_id, replica_id):  # a helper that still writes back
        prompt.update(_scoped(prompt, stage_id, replica_id))
        return prompt

    class Engine:
        def _ensure_stage_replica_mm_uuids(self, prompt, *, stage_id, replica_id):
            if shape == "copy":  # vllm-omni 0.32
                return _scoped(prompt, stage_id, replica_id)
            if shape == "helper-writes-back":
                return scope_into_caller(prompt, stage_id=stage_id, replica_id=replica_id)
            raise RuntimeError("needs a real engine")

        def _scope_stage0_multimodal_cache_to_replica(self, request_id, prompt):
            return 0, self._ensure_stage_replica_mm_uuids(prompt, stage_id=0, replica_id=0)

        def _build_add_request_message(self, request_id, prompt, params=None):
            _replica, scoped = self._scope_stage0_multimodal_cache_to_replica(request_id, prompt)
            return Message(prompt=scoped, original_prompt=prompt)

    return Engine


@pytest.fixture
def installed_as(monkeypatch):
    def put(engine: type) -> None:
        monkeypatch.setitem(sys.modules, "vllm_omni.engine.async_omni_engine",
                            types.SimpleNamespace(AsyncOmniEngine=engine))
        monkeypatch.setitem(sys.modules, "vllm_omni.engine.messages",
                            types.SimpleNamespace(StageSubmissionMessage=Message))
    return put


def test_a_scoped_copy_is_upstream_fixed(installed_as):
    engine = _engine("copy")
    installed_as(engine)
    assert uuid_scope.upstream_writes_back(engine) is False
    reason = uuid_scope.install()
    assert isinstance(reason, UpstreamFixed) and "run on a probe" in reason


def test_a_helper_that_still_writes_back_is_patched(installed_as):
    engine = _engine("helper-writes-back")
    installed_as(engine)
    # What the source check alone saw: no write-back line in the method itself.
    assert not uuid_scope._WRITE_BACK.search(inspect.getsource(engine._ensure_stage_replica_mm_uuids))
    assert uuid_scope.upstream_writes_back(engine) is True
    assert uuid_scope.install() is None  # applied: the caller's prompt keeps its own UUIDs
    caller = {uuid_scope.DATA_KEY: {"image": [None]}, uuid_scope.UUIDS_KEY: {"image": ["asset-1"]}}
    msg = engine()._build_add_request_message("r1", caller)
    assert caller[uuid_scope.UUIDS_KEY] == {"image": ["asset-1"]}  # unpatched: stage0:rep0:asset-1
    assert msg.original_prompt is caller


def test_a_scoping_that_cannot_run_on_a_probe_leaves_the_decision_to_the_source(installed_as):
    engine = _engine("needs-a-real-engine")
    installed_as(engine)
    assert uuid_scope.upstream_writes_back(engine) is None
    reason = uuid_scope.install()  # no write-back line in its source: fixed, as the old guard said
    assert isinstance(reason, UpstreamFixed) and "probe" not in reason
    assert contract.UUID_SCOPE == uuid_scope.NAME
