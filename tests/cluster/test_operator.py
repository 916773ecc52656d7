"""The operator on a real control plane, driven with kubectl the way users drive it (issue 5 item 7).

The operator runs unmodified (`omnistage run` from the venv, as a subprocess). On the local control
plane kwok runs no containers, so tests/standin/runtime.py runs a stand-in engine process on each
engine pod's loopback IP: the head stand-in is the real vllm-omni master server and coordinator with
this project's membership endpoint, replicas register through vllm-omni's own client code. On any
other cluster (OMNISTAGE_USE_EXISTING_CLUSTER=1) the real engine image runs; tests that need to
hard-kill an engine process are skipped there.

Every wait is bounded and prints progress; nothing asserts on timing (bench_membership prints the
figures). Network rule: only loopback is dialled (API server on 127.0.0.1, pod IPs in 127.77/16).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.standin.harness import (
    A_HEAD_UID,
    L_COMPONENT,
    L_OMNISTAGE,
    L_ROLE,
    HeadEndpoint,
    converged,
    left_at_head,
    remote_members,
    replica_series,
    stage0,
)
from tests.standin.harness import (
    engine_pods as _engine_pods,
)
from tests.support.cluster import create_test_namespace
from tests.support.specs import with_spec_changes
from tests.support.status import condition, is_true

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "omnistage.yaml"
NAME = "qwen3-omni"
H200 = "NVIDIA-H200"
GPU = "nvidia.com/gpu"
# Stand-in processes import vllm-omni (seconds to tens of seconds each on a small machine).
READY_TIMEOUT = 300
SETTLE_TIMEOUT = 180


# The operator and the stand-in runtime are conftest.py's module fixtures (`operator`, `standin`), shared
# with test_multistage.py; every test here keeps the operator alive and prints its log on failure.
pytestmark = pytest.mark.usefixtures("operator_log_on_failure")


# ----- helpers -------------------------------------------------------------------------------------

def sample(**changes: Any) -> dict[str, Any]:
    """The committed sample with spec changes (dotted keys: {"gpu.product": "NVIDIA-B200"})."""
    doc = next(d for d in yaml.safe_load_all(SAMPLE.read_text()) if d and d.get("kind") == "OmniStage")
    return with_spec_changes(doc, changes)


def apply(kubectl, namespace: str, tmp_path: Path, doc: dict[str, Any] | None = None, check: bool = True):
    """`kubectl apply -f` of the sample file itself, or of a changed copy written next to the test."""
    path = SAMPLE
    if doc is not None:
        path = tmp_path / "omnistage.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return kubectl("apply", "-n", namespace, "-f", str(path), check=check)


def get_stage(kubectl, namespace: str, name: str = NAME) -> dict[str, Any] | None:
    proc = kubectl("get", "omnistage", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def engine_pods(kubectl, namespace: str, name: str = NAME, role: str | None = None,
                include_terminating: bool = False) -> list[dict[str, Any]]:
    return _engine_pods(kubectl, namespace, name, role, include_terminating)


def names(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


def uids(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["uid"] for p in pods}


def describe(obj: dict[str, Any] | None) -> str:
    """One progress line: counts and the conditions that are not as wanted."""
    if obj is None:
        return "no OmniStage"
    st = obj.get("status") or {}
    conds = " ".join(f"{c['type']}={c['status']}({c.get('reason', '')})" for c in st.get("conditions") or [])
    return (f"replicas={st.get('replicas')} ready={st.get('readyReplicas')} registered={st.get('registeredReplicas')}"
            f" members={[(m.get('pod'), m.get('state')) for m in st.get('members') or []]} {conds}")


def wait_ready(kubectl, wait_for, namespace: str, replicas: int, name: str = NAME,
               timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    """Ready=True for the current generation with `replicas` engine pods running and registered, the
    status and the engine agreeing with the pods that exist now (harness.converged)."""
    last = {"line": ""}

    def check():
        obj = get_stage(kubectl, namespace, name)
        line = describe(obj)
        if line != last["line"]:
            print(f"    {name}: {line}", flush=True)
            last["line"] = line
        return converged(kubectl, namespace, name, replicas) if obj is not None else None

    return wait_for(f"{namespace}/{name} Ready with {replicas} registered replicas", check, timeout=timeout,
                    interval=1.0)


def h200_nodes(kubectl) -> set[str]:
    return {n["metadata"]["name"] for n in
            kubectl.json("get", "nodes", "-l", f"nvidia.com/gpu.product={H200}")["items"]}


def events(kubectl, namespace: str) -> list[dict[str, Any]]:
    return kubectl.json("get", "events", "-n", namespace)["items"]


def wait_left(wait_for, head: HeadEndpoint, member: dict[str, Any]) -> dict[str, Any]:
    """Bounded wait for the head's record of a `leave` for this member (only a leave call makes one:
    a replica the engine dropped by itself, on DOWN or heartbeat timeout, is recorded otherwise)."""
    rec = wait_for(f"the head to record a leave for {member['pod']} (replica {member['replicaId']})",
                   lambda: left_at_head(head.listing(include_all=True), member["replicaId"]), timeout=60)
    answer = head.leave_record(member["replicaId"])  # what the head answered the operator's leave
    print("leave record:", rec, "; the leave's answer:", answer)
    assert answer is not None and answer.get("replicaId") == member["replicaId"] and "drained" in answer, answer
    return rec


class Serving:
    """One OmniStage of `replicas` serving, for the tests that disrupt it and end by waiting until it
    serves as many again: each starts from a serving OmniStage without paying for one more head and
    its replicas (on 2 cores a start costs 10-30 s). `get` hands it over only once it serves; one a
    test left otherwise (it failed) is replaced, so a failure stays in its own test."""

    def __init__(self, kubectl, wait_for, tmp_path: Path, replicas: int):
        self.kubectl, self.wait_for, self.tmp_path, self.replicas = kubectl, wait_for, tmp_path, replicas
        self.namespace: str | None = None

    def get(self) -> str:
        if self.namespace is not None:
            try:
                wait_ready(self.kubectl, self.wait_for, self.namespace, self.replicas, timeout=60)
                print(f"[shared] {self.namespace}/{NAME}: serving {self.replicas}, handed to the next test")
                return self.namespace
            except TimeoutError as err:
                print(f"[shared] {self.namespace}/{NAME} left not serving ({err}); a fresh one")
                self.close()
        self.namespace = create_test_namespace(self.kubectl, "shared-serving")
        apply(self.kubectl, self.namespace, self.tmp_path, sample(replicas=self.replicas))
        wait_ready(self.kubectl, self.wait_for, self.namespace, self.replicas)
        return self.namespace

    def close(self) -> None:
        if self.namespace is not None:
            self.kubectl("delete", "namespace", self.namespace, "--wait=false", "--ignore-not-found")
            self.namespace = None


@pytest.fixture(scope="module")
def serving3(kubectl, wait_for, operator, tmp_path_factory) -> Iterator[Serving]:
    shared = Serving(kubectl, wait_for, tmp_path_factory.mktemp("serving3"), replicas=3)
    yield shared
    shared.close()


# ----- tests ---------------------------------------------------------------------------------------

def test_apply_ready_with_head_and_replicas(kubectl, wait_for, namespace, operator, tmp_path):
    """kubectl apply of the sample -> Ready: one head and N-1 replicas on H200 nodes, processor-only cache,
    every child owned by the OmniStage, and the head's membership listing the replicas."""
    out = apply(kubectl, namespace, tmp_path)
    assert f"omnistage.serving.omnistage.io/{NAME} created" in out.stdout
    n = sample()["spec"]["replicas"]
    obj = wait_ready(kubectl, wait_for, namespace, n)
    st = obj["status"]

    heads = engine_pods(kubectl, namespace, role="head")
    replicas = engine_pods(kubectl, namespace, role="replica")
    assert names(heads) == {f"{NAME}-head"}
    assert len(replicas) == n - 1
    gpu_nodes = h200_nodes(kubectl)
    for pod in heads + replicas:
        assert pod["spec"]["nodeName"] in gpu_nodes, f"{pod['metadata']['name']} is not on an H200 node"
        assert pod["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"

    # Cache: the resolved mode is reported, rendered into the config and given to the head.
    assert st["effectiveCacheMode"] == "processor-only"
    cm = kubectl.json("get", "configmap", f"{NAME}-config", "-n", namespace)
    assert cm["metadata"]["annotations"]["serving.omnistage.io/effective-cache-mode"] == "processor-only"
    head_env = {e["name"]: e.get("value") for e in heads[0]["spec"]["containers"][0]["env"]}
    assert head_env["OMNISTAGE_FRONTEND_CACHE"] == "processor-only"

    # Status: counts, selector (scale subresource), head, members.
    assert st["readyReplicas"] == n and st["updatedReplicas"] == n and st["replicas"] == n
    selected = kubectl.json("get", "pods", "-n", namespace, "-l", st["selector"])["items"]
    assert names(selected) == names(heads + replicas)
    scale = kubectl.json("get", f"omnistage/{NAME}", "-n", namespace, "--subresource=scale")
    assert scale["spec"]["replicas"] == n and scale["status"]["replicas"] == n
    assert scale["status"]["selector"] == st["selector"]
    assert st["head"]["pod"] == f"{NAME}-head" and st["head"]["uid"] == heads[0]["metadata"]["uid"]
    assert st["head"]["ip"] == heads[0]["status"]["podIP"]
    assert {m["pod"] for m in st["members"]} == names(replicas)
    assert all(m["state"] == "Joined" and isinstance(m["replicaId"], int) for m in st["members"])
    for ctype in ("Ready", "HeadReady", "ReplicasAvailable", "MembershipSynced", "CacheConsistent", "ConfigRendered"):
        assert is_true(obj, ctype), condition(obj, ctype)
    # What the engine really built, as the head reported it.
    assert st["engine"]["frontendCacheClass"] == "MultiModalProcessorOnlyCache", st["engine"]
    assert st["engine"]["patches"]["frontend_cache"] == "applied" and st["engine"]["bootId"] == st["head"]["bootId"]
    assert not is_true(obj, "ReplicaFailure")

    # The head's own view: its local replica plus exactly the replica pods, with the ids in status.
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    assert listing is not None, "the head's membership endpoint did not answer"
    print("membership:", json.dumps(listing, indent=1))
    assert listing.get("bootId") == st["head"]["bootId"]
    assert any(m.get("local") for m in stage0(listing)), "the head's own replica is not listed"
    remote = {m.get("pod"): m.get("replicaId") for m in remote_members(listing)}
    assert remote == {m["pod"]: m["replicaId"] for m in st["members"]}

    # Printer columns like an HPA's.
    row = kubectl("get", "omnistage", NAME, "-n", namespace, "--no-headers").stdout.split()
    assert row[:6] == [NAME, str(n), str(n), str(n), "0", "processor-only"], row  # no standby

    # Every child is owned (controller) by the OmniStage, so deleting it removes them.
    uid = obj["metadata"]["uid"]
    children = [("configmap", f"{NAME}-config"), ("secret", f"{NAME}-membership"), ("service", NAME),
                ("service", f"{NAME}-master"), ("networkpolicy", f"{NAME}-head-engine"),
                ("poddisruptionbudget", f"{NAME}-replicas")]
    children += [("pod", p) for p in names(heads + replicas)]
    for kind, child in children:
        refs = kubectl.json("get", kind, child, "-n", namespace)["metadata"].get("ownerReferences") or []
        assert any(r["uid"] == uid and r.get("controller") for r in refs), f"{kind}/{child} not owned: {refs}"


def test_scale_2_4_1_3_membership_and_metrics_follow(kubectl, wait_for, namespace, operator, tmp_path):
    apply(kubectl, namespace, tmp_path)
    wait_ready(kubectl, wait_for, namespace, 2)
    head = HeadEndpoint(kubectl, namespace, NAME)

    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=4")
    obj = wait_ready(kubectl, wait_for, namespace, 4)
    st = obj["status"]
    assert obj["spec"]["replicas"] == 4, "the operator must never rewrite spec.replicas"
    replicas = engine_pods(kubectl, namespace, role="replica")
    assert len(replicas) == 3 and len({p["metadata"]["name"] for p in replicas}) == 3
    assert {m["pod"] for m in st["members"]} == names(replicas)
    assert all(m["state"] == "Joined" for m in st["members"])
    listing = wait_for("the head to list 3 replicas", lambda: (
        (lst := head.listing()) is not None and len(remote_members(lst)) == 3 and lst), timeout=60)
    ids = {str(m["replicaId"]) for m in remote_members(listing)}
    assert {m.get("pod") for m in remote_members(listing)} == names(replicas)
    # Metric series exist from the join on, before any traffic (DESIGN.md section 5).
    series = wait_for("a metric series on the head for each joined replica",
                      lambda: (s := replica_series(head.metrics())) >= ids and s, timeout=60)
    print("replica series at 4:", sorted(series))

    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=1")
    obj = wait_ready(kubectl, wait_for, namespace, 1)
    assert obj["spec"]["replicas"] == 1
    assert engine_pods(kubectl, namespace, role="replica") == []
    assert obj["status"]["members"] in ([], None) or all(m["state"] == "Left" for m in obj["status"]["members"])
    listing = wait_for("the head to list no replica", lambda: (
        (lst := head.listing()) is not None and remote_members(lst) == [] and lst), timeout=60)
    assert any(m.get("local") for m in stage0(listing))
    series = wait_for("the departed replicas' metric series to be gone",
                      lambda: (s := replica_series(head.metrics())).isdisjoint(ids) and (s or {"none"}),
                      timeout=60)
    print("replica series at 1:", sorted(series))
    # An Event for each replica that was told to leave.
    messages = " ".join(e.get("message", "") for e in events(kubectl, namespace))
    for pod in names(replicas):
        assert pod in messages, f"no Event mentions {pod}"

    # Back up: the new pods may carry the names of replicas that left (the head remembers those
    # leaves); they must join as new replicas with new ids, not be mistaken for the departed ones.
    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=3")
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    rejoined = {m["pod"]: m["replicaId"] for m in obj["status"]["members"]}
    assert len(rejoined) == 2 and all(m["state"] == "Joined" for m in obj["status"]["members"])
    assert not {str(i) for i in rejoined.values()} & ids, f"replica ids reused: {rejoined} vs {ids}"
    listing = head.listing()
    assert {m.get("pod"): m.get("replicaId") for m in remote_members(listing)} == rejoined


def test_replica_pod_deleted_leave_and_replacement(kubectl, wait_for, serving3, operator, standin):
    namespace = serving3.get()
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    head = HeadEndpoint(kubectl, namespace, NAME)
    victim = min(obj["status"]["members"], key=lambda m: m["pod"])
    victim_uid = kubectl.json("get", "pod", victim["pod"], "-n", namespace)["metadata"]["uid"]
    print(f"deleting {victim['pod']} (replica id {victim['replicaId']})")

    kubectl("delete", "pod", victim["pod"], "-n", namespace, "--wait=false")
    # A graceful delete races two paths: the operator's `leave` (it sees the pod go) and the replica's
    # own DOWN on SIGTERM. Either detaches it at once; what must not happen is waiting for the 30 s
    # heartbeat timeout or keeping it routed. (The hard-kill test below has no DOWN: leave only.)
    rec = wait_for(f"the head to stop routing to replica {victim['replicaId']}", lambda: next(
        (m for m in stage0(head.listing(include_all=True)) if m.get("replicaId") == victim["replicaId"]
         and str(m.get("state")).lower() in ("left", "detached")), None), timeout=60)
    print(f"replica {victim['replicaId']} at the head: state={rec.get('state')} "
          f"({'operator leave' if rec.get('state') == 'left' else 'its own DOWN came first'})")

    obj = wait_ready(kubectl, wait_for, namespace, 3)
    replicas = engine_pods(kubectl, namespace, role="replica")
    assert victim_uid not in uids(replicas), "the deleted pod is still counted"
    assert len(replicas) == 2 and all(m["state"] == "Joined" for m in obj["status"]["members"])
    listing = head.listing()
    assert {m.get("pod") for m in remote_members(listing)} == names(replicas)
    assert victim["replicaId"] not in {m.get("replicaId") for m in remote_members(listing)}


def test_replica_hard_killed_leave_before_heartbeat_timeout(kubectl, wait_for, serving3, operator, standin):
    """kill -9 of a replica engine: no DOWN reaches the head; the operator's leave must detach it (the engine
    alone would wait out its 30 s heartbeat timeout) and the Failed pod is replaced."""
    if standin is None:
        pytest.skip("needs the stand-in runtime to kill an engine process")
    namespace = serving3.get()
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    victim = max(obj["status"]["members"], key=lambda m: m["pod"])
    victim_uid = kubectl.json("get", "pod", victim["pod"], "-n", namespace)["metadata"]["uid"]

    standin.kill(namespace, victim["pod"])
    killed_at = time.monotonic()
    wait_left(wait_for, HeadEndpoint(kubectl, namespace, NAME), victim)
    # Printed, not asserted (timing goals are benchmarks): well under the engine's 30 s heartbeat timeout.
    print(f"leave recorded {time.monotonic() - killed_at:.1f}s after the kill")
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    replicas = engine_pods(kubectl, namespace, role="replica", include_terminating=True)
    assert victim_uid not in uids(replicas), "the Failed pod was not replaced"
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    assert victim["replicaId"] not in {m.get("replicaId") for m in remote_members(listing)}


def _rolled(kubectl, wait_for, namespace: str, old_replica_uids: set[str], old_boot: str) -> dict[str, Any]:
    """Every replica re-created for the current head, membership replayed to the new engine."""
    head = HeadEndpoint(kubectl, namespace, NAME)

    def check():
        obj = get_stage(kubectl, namespace)
        st = (obj or {}).get("status") or {}
        heads = engine_pods(kubectl, namespace, role="head")
        replicas = engine_pods(kubectl, namespace, role="replica")
        if not heads or not st.get("head") or st["head"].get("bootId") in (None, old_boot):
            return None
        new_head_uid = heads[0]["metadata"]["uid"]
        if uids(replicas) & old_replica_uids or any(
                (p["metadata"].get("annotations") or {}).get(A_HEAD_UID) != new_head_uid for p in replicas):
            return None
        listing = head.listing()
        if listing is None or listing.get("bootId") != st["head"]["bootId"]:
            return None
        if {m.get("pod") for m in remote_members(listing)} != names(replicas):
            return None
        return obj

    return wait_for("replicas rolled and membership replayed to the new head", check, timeout=READY_TIMEOUT,
                    interval=1.0)


def test_head_pod_deleted_replicas_rolled_membership_replayed(kubectl, wait_for, serving3, operator):
    namespace = serving3.get()
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    old_head = obj["status"]["head"]
    old_replicas = uids(engine_pods(kubectl, namespace, role="replica"))
    restarts_before = [e for e in events(kubectl, namespace) if e["reason"] == "HeadRestarted"]

    kubectl("delete", "pod", f"{NAME}-head", "-n", namespace, "--wait=false")
    _rolled(kubectl, wait_for, namespace, old_replicas, old_head["bootId"])
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    assert obj["status"]["head"]["uid"] != old_head["uid"]
    assert obj["status"]["head"]["bootId"] != old_head["bootId"]
    assert len(engine_pods(kubectl, namespace, role="replica")) == 2
    # Rolled once, for the new head: a replaced pod is not an engine restart of the new one.
    assert [e for e in events(kubectl, namespace) if e["reason"] == "HeadRestarted"] == restarts_before


def test_head_engine_restarted_in_place_replicas_rolled(kubectl, wait_for, serving3, operator, standin):
    """The head container restarts (same pod, new boot id): replicas never re-register with a new head,
    so the operator must roll every replica and replay membership."""
    if standin is None:
        pytest.skip("needs the stand-in runtime to kill the head engine process")
    namespace = serving3.get()
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    old_head = obj["status"]["head"]
    old_replicas = uids(engine_pods(kubectl, namespace, role="replica"))

    standin.kill(namespace, f"{NAME}-head")
    _rolled(kubectl, wait_for, namespace, old_replicas, old_head["bootId"])
    obj = wait_ready(kubectl, wait_for, namespace, 3)
    assert obj["status"]["head"]["uid"] == old_head["uid"], "the head pod itself should have stayed"
    assert obj["status"]["head"]["bootId"] != old_head["bootId"]


def test_no_gpu_product_replica_failure(kubectl, wait_for, namespace, operator, tmp_path):
    """gpu.product that no node has: nothing schedules; ReplicaFailure carries the scheduler's message."""
    apply(kubectl, namespace, tmp_path, sample(**{"gpu.product": "NVIDIA-B200"}))

    def failure():
        obj = get_stage(kubectl, namespace)
        c = condition(obj, "ReplicaFailure")
        return c if c.get("status") == "True" else None

    cond = wait_for("ReplicaFailure=True", failure, timeout=120)
    print("ReplicaFailure:", cond)
    pods = engine_pods(kubectl, namespace)
    assert pods and all(not p["spec"].get("nodeName") for p in pods)
    scheduler_messages = [c.get("message", "") for p in pods for c in (p.get("status") or {}).get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "False"]
    assert scheduler_messages, "the scheduler has not reported on the pods"
    assert "nodes are available" in cond["message"], cond
    assert not is_true(get_stage(kubectl, namespace), "Ready")


def test_a_refusal_repeated_every_pass_is_aggregated_into_few_events(kubectl, wait_for, namespace, operator,
                                                                     tmp_path):
    """A quota that admits the head only: every pass (every few seconds while the OmniStage is not at
    rest) is refused the replica pod again. One Event per pass before; now (runtime/events.py) an Event
    only when the count reaches the next power of two, each carrying the running count and the
    series' first timestamp, as client-go's correlator would count them."""
    kubectl("create", "quota", "one-pod", "--hard=pods=1", "-n", namespace)
    # Until the quota controller has counted the namespace, admission refuses every pod, the head too.
    wait_for("the quota counted", lambda: (kubectl.json("get", "resourcequota", "one-pod", "-n", namespace)
                                           .get("status") or {}).get("used"), timeout=60)
    apply(kubectl, namespace, tmp_path)  # replicas: 2

    def refused() -> list[dict[str, Any]] | None:
        evs = [e for e in events(kubectl, namespace) if e["reason"] == "CreateRefused"
               and f"{NAME}-replica-1" in e["message"]]
        return evs if max((e.get("count") or 1 for e in evs), default=0) >= 8 else None

    evs = wait_for("the replica pod refused 8 times", refused, timeout=SETTLE_TIMEOUT, interval=2)
    counts = sorted(e.get("count") or 1 for e in evs)
    print("CreateRefused Events (count, message):", [(e.get("count"), e["message"]) for e in evs])
    assert counts == [2 ** i for i in range(len(counts))], counts
    assert len({e["message"] for e in evs}) == 1 and len({e["firstTimestamp"] for e in evs}) == 1, evs
    assert "exceeded quota" in evs[0]["message"]


def _gpu_pods_elsewhere(kubectl, namespace: str) -> list[str]:
    pods = kubectl.json("get", "pods", "-A", "-l", f"{L_COMPONENT}=engine")["items"]
    return [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in pods
            if p["metadata"]["namespace"] != namespace and p["spec"].get("nodeName")]


def test_no_h200_capacity_replica_failure_then_unscheduled_victim(kubectl, wait_for, namespace, operator, tmp_path,
                                                                  kwok_nodes, serving3):
    """Eight GPUs per engine pod on two 8-GPU H200 nodes: the third pod cannot be placed. ReplicaFailure says
    so with the scheduler's reason; scaling down removes the unscheduled replica first."""
    if not kwok_nodes:
        pytest.skip("fills every GPU: only on simulated nodes")
    gpus = {n["metadata"]["name"]: int(n["status"]["allocatable"].get(GPU, "0")) for n in
            kubectl.json("get", "nodes", "-l", f"nvidia.com/gpu.product={H200}")["items"]}
    if sorted(gpus.values()) != [8, 8]:
        pytest.skip(f"sized for two 8-GPU H200 nodes, found {gpus}")
    # Earlier tests' namespaces are deleted asynchronously, the shared OmniStage's too; their pods would hold GPUs.
    serving3.close()
    wait_for("no engine pods of other tests on the nodes", lambda: not _gpu_pods_elsewhere(kubectl, namespace),
             timeout=120)
    apply(kubectl, namespace, tmp_path, sample(replicas=3, **{"gpu.count": 8}))

    def one_pending():
        obj = get_stage(kubectl, namespace)
        pods = engine_pods(kubectl, namespace)
        pending = [p for p in pods if not p["spec"].get("nodeName")]
        c = condition(obj, "ReplicaFailure")
        if len(pods) == 3 and len(pending) == 1 and c.get("status") == "True":
            return pending[0], c
        return None

    pending, cond = wait_for("one engine pod unschedulable and ReplicaFailure=True", one_pending, timeout=READY_TIMEOUT)
    print("ReplicaFailure:", cond)
    assert pending["metadata"]["labels"][L_ROLE] == "replica"
    assert f"Insufficient {GPU}" in cond["message"], cond
    assert pending["metadata"]["name"] in cond["message"], cond

    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=2")
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    assert pending["metadata"]["uid"] not in uids(engine_pods(kubectl, namespace, include_terminating=True))
    assert not is_true(obj, "ReplicaFailure")


def test_invalid_spec_rejected_by_api_server(kubectl, namespace, operator, tmp_path):
    proc = apply(kubectl, namespace, tmp_path, sample(replicas=2, **{"cache.mode": "lru"}), check=False)
    assert proc.returncode != 0
    assert "spec.cache.mode" in proc.stderr, proc.stderr
    assert kubectl("get", "omnistage", "-n", namespace, "-o", "name").stdout.strip() == ""


def test_spec_only_the_operator_rejects_is_invalidspec_and_deletes_nothing(kubectl, wait_for, namespace, operator,
                                                                           tmp_path):
    """What CEL cannot check (stageOverrides is free-form) the operator checks: Ready=False InvalidSpec,
    running pods untouched; fixing the spec brings it back without a restart."""
    from omnistage.api.validation import InvalidSpec, validate_omnistage

    bad = {"mm_processor_cache_type": "lru"}
    # The operator must refuse it: accepting it is the defect this test is for, never a reason to skip.
    with pytest.raises(InvalidSpec):
        validate_omnistage(sample(**{"engine.stageOverrides": bad}) | {"metadata": {"name": NAME}})

    apply(kubectl, namespace, tmp_path)
    wait_ready(kubectl, wait_for, namespace, 2)
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)}

    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"engine": {"stageOverrides": bad}}}))

    def invalid():
        obj = get_stage(kubectl, namespace)
        c = condition(obj, "Ready")
        return c if c.get("status") == "False" and c.get("reason") == "InvalidSpec" else None

    cond = wait_for("Ready=False reason InvalidSpec", invalid, timeout=60)
    print("Ready:", cond)
    assert "stageOverrides" in cond["message"] and "mm_processor_cache_type" in cond["message"], cond
    assert any(e.get("reason") in ("InvalidSpec", "Rejected") or "stageOverrides" in e.get("message", "")
               for e in events(kubectl, namespace)), "no Event tells the user why"
    # Several resync periods: nothing may be deleted or re-created meanwhile.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)}
        assert now == before, f"a bad spec changed the pods: {before} -> {now}"
        time.sleep(1)
    for kind, child in (("configmap", f"{NAME}-config"), ("secret", f"{NAME}-membership"), ("service", NAME)):
        kubectl("get", kind, child, "-n", namespace)

    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type=json",
            "-p", json.dumps([{"op": "remove", "path": "/spec/engine/stageOverrides/mm_processor_cache_type"}]))
    wait_ready(kubectl, wait_for, namespace, 2)
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)} == before


