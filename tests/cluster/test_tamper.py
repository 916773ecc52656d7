"""Tampered children come back (issue 27 item 5): each child is edited on the real API server with
kubectl, as someone with edit rights in the namespace would, and the operator must put it back as it
renders it within RESTORE_TIMEOUT; each test prints how long that took.

Before, the operator compared children by containment and server-side applied them (one field
manager, forced): a key someone else added stayed (a Service selector with one more key selects
nothing, a NetworkPolicy peer with `namespaceSelector: {}` admits every namespace), and so did a
Service made NodePort. The membership Secret was never re-created after a deletion (every new pod
would wait for it), and a Secret of its name that the OmniStage does not own was adopted.

The children tests use a GPU product no node has: the children are made, no engine starts (cheap).
The Secret tests run engines (the stand-in runtime waits for a pod's Secret as a kubelet would).
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest

from tests.cluster.test_operator import NAME, apply, engine_pods, events, get_stage, sample, wait_ready
from tests.support.status import condition

RESTORE_TIMEOUT = 20.0
SECRET = f"{NAME}-membership"
KINDS = {"service": "Service", "networkpolicy": "NetworkPolicy", "poddisruptionbudget": "PodDisruptionBudget",
         "configmap": "ConfigMap"}

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


def _restored(wait_for, what: str, read, want: Any, since: float) -> float:
    """Seconds from `since` (just before the tamper) until read() returns `want` again, bounded by
    RESTORE_TIMEOUT after the tamper; printed."""
    wait_for(f"the operator to restore {what}", lambda: read() == want, timeout=RESTORE_TIMEOUT, interval=0.1)
    took = time.monotonic() - since
    print(f"[tamper] {what}: restored {took:.1f}s after the tamper began")
    return took


def _whole(kubectl, namespace: str, kind: str, name: str) -> dict[str, Any]:
    """What the operator renders of the child: its spec, or a ConfigMap's data and binaryData."""
    obj = kubectl.json("get", kind, name, "-n", namespace)
    return {k: obj.get(k) for k in (("data", "binaryData") if kind == "configmap" else ("spec",))}


# (id, kind, name, kubectl patch arguments, what the tamper must have changed: a check on the patched child)
TAMPERS = [
    ("service-selector-gains-a-key", "service", NAME,
     ["--type=merge", "-p", '{"spec":{"selector":{"tamper":"selects-nothing"}}}'],
     lambda o: o["spec"]["selector"]["tamper"] == "selects-nothing"),
    ("service-type-nodeport", "service", NAME, ["--type=merge", "-p", '{"spec":{"type":"NodePort"}}'],
     lambda o: o["spec"]["type"] == "NodePort" and o["spec"]["ports"][0].get("nodePort")),
    ("master-service-selector-gains-a-key", "service", f"{NAME}-master",
     ["--type=merge", "-p", '{"spec":{"selector":{"tamper":"selects-nothing"}}}'],
     lambda o: "tamper" in o["spec"]["selector"]),
    ("networkpolicy-podselector-selects-nothing", "networkpolicy", f"{NAME}-head-engine",
     ["--type=merge", "-p", '{"spec":{"podSelector":{"matchLabels":{"tamper":"selects-nothing"}}}}'],
     lambda o: o["spec"]["podSelector"]["matchLabels"]["tamper"] == "selects-nothing"),
    ("networkpolicy-peer-every-namespace", "networkpolicy", f"{NAME}-head-engine",
     # The last rule (the OmniStage's own engine pods, every port): its peer then admits those labels
     # from every namespace.
     ["--type=json", "-p", '[{"op":"add","path":"/spec/ingress/2/from/0/namespaceSelector","value":{}}]'],
     lambda o: o["spec"]["ingress"][2]["from"][0].get("namespaceSelector") == {}),
    ("pdb-selector-gains-a-key", "poddisruptionbudget", f"{NAME}-replicas",
     ["--type=merge", "-p", '{"spec":{"selector":{"matchLabels":{"tamper":"x"}}}}'],
     lambda o: o["spec"]["selector"]["matchLabels"]["tamper"] == "x"),
    ("configmap-gains-a-key", "configmap", f"{NAME}-config", ["--type=merge", "-p", '{"data":{"tamper":"x"}}'],
     lambda o: o["data"]["tamper"] == "x"),
]


