"""An OmniStage's engine pods are found by their controller ownerReference, not by label (issue 27
item 5; weakness 6 bullet 4, weakness 7 bullet 1), on the real API server with the stand-in runtime.

- A head or replica whose role label someone removes is still the OmniStage's: the label is written
  back (the head's Service gets its endpoint back), the pod is not replaced and does not leave.
  Before: the pod dropped out of view while it held its GPU, the operator's create got a 409 that
  kube.create swallowed, and the head's Service had no endpoint.
- A pod someone else makes with the head's labels (role=head, newer than the head) is never taken for
  the head: a loopback listener at its address records every Authorization header it is sent, and
  must record none; nor is it deleted. Before: the newest pod labelled role=head was "the head",
  dialled with the bearer token, then deleted by the plan.
- Such a pod holding the head's name before the OmniStage exists: the operator's create is refused
  and says whose pod it is (ReplicaFailure ChildRefused, a CreateRefused Event), instead of taking it.
"""

from __future__ import annotations

import errno
import http.server
import json
import threading
import time
from typing import Any

import pytest

from tests.cluster.test_operator import H200, NAME, apply, engine_pods, events, get_stage, wait_ready
from tests.standin.harness import TESTS_PROBE_HEADS_EVERY, service_addresses
from tests.support.status import condition

RESTORE_TIMEOUT = 20.0
ROLE = "serving.omnistage.io/role"
HEAD = f"{NAME}-head"

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