def test_operator_killed_mid_scale_converges_without_duplicates_or_orphans(kubectl, wait_for, namespace, operator,
                                                                           tmp_path):
    apply(kubectl, namespace, tmp_path)
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    uid = obj["metadata"]["uid"]

    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=4")
    # Kill it while it works: as soon as the first new replica pod exists (or after a bound).
    wait_for("the first new replica pod", lambda: len(engine_pods(kubectl, namespace, include_terminating=True)) > 2,
             timeout=60, interval=0.1)
    operator.kill()
    # While it is down an autoscaler writes the scale subresource again.
    kubectl("scale", "omnistage", NAME, "-n", namespace, "--replicas=3")
    operator.start()

    obj = wait_ready(kubectl, wait_for, namespace, 3)
    wait_for("no terminating engine pods left", lambda: len(engine_pods(kubectl, namespace, include_terminating=True))
             == 3, timeout=SETTLE_TIMEOUT)
    pods = engine_pods(kubectl, namespace, include_terminating=True)
    replicas = [p for p in pods if p["metadata"]["labels"][L_ROLE] == "replica"]
    indexes = [p["metadata"]["annotations"]["serving.omnistage.io/replica-index"] for p in replicas]
    assert len(set(indexes)) == len(indexes) == 2, f"duplicate replica indexes {indexes}"
    # No orphan: every pod of this OmniStage is owned by it, and there is no other engine pod in the namespace.
    everything = kubectl.json("get", "pods", "-n", namespace)["items"]
    assert names(everything) == names(pods), f"unexpected pods {names(everything) - names(pods)}"
    for p in pods:
        assert any(r["uid"] == uid and r.get("controller") for r in p["metadata"].get("ownerReferences") or [])
    members = obj["status"]["members"]
    assert sorted(m["pod"] for m in members) == sorted(names(replicas))
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    remote = [m.get("pod") for m in remote_members(listing)]
    assert sorted(remote) == sorted(names(replicas)), f"stale or duplicate members at the head: {remote}"


