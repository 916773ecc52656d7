"""The membership Secret deleted while no pod needs it is re-created (issue 40 item 11): no watch may see
Secrets (RBAC), so only the resync's full pass notices, once a period. This module's operator gives every
OmniStage a full pass every 20 s instead of 60 (`omnistage run --full-pass-every`), so the wait is a third
as long; test_tamper.py, which counts passes, keeps the default. Stand-in engines, the local control plane."""

from __future__ import annotations

import time

import pytest

from tests.cluster.test_operator import apply, engine_pods, events, get_stage, wait_ready
from tests.cluster.test_tamper import SECRET, _token
from tests.support.status import condition

FULL_PASS_EVERY = 20.0
# A full pass per period; 20 s more for the ticks' own time and a pass behind others on a busy 2-core machine.
SECRET_RESTORE_TIMEOUT = FULL_PASS_EVERY + 20.0

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


@pytest.fixture(scope="module")
def operator_full_pass_every() -> float:
    return FULL_PASS_EVERY


def test_a_deleted_membership_secret_is_re_created_with_no_pod_needing_it(kubectl, wait_for, namespace,
                                                                         operator, tmp_path):
    """At rest no pod is about to mount the Secret (issue 40 item 11): before, nothing re-created it, and an
    operator restarted meanwhile would have made a new token the running head refuses. The resync's full
    pass reads it once a period and re-creates it from the token the operator holds."""
    apply(kubectl, namespace, tmp_path)  # replicas: 2
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    token, _ = _token(kubectl, namespace)
    start = time.monotonic()
    kubectl("delete", "secret", SECRET, "-n", namespace)
    back = wait_for(f"Secret {SECRET} re-created", lambda: _token(kubectl, namespace),
                    timeout=SECRET_RESTORE_TIMEOUT, interval=0.5)
    print(f"[tamper] secret/{SECRET} deleted at rest: re-created in {time.monotonic() - start:.1f}s")
    assert back[0] == token, "re-created with another token than the one the engines hold"
    assert [(r["kind"], r["uid"], r.get("controller")) for r in back[1]] == [
        ("OmniStage", obj["metadata"]["uid"], True)]
    said = wait_for("the operator's Event", lambda: [e["message"] for e in events(kubectl, namespace)
                                                    if e["reason"] == "ChildSynced" and "re-created" in e["message"]
                                                    and SECRET in e["message"]], timeout=10)
    print("[tamper] the operator's Event:", said)
    assert engine_pods(kubectl, namespace) and condition(get_stage(kubectl, namespace), "Ready")["status"] == "True"


