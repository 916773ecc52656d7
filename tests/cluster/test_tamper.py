"""Tampered children come back (issue 27 item 5): each child is edited on the real API server with
kubectl, as someone with edit rights in the namespace would, and the operator must put it back as it
renders it within RESTORE_TIMEOUT; each test prints how long that took.

Issue 40 item 11 adds what was still not seen: Kubernetes' own label and annotation keys on a Service
(service-proxy-name: kube-proxy drops it), a ConfigMap made immutable (replaced: nothing else undoes it) and
the membership Secret deleted while no pod needs it (read on the resync's full pass:
test_membership_secret_at_rest.py). Each restore is counted in the operator's passes too (RESTORE_PASSES).

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
import re
import time
from typing import Any

import pytest

from tests.cluster.test_operator import NAME, apply, engine_pods, events, get_stage, sample, wait_ready
from tests.support.status import condition

RESTORE_TIMEOUT = 20.0
# What a restore may take in passes of the operator (omnistage_reconcile_duration_seconds_count, counted
# when a pass ends): the pass the tamper's watch event queues restores it; by the time a read finds it
# restored, at most one more may have ended besides (the resync's full pass of the period, or the one
# the restore's own write queues). A restore spread over passes (apply now, a patch later) counts more.
RESTORE_PASSES = 2
QUIET = 3.0  # s without a pass: the OmniStage is at rest, a tamper's passes are its own
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


def _passes(operator, namespace: str) -> int:
    """How many passes of the OmniStage the operator has ended (its own count, on /metrics)."""
    text = operator.metrics() or ""
    found = [m for m in re.finditer(r'^omnistage_reconcile_duration_seconds_count\{([^}]*)\} (\S+)$', text,
                                    re.MULTILINE)
             if f'namespace="{namespace}"' in m[1] and f'name="{NAME}"' in m[1]]
    return int(float(found[0][2])) if found else 0


def _settled(wait_for, operator, namespace: str) -> int:
    """The OmniStage's pass count once it has stopped moving for QUIET seconds (the passes of its
    creation, its pods' events, have ended): the passes a tamper costs are counted from there."""
    seen = {"count": -1, "since": 0.0}

    def quiet() -> int | None:
        count, now = _passes(operator, namespace), time.monotonic()
        if count != seen["count"]:
            seen.update(count=count, since=now)
        return count if now - seen["since"] >= QUIET else None

    return wait_for("the OmniStage at rest (no pass for a while)", quiet, timeout=60, interval=0.2)


def _within_passes(operator, namespace: str, before: int, what: str) -> None:
    took = _passes(operator, namespace) - before
    print(f"[tamper] {what}: {took} pass(es) ended from the tamper to the restore")
    assert took <= RESTORE_PASSES, f"{what} took {took} passes to restore"


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
    ("networkpolicy-membership-peer-every-namespace", "networkpolicy", f"{NAME}-head-engine",
     # The membership port's engine peer: those labels from every namespace reach the membership port.
     ["--type=json", "-p", '[{"op":"add","path":"/spec/ingress/1/from/1/namespaceSelector","value":{}}]'],
     lambda o: o["spec"]["ingress"][1]["from"][1].get("namespaceSelector") == {}),
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

    passes, since = _settled(wait_for, operator, namespace), time.monotonic()
    # The patch's own answer is the tampered child (a later read may already find it restored).
    tampered = json.loads(kubectl("patch", kind, name, "-n", namespace, "--field-manager=tamperer", *patch,
                                  "-o", "json").stdout)
    print(f"[tamper] {kind}/{name} as kubectl patch {' '.join(patch)} left it ({time.monotonic() - since:.1f}s):",
          {k: tampered.get(k) for k in before})
    assert landed(tampered), tampered
    _restored(wait_for, f"{kind}/{name}", lambda: _whole(kubectl, namespace, kind, name), before, since)
    _within_passes(operator, namespace, passes, f"{kind}/{name}")
    said = wait_for("the operator's Event saying what it restored", lambda: [
        e["message"] for e in events(kubectl, namespace) if e["reason"] in ("ChildSynced", "ConfigRendered")
        and f"{KINDS[kind]} {name} updated" in e["message"]], timeout=10)
    print("[tamper] the operator's Event:", said)