def test_delete_omnistage_removes_every_child(kubectl, wait_for, namespace, operator, standin, tmp_path):
    apply(kubectl, namespace, tmp_path)
    wait_ready(kubectl, wait_for, namespace, 2)

    kubectl("delete", "omnistage", NAME, "-n", namespace, "--timeout=120s", timeout=150)
    sel = f"{L_OMNISTAGE}={NAME}"

    def leftovers():
        found = kubectl("get", "pods,services,configmaps,secrets,networkpolicies,poddisruptionbudgets", "-n", namespace, "-l", sel,
                        "-o", "name").stdout.split()
        return found

    wait_for("the controller manager to garbage-collect every child", lambda: not leftovers(),
             timeout=SETTLE_TIMEOUT)
    if standin is not None:
        wait_for("every stand-in engine of the namespace stopped", lambda: not any(
            ns == namespace for ns, _ in standin.processes()), timeout=60)
    # The operator forgets it (memory.forget, metric series included) from its own watch's DELETED
    # event and the last pass, which finds it gone: kopf has no handler for that any more.
    series = f'namespace="{namespace}",name="{NAME}"'
    wait_for("the deleted OmniStage's metric series removed", lambda: series not in (operator.metrics() or series),
             timeout=60)




def test_head_with_a_sender_cache_holds_ready_false_and_joins_nobody(kubectl, wait_for, namespace, operator, standin,
                                                                     tmp_path):
    """The cache guarantee is checked on the live engine. A head whose stage-0 frontend built a sender
    cache (here the stand-in plays an engine image whose frontend patch did not take effect) gets
    CacheConsistent=False CacheMismatch, Ready=False and a Warning Event; its replica pod runs and
    registers but is never joined (so the head keeps it unroutable); nothing is deleted. Fixing the
    image (here: removing the stand-in knob) rolls the head, and the replica joins."""
    if standin is None:
        pytest.skip("needs the stand-in head to play a drifted engine image")
    from tests.standin.engine import FRONTEND_KNOB

    knob = [{"name": FRONTEND_KNOB, "value": "lru"}]
    apply(kubectl, namespace, tmp_path, sample(**{"engine.env": knob}))
    head = HeadEndpoint(kubectl, namespace, NAME)

    def held():
        obj = get_stage(kubectl, namespace)
        cache = condition(obj, "CacheConsistent")
        members = (obj or {}).get("status", {}).get("members") or []
        listing = head.listing()
        registered = [m for m in remote_members(listing or {}) if m.get("state") in ("attached", "registered")]
        if cache.get("reason") == "CacheMismatch" and members and members[0].get("state") == "Joining" \
                and registered:
            return obj, listing
        print("    waiting:", describe(obj), "| at head:", [(m.get("replicaId"), m.get("state"), m.get("pod"))
                                                          for m in remote_members(listing or {})], flush=True)
        return None

    obj, listing = wait_for("CacheConsistent=False CacheMismatch with the replica registered but not joined", held,
                            timeout=READY_TIMEOUT, interval=2)
    st = obj["status"]
    cache = condition(obj, "CacheConsistent")
    print("CacheConsistent:", cache)
    assert cache["status"] == "False" and "MultiModalProcessorSenderCache" in cache["message"], cache
    assert not is_true(obj, "Ready") and "CacheConsistent" in condition(obj, "Ready")["message"]
    assert st["engine"]["frontendCacheClass"] == "MultiModalProcessorSenderCache"
    assert st["engine"]["frontendCacheMode"] == "lru" and st["effectiveCacheMode"] == "processor-only"
    assert st["members"][0]["reason"] == "CacheConsistent: CacheMismatch", st["members"]
    assert all(m.get("pod") is None for m in remote_members(listing)), "a replica was joined to a sender-cache head"
    warnings = [e for e in events(kubectl, namespace) if e.get("reason") == "CacheMismatch"]
    assert warnings and warnings[0]["type"] == "Warning", "no Warning Event tells the user"
    assert "vllm-omni 0.30.0" in warnings[0]["message"], warnings[0]["message"]

    # Held, not torn down: several resync periods later nothing was joined, deleted or re-created.
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)}
    deadline = time.monotonic() + 12
    while time.monotonic() < deadline:
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in engine_pods(kubectl, namespace)} == before
        assert all(m.get("pod") is None for m in remote_members(head.listing() or {}))
        time.sleep(2)

    kubectl("patch", "omnistage", NAME, "-n", namespace, "--type=json",
            "-p", json.dumps([{"op": "remove", "path": "/spec/engine/env"}]))
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    cache = condition(obj, "CacheConsistent")
    assert cache["status"] == "True" and cache["reason"] == "Consistent", cache
    assert obj["status"]["engine"]["frontendCacheClass"] == "MultiModalProcessorOnlyCache"
    assert all(m["state"] == "Joined" for m in obj["status"]["members"])


