"""The head's own join check reads the class of the cache its stage-0 frontend holds, and fails closed:
vLLM 0.32 renamed the LRU sender cache (`LruKeyReplicatedSenderCache`, vllm/multimodal/cache/lru.py:22,
was `MultiModalProcessorSenderCache`), and a class the plugin does not know must refuse a join, not
pass as safe (issue 42; docs/engine-versions.md). No vLLM: the renderer is a stand-in holding an
instance of a class of that name."""

from __future__ import annotations

import types

import pytest
from omnistage_engine_patches import contract, report


def _engine_client(cache_class_name: str | None, *, unreadable: bool = False):
    cache = type(cache_class_name, (), {})() if cache_class_name else None

    class Renderer:
        @property
        def mm_processor_cache(self):
            if unreadable:
                raise AttributeError("a renderer of another shape")
            return cache

    engine = types.SimpleNamespace(input_processor=types.SimpleNamespace(renderer=Renderer()))
    return types.SimpleNamespace(engine=engine)


@pytest.mark.parametrize(("cache_class", "mode"), [
    ("MultiModalProcessorOnlyCache", contract.CACHE_PROCESSOR_ONLY),
    ("MultiModalProcessorSenderCache", contract.CACHE_LRU),  # vLLM 0.30
    ("LruKeyReplicatedSenderCache", contract.CACHE_LRU),  # vLLM 0.32
    ("ShmObjectStoreSenderCache", contract.CACHE_SHM),
    ("SomeFutureSenderCache", contract.CACHE_UNKNOWN),
    (None, contract.CACHE_NONE),
])
def test_the_report_names_the_mode_of_each_vllm_cache_class(cache_class, mode):
    assert report.frontend_cache(_engine_client(cache_class))["mode"] == mode


@pytest.mark.parametrize("cache_class", ["MultiModalProcessorSenderCache", "LruKeyReplicatedSenderCache",
                                         "ShmObjectStoreSenderCache"])
def test_a_sender_cache_of_either_vllm_refuses_a_join(cache_class):
    unsafe = report.frontend_cache_unsafe(_engine_client(cache_class))
    assert unsafe is not None and cache_class in unsafe


def test_a_cache_class_the_plugin_does_not_know_refuses_a_join():
    """Fail closed: before, an unknown class (vLLM 0.32's LRU sender) passed as safe."""
    unsafe = report.frontend_cache_unsafe(_engine_client("SomeFutureSenderCache"))
    assert unsafe is not None and "SomeFutureSenderCache" in unsafe and "does not know" in unsafe
    assert "cannot be read" in report.frontend_cache_unsafe(_engine_client("X", unreadable=True))


@pytest.mark.parametrize("cache_class", ["MultiModalProcessorOnlyCache", None])
def test_processor_only_or_no_cache_lets_a_join_through(cache_class):
    assert report.frontend_cache_unsafe(_engine_client(cache_class)) is None


def test_a_head_without_a_frontend_yet_lets_the_operator_decide():
    assert report.frontend_cache_unsafe(types.SimpleNamespace(engine=types.SimpleNamespace())) is None