def test_a_tampered_child_is_restored_while_the_spec_is_invalid(kubectl, wait_for, namespace, operator, tmp_path):
    """A spec the API server takes and the operator refuses (a host directory its administrator did not
    allow: the one rule only the operator can check) rendered nothing, so no child came back while it
    stood: a NetworkPolicy peer given `namespaceSelector: {}` stayed (issue 40 item 11: not restored in
    20 s). The children are kept as the last valid spec rendered them, and the status still says why."""
    policy = f"{NAME}-head-engine"
    apply(kubectl, namespace, tmp_path, sample(**{"gpu.product": "NVIDIA-B200"}))  # no engine starts
    wait_for(f"networkpolicy/{policy}", lambda: kubectl.exists("networkpolicy", policy, "-n", namespace), timeout=60)
    before = _whole(kubectl, namespace, "networkpolicy", policy)
    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type=merge", "-p",
            json.dumps({"spec": {"modelVolume": {"mountPath": "/models", "hostPath": {"path": "/srv/models"}}}}))
    invalid = wait_for("Ready=False reason InvalidSpec", lambda: (c := condition(get_stage(kubectl, namespace), "Ready"))
                       .get("reason") == "InvalidSpec" and c, timeout=RESTORE_TIMEOUT)
    print("[tamper] the spec refused:", invalid["message"][:120])

    passes, since = _settled(wait_for, operator, namespace), time.monotonic()
    kubectl("patch", "networkpolicy", policy, "-n", namespace, "--field-manager=tamperer", "--type=json",
            "-p", '[{"op":"add","path":"/spec/ingress/2/from/0/namespaceSelector","value":{}}]')
    _restored(wait_for, f"networkpolicy/{policy} while the spec is invalid",
              lambda: _whole(kubectl, namespace, "networkpolicy", policy), before, since)
    _within_passes(operator, namespace, passes, f"networkpolicy/{policy} while the spec is invalid")
    assert condition(get_stage(kubectl, namespace), "Ready")["reason"] == "InvalidSpec"


def test_a_spec_invalid_from_its_first_pass_comes_to_rest(kubectl, wait_for, namespace, operator, tmp_path):
    """An OmniStage whose spec the operator refused before any valid spec was seen never rested: the
    resync gave it a full pass every second for as long as it stayed invalid (CI, 2026-12-07: the test
    above timed out waiting for QUIET s without a pass, when its patch came before the valid spec's
    first rest). Its edit and its children's drift are watched; nothing else needs a pass."""
    apply(kubectl, namespace, tmp_path, sample(**{"gpu.product": "NVIDIA-B200", "modelVolume": {
        "mountPath": "/models", "hostPath": {"path": "/srv/models"}}}))
    wait_for("Ready=False reason InvalidSpec", lambda: (c := condition(get_stage(kubectl, namespace), "Ready"))
             .get("reason") == "InvalidSpec" and c, timeout=60)
    passes = _settled(wait_for, operator, namespace)
    time.sleep(2 * QUIET)
    more = _passes(operator, namespace) - passes
    print(f"[tamper] passes of the invalid spec at rest over {2 * QUIET:.0f}s: {more}")
    # At most the resync's one full pass of its period (handlers.FULL_RESYNC_SECONDS, 60 s) falls in
    # the window (a CI run, 2026-12-07, failed this test asserting 0); the old code gave one every second.
    assert more <= 1, f"{more} passes of an invalid spec nothing changed in {2 * QUIET:.0f}s"


# Kubernetes' own label and annotation keys on a Service (issue 40 item 11): kube-proxy drops a Service
# labelled service.kubernetes.io/service-proxy-name (an outage: its ClusterIP answers nothing), and
# topology-mode reroutes it. Before, the operator compared only the labels it renders: others' stayed.
RESERVED = [
    ("service-proxy-name", NAME, "labels", "service.kubernetes.io/service-proxy-name", "nobody"),
    ("master-service-headless", f"{NAME}-master", "labels", "service.kubernetes.io/headless", ""),
    ("topology-mode", NAME, "annotations", "service.kubernetes.io/topology-mode", "Auto"),
]


