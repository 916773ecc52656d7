"""Membership on its own port, with per-pod credentials (issue 27 item 6), on the local control plane
with stand-in engines (the same plugin code as the real head).

A replica pod mounts only its own credential (Secret POD-membership: contract.pod_credential of the
OmniStage's master token and its name), never the master token, which only the head mounts. Its
preStop hook makes it leave with that credential when someone else deletes it; the same credential
cannot make another replica leave, and the head's public port does not answer the membership
routes at all.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import pytest
from omnistage_engine_patches import contract

from tests.cluster.test_operator import NAME, apply, engine_pods, sample, wait_ready
from tests.standin.harness import HeadEndpoint, is_loopback

pytestmark = pytest.mark.usefixtures("operator_log_on_failure")

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback pod IPs, never a proxy


def _secret_token(kubectl, namespace: str, name: str) -> str:
    return base64.b64decode(kubectl.json("get", "secret", name, "-n", namespace)["data"]["token"]).decode()


def _mounted_secrets(pod: dict[str, Any]) -> list[str]:
    return [v["secret"]["secretName"] for v in pod["spec"].get("volumes") or [] if "secret" in v]


def _leave(url: str, token: str, pod: str) -> tuple[int, dict[str, Any]]:
    assert is_loopback(urllib.parse.urlparse(url).hostname or ""), url  # the network rule
    body = json.dumps({"stage": 0, "pod": pod, "drainTimeoutSeconds": 1}).encode()
    req = urllib.request.Request(url + contract.LEAVE_PATH, data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_a_replica_leaves_with_its_own_credential_and_holds_no_master_token(kubectl, wait_for, namespace, operator,
                                                                          standin, tmp_path):
    """Fails on replica pods that mount the master token (NAME-membership), on a head that serves
    membership on its OpenAI port, and on a preStop hook whose credential the head refuses."""
    apply(kubectl, namespace, tmp_path, sample(replicas=3))
    wait_ready(kubectl, wait_for, namespace, 3)
    master = _secret_token(kubectl, namespace, f"{NAME}-membership")
    head = engine_pods(kubectl, namespace, role="head")[0]
    assert _mounted_secrets(head) == [f"{NAME}-membership"]
    replicas = sorted(engine_pods(kubectl, namespace, role="replica"), key=lambda p: p["metadata"]["name"])
    for pod in replicas:
        name = pod["metadata"]["name"]
        assert _mounted_secrets(pod) == [f"{name}-membership"], _mounted_secrets(pod)
        held = _secret_token(kubectl, namespace, f"{name}-membership")
        assert held == contract.pod_credential(master, name) and master not in held
    ip = head["status"]["podIP"]
    membership = f"http://{ip}:{contract.DEFAULT_MEMBERSHIP_PORT}"
    victim, other = (p["metadata"]["name"] for p in replicas)
    # The public port answers no membership route; the victim's credential cannot make another pod leave.
    assert _leave(f"http://{ip}:8000", master, other)[0] == 404
    status, body = _leave(membership, _secret_token(kubectl, namespace, f"{victim}-membership"), other)
    assert (status, body.get("error")) == (403, "Forbidden"), body
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    assert {m["pod"] for m in listing["stages"]["0"] if m.get("pod") and m["state"] == "attached"} == {victim, other}

    # Someone else deletes the victim: its preStop hook leaves the head with the pod's own credential.
    uid = next(p["metadata"]["uid"] for p in replicas if p["metadata"]["name"] == victim)
    kubectl("delete", "pod", victim, "-n", namespace, "--wait=false")
    wait_for("the victim's preStop hook to run", lambda: any(
        e["uid"] == uid and e["action"] == "prestopped" for e in list(standin.events)), timeout=60)
    log = (standin.state_dir / "logs").glob(f"{namespace}_{victim}_{uid[:8]}.log")
    said = "".join(path.read_text(errors="replace") for path in log)
    assert f"prestop: {victim} stage 0: left" in said, said[-2000:]
    assert "refused" not in said, said[-2000:]
    wait_ready(kubectl, wait_for, namespace, 3)
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    assert other in {m["pod"] for m in listing["stages"]["0"] if m["state"] == "attached"}
