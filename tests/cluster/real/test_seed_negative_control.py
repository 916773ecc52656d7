"""The negative control of the real-engine tier: the plugin's stage-0 fixes switched off, the seed's
failure comes back (issue 17).

The same OmniStage shape as test_real_engines.py (a head and a headless replica, rendered and run
the same way), but its engines run with `OMNISTAGE_DISABLE_PATCHES=frontend_cache,membership`,
set by the runtime's image (a test-only switch: the operator refuses that variable in a spec):
the frontend keeps vLLM's sender cache, and the head routes to every attached replica whether the
operator joined it or not, which is vllm-omni 0.30.0's own behaviour. Then the same new audio three
times and the seed's 64-request load must produce errors, and a replica must log the multimodal
cache miss that causes them. Were these requests all answered, the positive module's assertions
would prove nothing.

The operator still does its part: the engine report shows the sender cache and the disabled patch,
and CacheConsistent is False, so the operator never joins the replica (the engine routes to it
anyway only because the hold is switched off too).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster.real.realstage import (
    CACHE_MISS,
    HEAD_READY_TIMEOUT,
    JOIN_TIMEOUT,
    RealOmniStage,
    count,
    engine_version,
    patches_off,
    tiny_omnistage,
)
from tests.cpu_engine import client
from tests.support.stream import Stream

NAME = "tiny-unpatched"
DISABLED = "frontend_cache,membership"
ATTACHED = "[MembershipController] attached remote replica"
# Marked full: CI runs it in the proof slice "serving" (tests/proofs.py), make test-real here.
pytestmark = [pytest.mark.full, pytest.mark.timeout(HEAD_READY_TIMEOUT + JOIN_TIMEOUT)]


@pytest.fixture(scope="module")
def standin(kubeconfig, kwok_nodes, state_dir, engine_image, real_namespace):
    with patches_off(kubeconfig, state_dir, engine_image, real_namespace, DISABLED) as rt:
        yield rt


@pytest.fixture(scope="module")
def stage(kubectl, operator, standin, real_namespace, wait_for) -> Any:
    s = RealOmniStage(kubectl, standin, real_namespace, NAME, wait_for)
    t0 = time.monotonic()
    s.apply(tiny_omnistage(NAME, replicas=2))
    s.wait_for("the head Ready", lambda: s.head.report() is not None, timeout=HEAD_READY_TIMEOUT, interval=2)
    s.wait_for("the head attached the replica (its own log)",
               lambda: any(ATTACHED in text for text in s.engine_logs("head").values()),
               timeout=JOIN_TIMEOUT, interval=2)
    print(f"\n[real] unpatched head and replica up {time.monotonic() - t0:.0f}s after kubectl apply")
    yield s



def test_report_and_status_tell_the_truth(stage):
    report = stage.report()
    outcomes = {name: p["outcome"] for name, p in report["patches"].items()}
    print(f"[real] unpatched: frontend {report['frontendCache']}, outcomes {outcomes}")
    assert report["frontendCache"]["cacheClass"] == engine_version().sender_cache_class
    assert outcomes["frontend_cache"] == outcomes["membership"] == "disabled"
    cond = {c["type"]: c for c in stage.get()["status"].get("conditions") or []}
    assert cond["CacheConsistent"]["status"] == "False", cond.get("CacheConsistent")
    assert not stage.joined(), "the operator must not join a replica to a head with a sender cache"


def test_seed_000_reproduced_without_the_fix(stage):
    """The same new audio three times: round-robin sends one of them to the replica, which never
    received the tensor the frontend's sender cache omitted."""
    model = client.served_model(stage.base())
    audio = client.body(model, "audio", 7)
    results = [client.chat(stage.base(), audio, f"unpatched audio seed=7 #{i + 1}") for i in range(3)]
    print("\n[real] unpatched: the same new audio three times\n" + client.table(results))
    assert [r.complete for r in results].count(False) >= 1, "the seed's failure did not reproduce"
    failed = [r for r in results if not r.complete]
    # 0.30.0 turns the engine's FinishReason.ERROR into "Stage request failed" (HTTP 500), 0.32 into a
    # retryable 503 (the version table's miss_status); the seed's 0.28-based run answered HTTP 200 with
    # finish_reason "error". Any of them is the failure.
    miss = engine_version().miss_status
    assert all(r.status == miss or r.finish_reason == "error" for r in failed), client.table(failed)
    time.sleep(1)
    misses = sum(count(CACHE_MISS, text) for text in stage.engine_logs().values())
    assert misses >= 1, "no engine logged the multimodal cache miss"


def test_seed_load_64_reproduced_without_the_fix(stage):
    model = client.served_model(stage.base())
    payloads = [(f"unpatched load seed={60 + i % 8} #{i + 1}", client.body(model, "audio", 60 + i % 8))
                for i in range(64)]
    load = Stream(stage.base(), payloads, concurrency=8).run()
    results, errors = load.results, load.lost()
    print(f"\n[real] unpatched: 64 requests at concurrency 8: {len(errors)} errors "
          f"({sorted({(r.status, r.error[:40]) for r in errors})})")
    assert len(results) == 64
    assert errors, "64 repeated-audio requests over two replicas with the sender cache gave no error"
