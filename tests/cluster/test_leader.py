"""Two operator replicas, one leader (issue 10 section 4; operator/omnistage/runtime/leader.py).

Two `omnistage run` processes under the operator's own ServiceAccount (conftest.py
operator_identity), each with the environment the Deployment gives a pod (POD_NAMESPACE, POD_NAME):
exactly one holds the Lease and acts, the other is live and idle. During a scale 2 -> 4 the leader
is SIGKILLed; the other takes the Lease over within the lease time (measured and printed), and the
OmniStage ends Ready with 4 engine pods, no replica index twice, no pod nobody owns, status, pods and
the head's membership in agreement (harness.converged).

The namespace is not t-*: the operator suite's operator and stand-in runtime (test_operator.py, here
or in another session on the same cluster) watch t-* and would act as a third replica. This module
runs its own stand-in runtime for its namespace, as test_rbac.py's namespaced test does.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import re
import time
import uuid
from pathlib import Path

import yaml
from omnistage.runtime import leader

from tests.standin.harness import (
    L_ROLE,
    TESTS_PROBE_HEADS_EVERY,
    HeadEndpoint,
    OperatorProcess,
    converged,
    engine_pods,
    remote_members,
)
from tests.standin.runtime import StandinRuntime

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "omnistage.yaml"
NAME = "qwen3-omni"
GROUP = "serving.omnistage.io"
A_REPLICA_INDEX = f"{GROUP}/replica-index"
LEASE = leader.LEASE_NAME
READY_TIMEOUT = 300
# From SIGKILL the follower may need: LEASE_DURATION of silence from the last renewal its watch
# delivered, the watch's 0.5 s read margin, and, were the watch to fail, one read after RETRY_PERIOD
# (another RETRY_PERIOD spare). 3 s for a loaded 2-core machine. A follower that jumped in before the lease could have expired is a bug
# too: the last renewal was at most RENEW_PERIOD before the kill.
TAKEOVER_MAX = leader.LEASE_DURATION + 2 * leader.RETRY_PERIOD + 3
TAKEOVER_MIN = leader.LEASE_DURATION - leader.RENEW_PERIOD - 0.5


def _sample(replicas: int) -> dict:
    doc = next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "OmniStage")
    doc["spec"]["replicas"] = replicas
    return doc


def _metric(op: OperatorProcess, name: str) -> float:
    """Sum of a metric's samples on the operator's /metrics (0 when absent)."""
    text = op.metrics() or ""
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def _parse(micro: str) -> datetime.datetime:
    return datetime.datetime.strptime(micro, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)


def test_sigkill_the_leader_during_a_scale(kubectl, kubeconfig, wait_for, operator_identity, local_cluster,
                                           tmp_path):
    ident = operator_identity("base")
    home = ident.namespace  # the Lease lives in the operator's namespace (rbac.yaml's Role)
    suffix = uuid.uuid4().hex[:5]
    ns = f"omnistage-lead-{suffix}"
    state = Path("/tmp/omnistage-tests") / f"leader-{time.strftime('%Y%m%d-%H%M%S')}-{suffix}"
    print(f"\n[leader] namespace {ns}, Lease {home}/{LEASE}, logs in {state}")

    def holder() -> str | None:
        proc = kubectl("get", "lease", LEASE, "-n", home, "-o", "json", check=False)
        return json.loads(proc.stdout)["spec"].get("holderIdentity") if proc.returncode == 0 else None

    # A Lease left by an earlier test of this session would hold both replicas back for its duration.
    kubectl("delete", "lease", LEASE, "-n", home, "--ignore-not-found")
    kubectl("create", "namespace", ns)
    ops: dict[str, OperatorProcess] = {}
    try:
        wait_for(f"default ServiceAccount in {ns}", lambda: kubectl(
            "get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0, timeout=60)
        standin = (StandinRuntime(kubeconfig=kubeconfig, namespaces=[ns], state_dir=state / "standin")
                   if local_cluster else contextlib.nullcontext())
        with standin:
            for who in ("a", "b"):
                ident_name = f"omnistage-operator-{who}-{suffix}"  # as the downward API names a pod
                ops[ident_name] = OperatorProcess(ident.kubeconfig, state / f"operator-{who}.log", namespaces=[ns],
                                                  env={**ident.env, "POD_NAMESPACE": home, "POD_NAME": ident_name},
                                                  probe_heads_every=TESTS_PROBE_HEADS_EVERY)
                ops[ident_name].start()
            first = wait_for("one replica to hold the Lease", lambda: holder() in ops and holder(), timeout=60)
            follower = next(n for n in ops if n != first)
            print(f"[leader] leader {first}, follower {follower}")

            kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(_sample(replicas=2)))
            wait_for("the OmniStage Ready with 2 replicas", lambda: converged(kubectl, ns, NAME, 2),
                     timeout=READY_TIMEOUT, interval=1)
            # The follower is live and idle: no reconcile ran in it, it does not claim the Lease.
            lead_count = _metric(ops[first], "omnistage_reconcile_duration_seconds_count")
            idle_count = _metric(ops[follower], "omnistage_reconcile_duration_seconds_count")
            print(f"[leader] reconciles so far: leader {lead_count:.0f}, follower {idle_count:.0f}")
            assert lead_count > 0 and idle_count == 0, (lead_count, idle_count)
            assert _metric(ops[first], "omnistage_operator_leader") == 1
            assert _metric(ops[follower], "omnistage_operator_leader") == 0
            # Readiness says which (runtime/probes.py): both Ready, the leader synced, the follower standing by.
            assert ops[first].readiness() == (200, {"state": "leading and synced", "leading": True, "omnistages": 1})
            assert ops[follower].readiness() == (200, {"state": "standing by", "leading": False, "omnistages": 0})

            # Scale 2 -> 4 and kill the leader as soon as it has started: a replica pod created, not
            # all four registered yet.
            kubectl("scale", "omnistage", NAME, "-n", ns, "--replicas=4")
            def grown() -> list[dict] | None:
                pods = engine_pods(kubectl, ns, NAME, include_terminating=True)
                return pods if len(pods) > 2 else None

            started = wait_for("the leader to create a new replica pod", grown, timeout=60, interval=0.2)
            mid = not converged(kubectl, ns, NAME, 4)
            before = kubectl.json("get", "lease", LEASE, "-n", home)["spec"]
            ops[first].kill()
            killed_at, killed_wall = time.monotonic(), datetime.datetime.now(datetime.UTC)
            print(f"[leader] SIGKILLed {first} with {len(started)} engine pods (mid-scale: {mid}); "
                  f"its last renewal {before['renewTime']}")
            assert mid, "the scale finished before the leader could be killed; the test proved nothing"

            wait_for(f"{follower} to take the Lease", lambda: holder() == follower, timeout=TAKEOVER_MAX + 10,
                     interval=0.1)
            took = time.monotonic() - killed_at
            after = kubectl.json("get", "lease", LEASE, "-n", home)["spec"]
            since_renewal = (_parse(after["acquireTime"]) - _parse(before["renewTime"])).total_seconds()
            print(f"[leader] FAILOVER: {follower} took the Lease {took:.1f} s after the SIGKILL, "
                  f"{since_renewal:.1f} s after the dead leader's last renewal (lease duration "
                  f"{leader.LEASE_DURATION:.0f} s, the follower watches the Lease); "
                  f"transitions {after.get('leaseTransitions')}")
            assert TAKEOVER_MIN <= took <= TAKEOVER_MAX, (took, TAKEOVER_MIN, TAKEOVER_MAX)
            assert since_renewal <= leader.LEASE_DURATION + 2 * leader.RETRY_PERIOD + 1, since_renewal
            assert (killed_wall - _parse(before["renewTime"])).total_seconds() < leader.RENEW_PERIOD + 1

            final = wait_for("the OmniStage Ready with 4 replicas under the new leader",
                             lambda: converged(kubectl, ns, NAME, 4), timeout=READY_TIMEOUT, interval=1)
            converged_after = time.monotonic() - killed_at
            assert ops[follower].readiness()[1]["state"] == "leading and synced"

            # No duplicate, no orphan: exactly the head and three replicas, each index once, each
            # owned by this OmniStage (controller), nothing terminating left behind, and no other pod.
            wait_for("no engine pod terminating", lambda: len(engine_pods(
                kubectl, ns, NAME, include_terminating=True)) == 4, timeout=120, interval=1)
            pods = kubectl.json("get", "pods", "-n", ns)["items"]
            uid = final["metadata"]["uid"]
            owners = {p["metadata"]["name"]: [(r["uid"], r.get("controller")) for r in
                                              p["metadata"].get("ownerReferences") or []] for p in pods}
            print(f"[leader] pods: {sorted(owners)}")
            assert all(o == [(uid, True)] for o in owners.values()), owners
            roles = sorted(p["metadata"]["labels"].get(L_ROLE) for p in pods)
            assert roles == ["head", "replica", "replica", "replica"], roles
            indexes = sorted(int(p["metadata"]["annotations"][A_REPLICA_INDEX]) for p in pods
                             if p["metadata"]["labels"].get(L_ROLE) == "replica")
            assert len(set(indexes)) == 3, f"replica index twice: {indexes}"
            members = remote_members(HeadEndpoint(kubectl, ns, NAME).listing())
            ids = [m.get("replicaId") for m in members]
            assert len(ids) == 3 and len(set(ids)) == 3, f"the head lists {members}"
            print(f"[leader] Ready with 4 after {converged_after:.1f} s from the SIGKILL; replica indexes "
                  f"{indexes}, head members {sorted(ids)}")

            # The killed replica comes back (its pod restarted) as the follower, and stays one.
            ops[first].start()
            time.sleep(leader.RETRY_PERIOD * 3)
            assert holder() == follower
            assert _metric(ops[first], "omnistage_operator_leader") == 0
            assert _metric(ops[first], "omnistage_reconcile_duration_seconds_count") == 0
            for name, op in ops.items():
                denied = op.rbac_denials()
                assert not denied, f"RBAC refused {name}: {sorted(denied)}; see {op.log_path}"
                # A follower that cannot watch falls back to reading every RETRY_PERIOD: correct, but
                # 30 requests a minute instead of none. Its Role grants the watch by name; prove it works.
                failed = [line for line in Path(op.log_path).read_text().splitlines() if "watching Lease" in line]
                assert not failed, f"{name}'s Lease watch failed: {failed[:3]}"
    except BaseException:
        for name, op in ops.items():
            print(f"\n===== {name} ({op.log_path}) =====\n{op.tail(80)}")
        raise
    finally:
        for op in ops.values():
            op.stop()
        kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)