def _pod(kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    proc = kubectl("get", "pod", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


@pytest.mark.parametrize("role", ["head", "replica"])
def test_a_pod_stripped_of_its_role_label_gets_it_back(kubectl, wait_for, namespace, operator, tmp_path, role):
    apply(kubectl, namespace, tmp_path)  # replicas: 2
    wait_ready(kubectl, wait_for, namespace, 2)
    pod = engine_pods(kubectl, namespace, role=role)[0]
    name, uid, ip = pod["metadata"]["name"], pod["metadata"]["uid"], pod["status"]["podIP"]
    assert role != "head" or service_addresses(kubectl, namespace, NAME) == [ip]

    since = time.monotonic()
    kubectl("label", "pod", name, "-n", namespace, f"{ROLE}-")
    back = wait_for(f"the operator to write {name}'s role label back",
                    lambda: (p := _pod(kubectl, namespace, name)) and (p["metadata"].get("labels") or {}).get(ROLE)
                    and p, timeout=RESTORE_TIMEOUT, interval=0.1)
    print(f"[identity] {role} pod {name}: role label removed, written back after {time.monotonic() - since:.1f}s")
    assert back["metadata"]["labels"][ROLE] == role and back["metadata"]["uid"] == uid, "replaced, not restored"
    if role == "head":
        wait_for(f"Service {NAME}'s endpoint back", lambda: service_addresses(kubectl, namespace, NAME) == [ip],
                 timeout=RESTORE_TIMEOUT, interval=0.2)
        print(f"[identity] Service {NAME} routes to {ip} again after {time.monotonic() - since:.1f}s")
    said = wait_for("the LabelsRestored Event", lambda: [e["message"] for e in events(kubectl, namespace)
                                                         if e["reason"] == "LabelsRestored" and name in e["message"]],
                    timeout=10)
    print("[identity] Event:", said[0])
    gone = [e["message"] for e in events(kubectl, namespace) if e["reason"] in ("Left", "CreateRefused")]
    assert not gone, f"the pod was taken for gone while it ran: {gone}"
    wait_ready(kubectl, wait_for, namespace, 2)
    assert engine_pods(kubectl, namespace, role=role)[0]["metadata"]["uid"] == uid


class Listener:
    """A loopback HTTP listener at a pod's address: records the Authorization header of every request
    (what a look-alike head would be sent) and answers 503."""

    def __init__(self, ip: str, port: int) -> None:
        self.seen: list[tuple[str, str | None]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _answer  # http.server calls them by these names

            def log_message(self, *_) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((ip, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _look_alike(kubectl, namespace: str, tmp_path, name: str, like: dict[str, Any] | None) -> dict[str, Any]:
    """A pod made by someone else (no ownerReference) with the head's labels, scheduled on the GPU nodes
    as the head is. Its Secret volume names a Secret that does not exist, so the stand-in runtime never
    starts a head process at its address: the test's listener takes it."""
    labels = dict((like or {}).get("metadata", {}).get("labels") or {
        "app.kubernetes.io/name": "omnistage", "app.kubernetes.io/instance": NAME,
        "app.kubernetes.io/managed-by": "omnistage-operator", "serving.omnistage.io/omnistage": NAME,
        "serving.omnistage.io/component": "engine", ROLE: "head"})
    spec = {"containers": [{"name": "engine", "image": "look-alike",
                            "ports": [{"name": "membership", "containerPort": 8090}],
                            "volumeMounts": [{"name": "membership-token", "mountPath": "/var/run/omnistage"}]}],
            "volumes": [{"name": "membership-token", "secret": {"secretName": f"{name}-membership"}}],
            "nodeSelector": {"nvidia.com/gpu.product": H200}}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
                                "spec": spec}))
    kubectl("apply", "-n", namespace, "-f", str(path))
    return labels


def _listen_at(kubectl, wait_for, namespace: str, name: str) -> Listener:
    ip = wait_for(f"pod {name}'s address", lambda: ((_pod(kubectl, namespace, name) or {}).get("status") or {})
                  .get("podIP"), timeout=60, interval=0.2)

    def bound() -> Listener | None:
        # kwok hands out a freed IP at once, and an earlier test's head may still be stopping there (a
        # kubelet frees an IP with its sandbox): wait for the address, as the stand-in runtime does.
        try:
            return Listener(ip, 8090)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            return None

    return wait_for(f"{ip}:8090 free for {name}'s listener", bound, timeout=60, interval=0.5)


def test_a_look_alike_head_is_never_sent_the_token(kubectl, wait_for, namespace, operator, tmp_path):
    apply(kubectl, namespace, tmp_path)
    wait_ready(kubectl, wait_for, namespace, 2)
    head = engine_pods(kubectl, namespace, role="head")[0]
    _look_alike(kubectl, namespace, tmp_path, "lookalike", head)
    listener = _listen_at(kubectl, wait_for, namespace, "lookalike")
    try:
        # Passes: a scale (its pods' events) and the resync's, while the look-alike is the newest head.
        kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=3")
        wait_for("the scale to 3 served", lambda: (st := (get_stage(kubectl, namespace) or {}).get("status") or {})
                 .get("readyReplicas") == 3 and st.get("registeredReplicas") == 3, timeout=120, interval=1.0)
        time.sleep(4 * TESTS_PROBE_HEADS_EVERY)  # four more probe periods of the operator
    finally:
        listener.close()
    tokens = [(path, auth) for path, auth in listener.seen if auth]
    print(f"[identity] the look-alike head was sent {len(listener.seen)} requests, {len(tokens)} with a token")
    assert tokens == [], f"the operator sent its bearer token to a pod it did not make: {tokens[:3]}"
    still = _pod(kubectl, namespace, "lookalike")
    assert still is not None and not still["metadata"].get("deletionTimestamp"), "the operator deleted a foreign pod"
    assert engine_pods(kubectl, namespace, role="head")  # the real head still there
    assert _pod(kubectl, namespace, head["metadata"]["name"])["metadata"]["uid"] == head["metadata"]["uid"]


def test_a_foreign_pod_holding_the_head_s_name_is_said_and_not_adopted(kubectl, wait_for, namespace, operator,
                                                                      tmp_path):
    _look_alike(kubectl, namespace, tmp_path, HEAD, None)
    listener = _listen_at(kubectl, wait_for, namespace, HEAD)
    try:
        since = time.monotonic()
        apply(kubectl, namespace, tmp_path)

        def said() -> dict[str, Any] | None:
            c = condition(get_stage(kubectl, namespace), "ReplicaFailure")
            return c if c.get("reason") == "ChildRefused" and HEAD in c.get("message", "") else None
        c = wait_for("ReplicaFailure ChildRefused naming the pod", said, timeout=RESTORE_TIMEOUT, interval=0.2)
        print(f"[identity] foreign pod {HEAD}: said after {time.monotonic() - since:.1f}s: {c['message']}")
        assert "already exists and is not OmniStage" in c["message"] and "it has no controller" in c["message"]
        warned = wait_for("the CreateRefused Event", lambda: [e["message"] for e in events(kubectl, namespace)
                                                              if e["reason"] == "CreateRefused"], timeout=10)
        print("[identity] Event:", warned[0])
        time.sleep(4 * TESTS_PROBE_HEADS_EVERY)  # four probe periods: nothing dials it
    finally:
        listener.close()
    assert [auth for _, auth in listener.seen if auth] == [], "the operator sent its token to a pod it did not make"
    kubectl("delete", "pod", HEAD, "-n", namespace, "--wait=true")
    wait_ready(kubectl, wait_for, namespace, 2)
