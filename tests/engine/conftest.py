"""Engine tier: the real vllm 0.30.0 / vllm-omni 0.30.0 packages on the CPU.

Fixtures for every engine-tier test module (keep them generic); what they are built from lives in
tests/support/ (engine_env.py, engine_stack.py, tiny_models.py), which tests import directly:

* the process environment every engine test needs (loopback only, offline hub, the plugin
  allow-list), set by importing tests/support/engine_env.py first, before anything imports vLLM;
* `engine_patches`: this project's patches applied once per session through vLLM's real plugin
  loader (engine_env.load_engine_patches), so `OMNISTAGE_DISABLE_PATCHES=name` in the environment of
  the pytest run switches a patch off for the whole run; that is how the negative controls run;
* `shm_ring_name`: one shared-memory ring name per test, unlinked afterwards;
* `tiny_model_dirs` / `make_vllm_config`: real `ModelConfig` / `VllmConfig` objects for a tiny
  multimodal model (Qwen2-VL architecture) and a tiny text-only model (Qwen2). Nothing is mocked:
  the test writes a real Hugging Face checkpoint directory *without weights* (config.json, a
  byte-level BPE tokenizer, the real Qwen2-VL image processor config, a chat template; built by
  tests/support/tiny_models.py), so vLLM's own config, tokenizer, processor and renderer code load
  it exactly as they would a downloaded model. No test here loads weights or runs a forward pass;
* `build_stage0_engine`: engine_stack.stage0_engine_builder, undone after each test.

Every test in this directory gets the `engine` marker; the tier is skipped (with the reason)
only when vllm_omni cannot be imported.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine_env import VLLM_OMNI_IMPORT_ERROR, load_engine_patches  # first: before vLLM
from tests.support.engine_stack import stage0_engine_builder
from tests.support.tiny_models import build_tiny_multimodal_model, build_tiny_text_model

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with the whole session's items: touch only this directory's.
    skip = (
        pytest.mark.skip(
            reason=f"engine tier needs vllm_omni 0.30.0 (hack/setup.sh): {VLLM_OMNI_IMPORT_ERROR}"
        )
        if VLLM_OMNI_IMPORT_ERROR
        else None
    )
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.engine)
            if skip is not None:
                item.add_marker(skip)


# ---- patches through the real plugin path ---------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def engine_patches() -> dict[str, Any]:
    """The patch outcomes, the plugins loaded the way every vLLM process loads them."""
    if VLLM_OMNI_IMPORT_ERROR:
        return {}
    return load_engine_patches()


@pytest.fixture(autouse=True)
def shm_ring_name(monkeypatch: pytest.MonkeyPatch):
    """One SHM ring name per test, unlinked afterwards. vLLM's SHM sender creates the ring under
    the name in the environment and unlinks it only when it is garbage-collected: a sender kept
    alive by a reference cycle made the next test's sender fail with FileExistsError (CI), or
    unlinked a later test's ring of the same name when it was finally collected."""
    name = f"omnistage_test_{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", name)
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


# ---- tiny real models (no weights): tests/support/tiny_models.py ----------------------------
@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if VLLM_OMNI_IMPORT_ERROR:
        pytest.skip(f"engine tier needs vllm_omni: {VLLM_OMNI_IMPORT_ERROR}")
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "multimodal": build_tiny_multimodal_model(root / "tiny-qwen2-vl"),
        "text": build_tiny_text_model(root / "tiny-qwen2"),
    }


@pytest.fixture(scope="session")
def make_vllm_config(tiny_model_dirs: dict[str, Path]):
    """Factory: `make_vllm_config("multimodal" | "text", **model_config_kwargs) -> VllmConfig`.

    Model-config keyword arguments are vLLM's own (e.g. `mm_processor_cache_gb=0`,
    `mm_processor_cache_type="shm"`). The device is the CPU (no accelerator here), and
    `parallel_config` keyword arguments go to vLLM's `ParallelConfig`.
    """
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    def make(kind: str = "multimodal", *, parallel: dict[str, Any] | None = None, **model_kwargs: Any):
        model_kwargs.setdefault("max_model_len", 1024)
        model_kwargs.setdefault("dtype", "float32")
        model_config = ModelConfig(model=str(tiny_model_dirs[kind]), **model_kwargs)
        return VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(**(parallel or {})),
        )

    return make


# ---- a stage-0 engine through vllm-omni's real stage initialisation (engine_stack.py) -----------
@pytest.fixture
def build_stage0_engine(monkeypatch: pytest.MonkeyPatch):
    """Factory fixture around `stage0_engine_builder` (function scope: the stand-in runtime is
    undone after each test)."""
    return stage0_engine_builder(monkeypatch)
