"""Patch idle_stats: the stats of the step that empties an engine's scheduler reach the head.

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU): vllm-omni's ``OmniARScheduler`` (the
stage-0 scheduler of every LLM engine core) with stats on, its request queues, vLLM's
``finish_requests`` and ``make_stats``, and vllm-omni's 1 s stats throttle. Stood in: the KV cache
(a config of 64 blocks with no tensors; the scheduler only counts blocks) and the model (no step
executes one: these tests schedule and finish requests, which is all a stats tick reads).

The real-engine proof, the head's ``vllm:num_requests_running`` reading 0 after a stalled engine's
requests were aborted, is in tests/cluster/real/test_engine_liveness.py.

    OMNISTAGE_DISABLE_PATCHES=idle_stats pytest tests/engine/test_idle_stats.py   # the control: 1 fails
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from tests.standin.engine import build_vllm_config
from tests.support.engine_env import patch_applied
from tests.support.tiny_models import build_config_only_model

pytestmark = pytest.mark.engine
BLOCK = 16


def scheduler() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARScheduler

    config = build_vllm_config(build_config_only_model())
    config.cache_config.num_gpu_blocks = 64
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32))])
    return OmniARScheduler(vllm_config=config, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
                           structured_output_manager=StructuredOutputManager(config))


def running(s: Any, n: int) -> list[str]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        s.add_request(Request(request_id=rid, prompt_token_ids=[1, 2, 3, 4], pooling_params=None,
                              sampling_params=SamplingParams(max_tokens=8)))
    s.schedule()
    assert len(s.running) == n
    return ids


def test_the_patch_is_applied():
    assert patch_applied("idle_stats")


def test_regression_the_stats_after_the_last_requests_are_aborted_say_zero():
    """Regression: two requests run (a stats tick says 2), a client gives up on both within the
    throttle's second, and the engine's next stats tick (the one vLLM sends with that step's
    outputs) says 0 running. Upstream throttles it to None, and an idle engine takes no later step:
    the head's gauge would say 2 for as long as the engine stays idle."""
    from vllm.v1.request import RequestStatus

    s = scheduler()
    ids = running(s, 2)
    busy = s.make_stats()
    assert busy is not None and busy.num_running_reqs == 2
    s.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
    idle = s.make_stats()
    assert idle is not None, "the stats of the step that emptied the scheduler were throttled away"
    assert (idle.num_running_reqs, idle.num_waiting_reqs) == (0, 0)


def test_guard_a_busy_engine_is_throttled_as_upstream():
    """Guard (either way): with a request still running, a second tick within the interval is
    dropped as upstream drops it (an idle engine takes no step, so only the emptying one is extra)."""
    from vllm.v1.request import RequestStatus

    s = scheduler()
    ids = running(s, 2)
    t0 = time.monotonic()
    assert s.make_stats() is not None
    s.finish_requests(ids[:1], RequestStatus.FINISHED_ABORTED)
    second = s.make_stats()
    if time.monotonic() - t0 < 1.0:  # vllm-omni's _STATS_INTERVAL_S; a loaded machine may pass it
        assert second is None, "a busy engine's stats were not throttled"