def test_pod_template_reaches_engine_pods_and_a_change_rolls_them(kubectl, wait_for, namespace, operator, tmp_path):
    """spec.template is merged into every engine pod (Kubernetes strategic merge): resources, an env var
    from a Secret and a label arrive, the operator's GPU limit, command and membership stay, the pods
    become Ready and join. Changing the template rolls the head (and so every replica), like any change."""
    kubectl("create", "secret", "generic", "hf-token", "-n", namespace, "--from-literal=token=hf_not_a_real_token")
    token_env = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    template = {"metadata": {"labels": {"team": "multimodal"}},
                "spec": {"containers": [{"name": "engine", "env": [token_env],
                                         "resources": {"requests": {"cpu": "2", "memory": "6Gi"}}}]}}
    apply(kubectl, namespace, tmp_path, sample(template=template))
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    assert all(m["state"] == "Joined" for m in obj["status"]["members"])
    pods = engine_pods(kubectl, namespace)
    assert len(pods) == 2
    for pod in pods:
        assert pod["metadata"]["labels"]["team"] == "multimodal"
        assert pod["metadata"]["labels"][L_COMPONENT] == "engine", "the operator's labels stay"
        container = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        # (the API server copies the GPU limit into requests, as for any extended resource; without
        # spec.modelVolume the operator requests the weights' download volume as ephemeral storage)
        assert container["resources"]["limits"] == {GPU: "1"}
        assert container["resources"]["requests"] == {"cpu": "2", "memory": "6Gi", GPU: "1",
                                                      "ephemeral-storage": "100Gi"}
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_TOKEN"] == token_env and "POD_IP" in env
        assert container["command"] == ["vllm"]
    head = engine_pods(kubectl, namespace, role="head")[0]
    old_head, old_replicas = head["metadata"]["uid"], uids(engine_pods(kubectl, namespace, role="replica"))

    template["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "3"
    apply(kubectl, namespace, tmp_path, sample(template=template))

    def rolled():
        heads = engine_pods(kubectl, namespace, role="head")
        replicas = engine_pods(kubectl, namespace, role="replica")
        if not heads or heads[0]["metadata"]["uid"] == old_head or uids(replicas) & old_replicas:
            return None
        return heads[0]

    head = wait_for("the template change to roll the head and its replica", rolled, timeout=READY_TIMEOUT,
                    interval=1.0)
    obj = wait_ready(kubectl, wait_for, namespace, 2)
    assert obj["status"]["updatedReplicas"] == 2
    for pod in engine_pods(kubectl, namespace):
        container = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
        assert container["resources"]["requests"]["cpu"] == "3" and pod["metadata"]["labels"]["team"] == "multimodal"


def test_replica_aware_mode_rendered_reported_and_in_status(kubectl, wait_for, namespace, operator, tmp_path):
    """cache.mode replica-aware (opt-in, issue 11): allowed with dynamic membership; the operator renders
    it (ConfigMap annotation, the head's OMNISTAGE_FRONTEND_CACHE), the head reports it (its frontend runs
    the replica_aware_cache dispatch on MultiModalProcessorOnlyCache), and CacheConsistent, status.engine
    and the Cache column say replica-aware; replicas join as for processor-only."""
    n = 2
    apply(kubectl, namespace, tmp_path, sample(**{"replicas": n, "cache.mode": "replica-aware"}))
    obj = wait_ready(kubectl, wait_for, namespace, n)
    st = obj["status"]
    assert st["effectiveCacheMode"] == "replica-aware"
    cm = kubectl.json("get", "configmap", f"{NAME}-config", "-n", namespace)
    assert cm["metadata"]["annotations"]["serving.omnistage.io/effective-cache-mode"] == "replica-aware"
    head = engine_pods(kubectl, namespace, role="head")[0]
    assert {e["name"]: e.get("value") for e in head["spec"]["containers"][0]["env"]}["OMNISTAGE_FRONTEND_CACHE"] \
        == "replica-aware"
    assert st["engine"]["frontendCacheClass"] == "MultiModalProcessorOnlyCache", st["engine"]
    assert st["engine"]["frontendCacheMode"] == "replica-aware", st["engine"]
    assert st["engine"]["patches"]["replica_aware_cache"] == "applied", st["engine"]
    assert is_true(obj, "CacheConsistent") and "replica-aware" in condition(obj, "CacheConsistent")["message"]
    assert all(m["state"] == "Joined" for m in st["members"]) and len(st["members"]) == n - 1
    row = kubectl("get", "omnistage", NAME, "-n", namespace, "--no-headers").stdout.split()
    assert row[:6] == [NAME, str(n), str(n), str(n), "0", "replica-aware"], row