@pytest.mark.parametrize("service, field, key, value", [r[1:] for r in RESERVED], ids=[r[0] for r in RESERVED])
def test_a_reserved_key_someone_added_to_a_service_is_removed(kubectl, wait_for, namespace, operator, tmp_path,
                                                               service, field, key, value):
    apply(kubectl, namespace, tmp_path, sample(**{"gpu.product": "NVIDIA-B200"}))  # no engine starts
    wait_for(f"service/{service}", lambda: kubectl.exists("service", service, "-n", namespace), timeout=60)
    wait_for("the OmniStage's first status", lambda: (get_stage(kubectl, namespace) or {}).get("status"), timeout=60)

    def meta() -> dict[str, Any]:
        return kubectl.json("get", "service", service, "-n", namespace)["metadata"].get(field) or {}

    kubectl("patch", "service", service, "-n", namespace, "--type=merge",
            "-p", json.dumps({"metadata": {"labels": {"team.example.com/owner": "search"}}}))  # another's: stays
    passes, since = _settled(wait_for, operator, namespace), time.monotonic()
    tampered = json.loads(kubectl("patch", "service", service, "-n", namespace, "--field-manager=tamperer",
                                  "--type=merge", "-p", json.dumps({"metadata": {field: {key: value}}}),
                                  "-o", "json").stdout)
    assert tampered["metadata"][field][key] == value
    _restored(wait_for, f"service/{service} {field} {key}", lambda: key in meta(), False, since)
    _within_passes(operator, namespace, passes, f"service/{service} {key}")
    labels = kubectl.json("get", "service", service, "-n", namespace)["metadata"]["labels"]
    assert labels["team.example.com/owner"] == "search" and labels["app.kubernetes.io/managed-by"] == "omnistage-operator"
    said = wait_for("the operator's Event saying what it removed", lambda: [
        e["message"] for e in events(kubectl, namespace)
        if e["reason"] == "ChildSynced" and f"Service {service} updated" in e["message"] and key in e["message"]],
        timeout=10)
    print("[tamper] the operator's Event:", said)


def test_a_configmap_made_immutable_is_replaced(kubectl, wait_for, namespace, operator, tmp_path):
    """`immutable: true` refuses every later change of the ConfigMap, `immutable` included (issue 40 item
    11): before, the operator did not compare it, and its next config change was refused for good. Now it
    deletes the ConfigMap and creates it again within a pass, says so, and a later config change lands."""
    config = f"{NAME}-config"
    apply(kubectl, namespace, tmp_path, sample(**{"gpu.product": "NVIDIA-B200"}))  # no engine starts
    wait_for(f"configmap/{config}", lambda: kubectl.exists("configmap", config, "-n", namespace), timeout=60)
    wait_for("the OmniStage's first status", lambda: (get_stage(kubectl, namespace) or {}).get("status"), timeout=60)
    before = kubectl.json("get", "configmap", config, "-n", namespace)

    passes, since = _settled(wait_for, operator, namespace), time.monotonic()
    tampered = json.loads(kubectl("patch", "configmap", config, "-n", namespace, "--field-manager=tamperer",
                                  "--type=merge", "-p", '{"immutable":true}', "-o", "json").stdout)
    assert tampered["immutable"] is True

    def replaced() -> bool:
        now = kubectl("get", "configmap", config, "-n", namespace, "-o", "json", check=False)
        if now.returncode != 0:
            return False  # between the delete and the create
        obj = json.loads(now.stdout)
        return obj["metadata"]["uid"] != before["metadata"]["uid"] and not obj.get("immutable") and \
            obj.get("data") == before.get("data")

    _restored(wait_for, f"configmap/{config} immutable", replaced, True, since)
    _within_passes(operator, namespace, passes, f"configmap/{config} immutable")
    said = wait_for("the operator's Event saying it replaced it", lambda: [
        e["message"] for e in events(kubectl, namespace)
        if e["reason"] == "ConfigRendered" and f"ConfigMap {config} replaced" in e["message"]], timeout=10)
    print("[tamper] the operator's Event:", said)
    assert "immutable: true" in said[0] and "deleted it and created it" in said[0]

    start = time.monotonic()
    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type=merge", "-p",
            '{"spec":{"engine":{"maxNumSeqs":32}}}')
    wait_for("the next config change in the ConfigMap", lambda: "max_num_seqs: 32" in json.dumps(
        kubectl.json("get", "configmap", config, "-n", namespace).get("data")), timeout=RESTORE_TIMEOUT)
    print(f"[tamper] a config change after the replace landed in {time.monotonic() - start:.1f}s")


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
