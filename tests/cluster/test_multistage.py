"""A whole pipeline on the local control plane (issue 12): the speech sample (Qwen3-Omni thinker ->
talker -> code2wav) applied, scaled, a speech pod killed, the head restarted, a bad pool refused,
sameNode pinned to one node; driven with kubectl as users drive it.

What runs: the operator unmodified (`omnistage run`, its own ServiceAccount and ClusterRole); on
kwok's nodes tests/standin/runtime.py runs, for the head pod, a three-stage stand-in head (the real
vllm-omni startup that waits for one replica of each remote stage, master server, coordinator,
orchestrator and this project's membership endpoint, with stand-in engine cores) and, for each pool
pod, ONE stand-in replica process that registers a replica of every stage id of the pod through
vllm-omni's own client code (one process instead of the supervisor's one per stage: each imports
vllm-omni, which costs tens of seconds on 2 cores). No model, no GPU, no connector traffic: the data
path between stages is the connector tier's (tests/connector).

Time on 2 cores (CI): most of it is the stand-in head's start (~15-30 s) and each pool pod's
process (~10-20 s), once per head incarnation and per pod; the module starts 3 heads and 7 pool pods.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.test_operator import READY_TIMEOUT, events, get_stage
from tests.standin.harness import L_OMNISTAGE, HeadEndpoint
from tests.support.status import condition, is_true, pod_ready

# The operator and the stand-in runtime: conftest.py's module fixtures `operator` and `standin`.
pytestmark = pytest.mark.usefixtures("operator_log_on_failure")

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "manifests" / "samples" / "qwen3-omni-speech.yaml"
NAME, POOL = "qwen3-omni", "qwen3-omni-speech"
L_POOL = "serving.omnistage.io/pool"
GONE = ("left", "detached")


def docs(**pool_spec: Any) -> list[dict[str, Any]]:
    out = [d for d in yaml.safe_load_all(SAMPLE.read_text()) if d]
    for d in out:
        if d["kind"] == "OmniStagePool":
            d["spec"].update(pool_spec)
    return out


def apply_docs(kubectl, namespace: str, tmp_path: Path, objs: list[dict[str, Any]] | None = None):
    path = SAMPLE
    if objs is not None:
        path = tmp_path / "pipeline.yaml"
        path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    return kubectl("apply", "-n", namespace, "-f", str(path))


def get_pool(kubectl, namespace: str, name: str = POOL) -> dict[str, Any] | None:
    proc = kubectl("get", "omnistagepool", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def pool_pods(kubectl, namespace: str, pool: str = POOL) -> list[dict[str, Any]]:
    items = kubectl.json("get", "pods", "-n", namespace, "-l", f"{L_POOL}={pool}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def at_head(listing: dict[str, Any] | None, stage: int) -> dict[str, str]:
    """The head's live replicas of one stage: pod name -> host."""
    members = ((listing or {}).get("stages") or {}).get(str(stage)) or []
    return {m.get("pod"): m.get("host") for m in members if str(m.get("state", "")).lower() not in GONE}


