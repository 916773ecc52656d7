"""The test-only CPU platform supplies what vllm-omni's shipped GPU deploy config lacks on the CPU
(issue 29 item 4), so the operator's rendered qwen3_omni_moe config needs no hand-written overrides
here: vLLM's own CompilationConfig and KernelConfig objects, as the CPU platform's
check_and_update_config leaves them, go through cpu_stage_defaults. Real: vLLM 0.30.0's config
classes. Not real: the rest of a VllmConfig (a namespace carrying the two it reads)."""

from __future__ import annotations

from types import SimpleNamespace

from vllm.config import CompilationConfig, KernelConfig

from tests.cpu_engine.cpu_platform.omnistage_cpu_platform.platform import cpu_stage_defaults


def test_an_unset_capture_size_becomes_0_and_triton_moe_becomes_auto():
    config = SimpleNamespace(compilation_config=CompilationConfig(), kernel_config=KernelConfig(moe_backend="triton"))
    config.compilation_config.max_cudagraph_capture_size = None  # what vLLM's CPU platform leaves
    assert cpu_stage_defaults(config) == ["max_cudagraph_capture_size=0", "moe_backend=auto"]
    assert config.compilation_config.max_cudagraph_capture_size == 0
    assert config.kernel_config.moe_backend == "auto"


def test_what_a_config_sets_is_kept():
    config = SimpleNamespace(compilation_config=CompilationConfig(), kernel_config=KernelConfig(moe_backend="auto"))
    config.compilation_config.max_cudagraph_capture_size = 8
    assert cpu_stage_defaults(config) == []
    assert (config.compilation_config.max_cudagraph_capture_size, config.kernel_config.moe_backend) == (8, "auto")
