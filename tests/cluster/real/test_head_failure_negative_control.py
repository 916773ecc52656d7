"""The "before" of issue 39 and the negative control of test_head_failure.py: with the plugin's
`reattach` patch switched off (`OMNISTAGE_DISABLE_PATCHES=reattach`, set by the runtime's image: a
test-only switch, the operator refuses that variable in a spec), the same head SIGKILL under a stream
rolls every replica: new pods, every engine loads its model again, full capacity only after them.

Were the replicas kept here, test_head_failure.py would prove nothing. Real: as there (vLLM 0.30.0 /
vllm-omni 0.30.0 engine cores on the CPU, tiny model, random weights). Marked full, like the module
it controls; runs in CI as part of the "head-failure" slice of tests/proofs.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.real.realstage import (
    HEAD_READY_TIMEOUT,
    JOIN_TIMEOUT,
    RealOmniStage,
    patches_off,
    tiny_omnistage,
)
from tests.cluster.real.test_head_failure import kill_head_under_stream, print_run, replica_state

NAME = "headfail-off"
pytestmark = [pytest.mark.full, pytest.mark.timeout(2 * (HEAD_READY_TIMEOUT + 2 * JOIN_TIMEOUT) + 900)]


@pytest.fixture(scope="module")
def standin(kubeconfig, kwok_nodes, state_dir, engine_image, real_namespace):
    with patches_off(kubeconfig, state_dir, engine_image, real_namespace, "reattach") as rt:
        yield rt


@pytest.fixture(scope="module")
def stage(kubectl, operator, standin, real_namespace, wait_for) -> Any:
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    s.apply(tiny_omnistage(NAME, replicas=3))
    s.wait_serving(3, "the head and its 2 replicas joined", timeout=HEAD_READY_TIMEOUT + 2 * JOIN_TIMEOUT)
    return s


def test_without_the_patch_a_head_process_kill_rolls_every_replica(stage):
    outcomes = {n: p["outcome"] for n, p in stage.report()["patches"].items()}
    assert outcomes["reattach"] == "disabled", outcomes
    before = replica_state(stage)
    run = kill_head_under_stream(stage, replicas=3)
    after = replica_state(stage)
    print_run("head main process SIGKILL, patch reattach off (the old behaviour)", run, before, after)
    assert "full" in run["marks"], f"never back to 3 serving engines: {run['marks']}"
    assert not set(before) & set(after), f"a replica pod outlived the head's restart: {sorted(after)}"