def pipeline_converged(kubectl, namespace: str, speech: int) -> dict[str, Any] | None:
    """OmniStage and pool Ready for their generations, `speech` pool pods Ready, and the head listing
    exactly those pods (by name, at their IPs) as replicas of stage 1 and of stage 2."""
    obj, pool = get_stage(kubectl, namespace), get_pool(kubectl, namespace)
    if obj is None or pool is None:
        return None
    st, pst = obj.get("status") or {}, pool.get("status") or {}
    pods = pool_pods(kubectl, namespace)
    if not (is_true(obj, "Ready") and st.get("observedGeneration") == obj["metadata"]["generation"]
            and is_true(pool, "Ready") and pst.get("observedGeneration") == pool["metadata"]["generation"]
            and pst.get("registeredReplicas") == speech and len(pods) == speech and all(map(pod_ready, pods))
            and [(s["id"], s["registered"]) for s in st.get("stages") or []] == [(1, speech), (2, speech)]):
        return None
    want = {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    return obj if all(at_head(listing, k) == want for k in (1, 2)) else None


def wait_pipeline(kubectl, wait_for, namespace: str, speech: int) -> dict[str, Any]:
    last = {"line": ""}

    def check():
        obj, pool = get_stage(kubectl, namespace), get_pool(kubectl, namespace)
        line = (f"stages={(obj or {}).get('status', {}).get('stages')} "
                f"Ready={condition(obj, 'Ready').get('message')} pool={condition(pool, 'Ready').get('message')}")
        if line != last["line"]:
            print(f"    {line}", flush=True)
            last["line"] = line
        return pipeline_converged(kubectl, namespace, speech)

    return wait_for(f"{namespace}/{NAME} Ready with {speech} speech pods joined for stages 1 and 2", check,
                    timeout=READY_TIMEOUT, interval=1.0)


def departed(listing: dict[str, Any] | None, pod: str) -> dict[int, str]:
    """Stage -> how the head let the pod's replica of it go (left: a leave; detached: DOWN/kill)."""
    return {int(k): str(m.get("state")).lower() for k, ms in ((listing or {}).get("stages") or {}).items()
            for m in ms if m.get("pod") == pod and str(m.get("state", "")).lower() in GONE}


# ----- tests ---------------------------------------------------------------------------------------

def test_speech_sample_ready_scaled_and_a_speech_pod_killed(kubectl, wait_for, namespace, operator, standin,
                                                           tmp_path):
    """kubectl apply -f the sample -> Ready only once both remote stages registered; the speech pool
    scaled 1 -> 3 -> 1 with a drained leave of both stages per removed pod; a speech pod killed ->
    detached from both stages and replaced."""
    out = apply_docs(kubectl, namespace, tmp_path)
    assert f"omnistagepool.serving.omnistage.io/{POOL} created" in out.stdout
    obj = wait_pipeline(kubectl, wait_for, namespace, 1)
    head = kubectl.json("get", "pod", f"{NAME}-head", "-n", namespace)
    [speech] = pool_pods(kubectl, namespace)
    head_ready_at = next(c["lastTransitionTime"] for c in head["status"]["conditions"] if c["type"] == "Ready")
    print(f"head Ready at {head_ready_at}; speech pod created at {speech['metadata']['creationTimestamp']}")
    # The head cannot be Ready before a replica of each remote stage registered (its startup waits).
    assert head_ready_at >= speech["metadata"]["creationTimestamp"]
    assert speech["metadata"]["labels"][L_OMNISTAGE] == NAME
    assert condition(obj, "StagesCovered")["message"] == f"stage 1: pool {POOL}; stage 2: pool {POOL}"
    # The engine patches in effect on the head and, as each stage replica reported at registration,
    # on the pool pod (the stand-in replica process loads the plugin through vLLM's loader).
    assert obj["status"]["engine"]["patches"]["connector_ports"] == "applied"
    for stage in obj["status"]["stages"]:
        print(f"stage {stage['id']} patches: {stage.get('patches')}")
        assert stage["patches"]["connector_ports"] == "applied" and stage["patches"]["registration_report"] == "applied"
    cm = kubectl.json("get", "configmap", f"{NAME}-config", "-n", namespace)
    rendered = yaml.safe_load(cm["data"]["deploy.yaml"])
    assert [s["stage_id"] for s in rendered["stages"]] == [0, 1, 2]
    assert rendered["connectors"]["omnistage_nixl"]["name"] == "NixlConnector"
    printed = kubectl("get", "omnistagepool", "-n", namespace).stdout
    print(printed)
    assert "OMNISTAGE" in printed and "REGISTERED" in printed

    kubectl("scale", "omnistagepool", POOL, "-n", namespace, "--replicas=3")
    wait_pipeline(kubectl, wait_for, namespace, 3)
    added = sorted(p["metadata"]["name"] for p in pool_pods(kubectl, namespace))
    assert added == [f"{POOL}-1", f"{POOL}-2", f"{POOL}-3"]

    kubectl("scale", "omnistagepool", POOL, "-n", namespace, "--replicas=1")
    wait_pipeline(kubectl, wait_for, namespace, 1)
    head_api = HeadEndpoint(kubectl, namespace, NAME)
    listing = head_api.listing(include_all=True)
    removed = [f"{POOL}-2", f"{POOL}-3"]  # the newest go first
    assert {p: departed(listing, p) for p in removed} == {p: {1: "left", 2: "left"} for p in removed}
    left_events = [e["message"] for e in events(kubectl, namespace) if e["reason"] == "Left"]
    print("\n".join(left_events))
    assert sum(f"({POOL}-3) left the engine" in m for m in left_events) == 2  # one drained leave per stage

    if standin is None:
        return  # a real kubelet runs the real engine: no process to kill from here
    [survivor] = pool_pods(kubectl, namespace)
    standin.kill(namespace, survivor["metadata"]["name"])
    wait_for(f"{survivor['metadata']['name']} replaced", lambda: [
        p for p in pool_pods(kubectl, namespace) if p["metadata"]["uid"] != survivor["metadata"]["uid"]], timeout=120)
    wait_pipeline(kubectl, wait_for, namespace, 1)
    assert departed(head_api.listing(include_all=True), survivor["metadata"]["name"]).keys() == {1, 2}
    replaced = [e for e in events(kubectl, namespace) if e["reason"] == "ReplacedReplica"]
    assert any(survivor["metadata"]["name"] in e["message"] for e in replaced)


def test_head_restart_rolls_the_pool_and_bad_pools_are_refused(kubectl, wait_for, namespace, operator, standin,
                                                               tmp_path):
    """The head engine restarts in place (new boot id): pool pods never re-register, so every one is
    rolled. A pool naming a stage the OmniStage lacks, or an OmniStage that does not exist, is refused
    with a reason and gets no pod."""
    apply_docs(kubectl, namespace, tmp_path)
    # Refusals first: they need no engine, and the pipeline is starting meanwhile.
    bad = {"apiVersion": "serving.omnistage.io/v1alpha1", "kind": "OmniStagePool",
           "metadata": {"name": "talkers"}, "spec": {"omniStage": NAME, "stageIds": [3], "replicas": 1}}
    orphan = {**bad, "metadata": {"name": "orphan"}, "spec": {"omniStage": "nowhere", "stageIds": [1]}}
    apply_docs(kubectl, namespace, tmp_path, [bad, orphan])
    for pool, reason, fragment in (("talkers", "UnknownStage", "has no stage 3 in spec.stages"),
                                   ("orphan", "OmniStageNotFound", "OmniStage nowhere does not exist")):
        ready = wait_for(f"pool {pool} refused", lambda p=pool: condition(get_pool(kubectl, namespace, p), "Ready")
                         if condition(get_pool(kubectl, namespace, p), "Ready").get("reason") else None, timeout=60)
        print(pool, ready)
        assert (ready["status"], ready["reason"]) == ("False", reason) and fragment in ready["message"]
        assert pool_pods(kubectl, namespace, pool) == []

    obj = wait_pipeline(kubectl, wait_for, namespace, 1)
    if standin is None:
        pytest.skip("needs the stand-in runtime to kill the head engine process")
    old_boot = obj["status"]["head"]["bootId"]
    old_pool = {p["metadata"]["uid"] for p in pool_pods(kubectl, namespace)}
    standin.kill(namespace, f"{NAME}-head")
    wait_for("every pool pod rolled for the restarted head", lambda: not old_pool & {
        p["metadata"]["uid"] for p in pool_pods(kubectl, namespace)}, timeout=READY_TIMEOUT)
    obj = wait_pipeline(kubectl, wait_for, namespace, 1)
    assert obj["status"]["head"]["bootId"] != old_boot
    restarted = [e["message"] for e in events(kubectl, namespace) if e["reason"] == "HeadRestarted"]
    assert restarted and "every pool pod" in restarted[0]


def test_same_node_pins_every_engine_pod_to_the_heads_node(kubectl, wait_for, namespace, operator, tmp_path):
    """transport sameNode: replicas and pool pods follow the head's node (pod affinity), and every
    engine pod mounts the OmniStage's host directory as /dev/shm."""
    objs = docs(replicas=2)
    next(d for d in objs if d["kind"] == "OmniStage")["spec"]["transport"]["mode"] = "sameNode"
    apply_docs(kubectl, namespace, tmp_path, objs)

    def placed():
        pods = kubectl.json("get", "pods", "-n", namespace, "-l", f"{L_OMNISTAGE}={NAME}")["items"]
        nodes = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods}
        return nodes if len(nodes) == 4 and all(nodes.values()) else None  # head, replica, 2 speech pods

    nodes = wait_for("every engine pod scheduled", placed, timeout=120)
    print(nodes)
    assert len(set(nodes.values())) == 1, f"sameNode pods spread over nodes: {nodes}"
    for pod in nodes:
        spec = kubectl.json("get", "pod", pod, "-n", namespace)["spec"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["hostPath"] == {"path": f"/dev/shm/omnistage/{namespace}/{NAME}", "type": "DirectoryOrCreate"}


def _pool_with_standbys(kubectl, namespace: str, serving: int, standbys: int) -> dict[str, Any] | None:
    """The pool Ready with `serving` pods joined for stages 1 and 2 and `standbys` standby pods whose
    replicas of both stages are registered from their addresses, unjoined: (pods by role, listing)."""
    pool = get_pool(kubectl, namespace)
    pst = (pool or {}).get("status") or {}
    if not (pool and is_true(pool, "Ready") and pst.get("observedGeneration") == pool["metadata"]["generation"]
            and pst.get("registeredReplicas") == serving and pst.get("standbyReplicas") == standbys
            and pst.get("readyStandbyReplicas") == standbys):
        return None
    by_role: dict[str, list[dict[str, Any]]] = {"pool": [], "standby": []}
    for p in pool_pods(kubectl, namespace):
        by_role.setdefault(p["metadata"]["labels"]["serving.omnistage.io/role"], []).append(p)
    if (len(by_role["pool"]), len(by_role["standby"])) != (serving, standbys):
        return None
    listing = HeadEndpoint(kubectl, namespace, NAME).listing()
    for k in (1, 2):
        members = [m for m in ((listing or {}).get("stages") or {}).get(str(k)) or []
                   if str(m.get("state", "")).lower() not in GONE]
        if {m.get("pod") for m in members if m.get("pod")} != {p["metadata"]["name"] for p in by_role["pool"]}:
            return None
        if {m.get("host") for m in members if not m.get("pod")} != {p["status"]["podIP"] for p in by_role["standby"]}:
            return None
    return {"pods": by_role, "listing": listing}


def test_a_pool_standby_is_held_for_both_stages_joined_by_a_pool_scale_up_and_held_again(
        kubectl, wait_for, namespace, operator, standin, tmp_path):
    """OmniStagePool spec.standby 1 (issue 30): a standby speech pod registers both its stages and the
    head holds them unjoined; `kubectl scale omnistagepool` 1 -> 2 joins that pod (the same pod, both
    stages) and a new standby refills; replicas 1 with standby 2 holds a joined pod again (the same pod,
    no new one). Stand-in engines; timings printed, never asserted."""
    apply_docs(kubectl, namespace, tmp_path, docs(standby=1))
    state = wait_for("1 speech pod serving and 1 standby held for stages 1 and 2",
                     lambda: _pool_with_standbys(kubectl, namespace, 1, 1), timeout=READY_TIMEOUT, interval=1.0)
    [spare] = state["pods"]["standby"]
    spare_name, spare_uid = spare["metadata"]["name"], spare["metadata"]["uid"]
    printed = kubectl("get", "omnistagepool", "-n", namespace).stdout
    print(printed)
    assert "STANDBY" in printed

    started = time.monotonic()
    kubectl("scale", "omnistagepool", POOL, "-n", namespace, "--replicas=2")
    state = wait_for("the standby joined for both stages and a new standby held",
                     lambda: _pool_with_standbys(kubectl, namespace, 2, 1), timeout=READY_TIMEOUT, interval=0.5)
    assert spare_uid in {p["metadata"]["uid"] for p in state["pods"]["pool"]}, "the standby itself joined"
    refill = state["pods"]["standby"][0]
    print(f"kubectl scale omnistagepool 1 -> 2: standby {spare_name} joined for stages 1 and 2, "
          f"{refill['metadata']['name']} refilled, after {time.monotonic() - started:.1f}s (stand-in engines)")

    before = {p["metadata"]["uid"] for ps in state["pods"].values() for p in ps}
    kubectl("patch", "omnistagepool", POOL, "-n", namespace, "--type", "merge", "-p",
            json.dumps({"spec": {"replicas": 1, "standby": 2}}))
    state = wait_for("a joined speech pod held as a standby", lambda: _pool_with_standbys(kubectl, namespace, 1, 2),
                     timeout=READY_TIMEOUT, interval=0.5)
    after = {p["metadata"]["uid"] for ps in state["pods"].values() for p in ps}
    assert after == before, "a hold, not a new pod"
    reasons = {e["reason"] for e in events(kubectl, namespace)}
    assert {"JoinedStandby", "RefillingStandby", "KeptStandby"} <= reasons, sorted(reasons)
