"""The negative control of the real-engine liveness tests: with the plugin's `engine_liveness` patch
switched off (`OMNISTAGE_DISABLE_PATCHES=engine_liveness`, set by the runtime's image: a test-only
switch, the operator refuses that variable in a spec), the same stall of the head's engine core
kills it for good, as issue 26 found it in `make demo`: vllm-omni 0.30.0's watcher takes the late
engine for a departure and shuts it down, and nothing restarts an in-head engine.

Were the head's engine to serve again here, test_engine_liveness.py's stall test would prove
nothing. Real: as there (vLLM 0.30.0 / vllm-omni 0.30.0 engine cores on the CPU, tiny model, random
weights). One head, no replica: about 3 minutes. Marked full, like the module it controls (CI: the "liveness" slice of tests/proofs.py).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.cluster.real.realstage import HEAD_READY_TIMEOUT, RealOmniStage, patches_off
from tests.cluster.real.test_engine_liveness import STALL_SECONDS, engine_cores, head_pid, liveness_omnistage
from tests.cpu_engine import client
from tests.standin.harness import stage0

NAME = "liveness-off"
pytestmark = [pytest.mark.full, pytest.mark.timeout(HEAD_READY_TIMEOUT + 600)]


@pytest.fixture(scope="module")
def standin(kubeconfig, kwok_nodes, state_dir, engine_image, real_namespace):
    with patches_off(kubeconfig, state_dir, engine_image, real_namespace, "engine_liveness") as rt:
        yield rt


@pytest.fixture(scope="module")
def stage(kubectl, operator, standin, real_namespace, wait_for) -> Any:
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    s.apply(liveness_omnistage(NAME, replicas=1))
    s.wait_for("the head's own engine live", lambda: any(
        m.get("local") and m.get("coordinatorStatus") == "up" for m in stage0(s.head.listing())),
        timeout=HEAD_READY_TIMEOUT, interval=2)
    return s


def test_without_the_patch_a_stall_kills_the_head_s_engine(stage):
    outcomes = {n: p["outcome"] for n, p in stage.report()["patches"].items()}
    assert outcomes["engine_liveness"] == "disabled", outcomes
    cores = engine_cores(head_pid(stage))
    for pid in cores:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(STALL_SECONDS)
    killed = []
    for pid in cores:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:  # upstream's watcher shut the stalled engine down meanwhile
            killed.append(pid)
    time.sleep(15)  # what the patched head needs to serve again (2.5 s measured), with room
    local = next((m for m in stage0(stage.head.listing()) if m.get("local")), {})
    answer = client.chat(stage.base(), client.body(client.served_model(stage.base()), "text", 3, max_tokens=8),
                         "after the stall, unpatched")
    print(f"\n[real] unpatched head after a {STALL_SECONDS}s stall: its engine {local.get('state')}/"
          f"{local.get('coordinatorStatus')}; {answer.line()}; engine core processes killed during the stall: "
          f"{len(killed)} of {len(cores)}")
    assert not answer.complete, "the unpatched head served after the stall: the positive test proves nothing"
    assert local.get("state") != "attached", local
