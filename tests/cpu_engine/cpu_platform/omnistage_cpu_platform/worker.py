"""CPU workers for vllm-omni stages: vLLM's CPUWorker driving vllm-omni's own AR and generation model
runners, with vLLM's CPUModelRunner under them in the MRO for its CPU overrides (tensor post-processing,
device sync, model loading). vllm-omni's XPU platform composes its workers the same way."""

from __future__ import annotations

import torch
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin


class CPUARModelRunner(GPUARModelRunner, CPUModelRunner):
    pass


class CPUGenerationModelRunner(GPUGenerationModelRunner, CPUModelRunner):
    pass


class _CPUOmniWorker(OmniWorkerMixin, CPUWorker):
    # vllm-omni reads `model_runner_cls` off the worker class (omni_connector_validation): keep the name.
    model_runner_cls: type = CPUARModelRunner

    def init_device(self) -> None:
        # CPUWorker.init_device constructs the runner through its module's global CPUModelRunner:
        # point that name at ours for the call.
        self.use_v2_model_runner = False
        shipped = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = self.model_runner_cls
        try:
            super().init_device()
        finally:
            cpu_worker.CPUModelRunner = shipped
        if not isinstance(self.model_runner, self.model_runner_cls) or self.device != torch.device("cpu"):
            raise RuntimeError(f"CPU omni worker built {type(self.model_runner).__name__} on {self.device}")


class CPUARWorker(_CPUOmniWorker):
    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_CPUOmniWorker):
    model_runner_cls = CPUGenerationModelRunner