@pytest.mark.parametrize("kind, name, patch, landed", [t[1:] for t in TAMPERS], ids=[t[0] for t in TAMPERS])
def test_a_tampered_child_is_restored_exactly(kubectl, wait_for, namespace, operator, tmp_path, kind, name, patch,
                                              landed):
    apply(kubectl, namespace, tmp_path, sample(**{"gpu.product": "NVIDIA-B200"}))  # no engine starts
    wait_for(f"{kind}/{name}", lambda: kubectl.exists(kind, name, "-n", namespace), timeout=60)
    wait_for("the OmniStage's first status", lambda: (get_stage(kubectl, namespace) or {}).get("status"), timeout=60)
    before = _whole(kubectl, namespace, kind, name)

    since = time.monotonic()
    # The patch's own answer is the tampered child (a later read may already find it restored).
    tampered = json.loads(kubectl("patch", kind, name, "-n", namespace, "--field-manager=tamperer", *patch,
                                  "-o", "json").stdout)
    print(f"[tamper] {kind}/{name} as kubectl patch {' '.join(patch)} left it ({time.monotonic() - since:.1f}s):",
          {k: tampered.get(k) for k in before})
    assert landed(tampered), tampered
    _restored(wait_for, f"{kind}/{name}", lambda: _whole(kubectl, namespace, kind, name), before, since)
    said = wait_for("the operator's Event saying what it restored", lambda: [
        e["message"] for e in events(kubectl, namespace) if e["reason"] in ("ChildSynced", "ConfigRendered")
        and f"{KINDS[kind]} {name} updated" in e["message"]], timeout=10)
    print("[tamper] the operator's Event:", said)


def _token(kubectl, namespace: str) -> tuple[str, list[dict[str, Any]]] | None:
    proc = kubectl("get", "secret", SECRET, "-n", namespace, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    obj = json.loads(proc.stdout)
    return base64.b64decode(obj["data"]["token"]).decode(), obj["metadata"].get("ownerReferences") or []


def test_a_deleted_membership_secret_is_re_created_before_a_new_pod_mounts_it(kubectl, wait_for, namespace,
                                                                               operator, tmp_path):
    """RBAC gives the operator no watch on Secrets: it reads the Secret when an engine pod is about to
    mount it (one request), and re-creates it from the token it holds. Running pods keep what their
    kubelet mounted; a new one would wait for the Secret for ever (FailedMount)."""
    apply(kubectl, namespace, tmp_path)  # replicas: 2
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    token, _ = _token(kubectl, namespace)
    kubectl("delete", "secret", SECRET, "-n", namespace)
    assert _token(kubectl, namespace) is None

    start = time.monotonic()
    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=3")  # a new replica pod mounts it
    back = wait_for(f"Secret {SECRET} re-created", lambda: _token(kubectl, namespace), timeout=RESTORE_TIMEOUT,
                    interval=0.2)
    print(f"[tamper] secret/{SECRET} deleted, then a scale-up: re-created in {time.monotonic() - start:.1f}s")
    assert back[0] == token, "re-created with another token than the one the engines hold"
    assert [(r["kind"], r["uid"], r.get("controller")) for r in back[1]] == [
        ("OmniStage", obj["metadata"]["uid"], True)]
    wait_ready(kubectl, wait_for, namespace, 3)  # the new replica mounted it, started and joined


def test_a_membership_secret_the_omnistage_does_not_own_is_refused(kubectl, wait_for, namespace, operator,
                                                                    tmp_path):
    """A Secret of the token's name made by someone else, before the OmniStage: not adopted (its token
    would be the engines'), a condition and an Event say which Secret and what to do, no pod is made;
    once it is deleted the operator makes its own and the OmniStage converges."""
    kubectl("create", "secret", "generic", SECRET, "-n", namespace, "--from-literal=token=planted")
    start = time.monotonic()
    apply(kubectl, namespace, tmp_path)

    def refused() -> dict[str, Any] | None:
        c = condition(get_stage(kubectl, namespace), "MembershipSynced")
        return c if c.get("status") == "False" and SECRET in c.get("message", "") else None

    c = wait_for("MembershipSynced=False naming the Secret", refused, timeout=RESTORE_TIMEOUT, interval=0.2)
    print(f"[tamper] planted secret/{SECRET}: refused in {time.monotonic() - start:.1f}s: {c['message']}")
    assert f"delete Secret {SECRET}" in c["message"] and "another name" in c["message"]
    assert condition(get_stage(kubectl, namespace), "Ready").get("status") == "False"
    warned = wait_for("the Warning Event", lambda: [e for e in events(kubectl, namespace) if e["type"] == "Warning"
                                                   and SECRET in e["message"]], timeout=RESTORE_TIMEOUT)
    print("[tamper] Event:", warned[0]["reason"], warned[0]["message"])
    assert engine_pods(kubectl, namespace) == [], "pods were made that mount a token the operator did not issue"
    assert _token(kubectl, namespace) == ("planted", [])

    start = time.monotonic()
    kubectl("delete", "secret", SECRET, "-n", namespace)
    made = wait_for("the operator's own Secret", lambda: (t := _token(kubectl, namespace)) and t[1] and t,
                    timeout=RESTORE_TIMEOUT, interval=0.2)
    print(f"[tamper] planted secret/{SECRET} deleted: the operator's own made in {time.monotonic() - start:.1f}s")
    assert made[0] != "planted" and made[1][0]["uid"] == get_stage(kubectl, namespace)["metadata"]["uid"]
    wait_ready(kubectl, wait_for, namespace, 2)
