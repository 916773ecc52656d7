"""On kind, as users run it: the operator from its image via Helm, an OmniStage whose engine pods are
real containers under real kubelets, serving real requests (fixtures and what is real: conftest.py).

One cluster, one operator release, one OmniStage for the module, in this order: install, serve,
what only a kubelet shows, scale up and down under load with the leader operator pod deleted during
the scale-up, a replica pod deleted, a node drained through the budget, the head container killed,
the head's engine stalled past its heartbeat timeout, a head change, `helm upgrade` while serving,
`helm uninstall`. Those marked full (minutes of engine restarts each) run in `make e2e-kind`, and in CI
as the "kind" slice of tests/proofs.py (one slice per landing).
Every step prints its figures; requests go through the head with a bounded stream and every one
must get a complete answer where the operator could have finished it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
from omnistage_engine_patches import contract

from tests.cluster.kind.kindstage import (
    CHART,
    DOCKER,
    HEAD_READY_TIMEOUT,
    OPERATOR_NS,
    RELEASE,
    KindOmniStage,
    helm_values,
    kind_omnistage,
    sh,
    stream,
)
from tests.cluster.real.realstage import send_attributed
from tests.cpu_engine import client
from tests.standin.harness import MEMBERSHIP_PATH, http_get, service_addresses, stage0
from tests.support.stream import Stream

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(HEAD_READY_TIMEOUT + 600)]
NAME = "tiny"
FIGURES: dict[str, float] = {}


@pytest.fixture(scope="module")
def stage(kubectl, operator, kind_namespace, wait_for) -> KindOmniStage:
    s = KindOmniStage(kubectl, None, kind_namespace, NAME, wait_for)
    t0 = time.monotonic()
    s.apply(kind_omnistage(NAME, replicas=2))
    s.wait_serving(2, f"{NAME}: head Ready and one replica joined (real engines on kind)", timeout=HEAD_READY_TIMEOUT)
    FIGURES["apply -> head Ready and 1 replica joined"] = time.monotonic() - t0
    yield s
    s.close_forward()
    print("\n[kind] figures (seconds)")
    for k, v in FIGURES.items():
        print(f"  {k:<58} {v:8.1f}")


def operator_pods(kubectl) -> list[dict]:
    return kubectl.json("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=omnistage-operator")["items"]


def leader(kubectl) -> str:
    lease = kubectl.json("get", "lease", "-n", OPERATOR_NS, "-o", "json")["items"]
    holders = [li["spec"].get("holderIdentity") or "" for li in lease if "omnistage" in li["metadata"]["name"]]
    return next((h for h in holders if h), "")


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or [])


def test_operator_installed_by_helm_runs_in_cluster(kubectl, operator, wait_for):
    pods = operator_pods(kubectl)
    assert len(pods) == 2 and all(ready(p) for p in pods), [(p["metadata"]["name"], ready(p)) for p in pods]
    for p in pods:
        spec = p["spec"]
        assert spec["serviceAccountName"] == "omnistage-operator"
        assert spec["containers"][0]["image"].startswith("omnistage-local/omnistage-operator")
        assert (spec.get("securityContext") or {}).get("runAsUser") == 65532
    names = [p["metadata"]["name"] for p in pods]
    # A Lease left by an earlier release names a pod that is gone until it expires: wait for one of these.
    wait_for("one of the operator pods holds the leader Lease", lambda: leader(kubectl) in names, timeout=180)
    print(f"\n[kind] operator pods {names} on {sorted({p['spec']['nodeName'] for p in pods})}; "
          f"leader {leader(kubectl)}")


def test_omnistage_serves_through_the_head(stage):
    head = stage.pod(stage.head_name())
    [replica] = stage.replica_pods()
    print(f"\n[kind] head on {head['spec']['nodeName']}, {replica} on {stage.pod(replica)['spec']['nodeName']}")
    model = client.served_model(stage.base())
    rows = [send_attributed(stage, client.body(model, "audio", 1000), f"same new audio #{i + 1}") for i in range(3)]
    for r, who in rows:
        print(f"  {r.line()}  replica {who}")
    assert all(r.complete for r, _ in rows), "the seed: the same new audio three times through two replicas"
    assert len({who for _, who in rows}) == 2, "round-robin reached both replicas"
    st = stage.get()["status"]
    assert st.get("effectiveCacheMode") == "processor-only", st.get("effectiveCacheMode")


def test_rendered_pods_run_as_rendered_under_a_kubelet(stage):
    """What only a real kubelet shows: probes, /dev/shm, the security context, the grace period, and
    how the stand-in runtime of the cluster tier differs (printed, asserted where the kubelet decides)."""
    head = stage.pod(stage.head_name())
    [replica_name] = stage.replica_pods()
    replica = stage.pod(replica_name)
    hc = head["spec"]["containers"][0]
    assert hc.get("startupProbe") and hc.get("readinessProbe"), "the head's probes are rendered"
    statuses = {p["metadata"]["name"]: p["status"]["containerStatuses"][0] for p in (head, replica)}
    assert all(cs["ready"] and cs["started"] for cs in statuses.values()), statuses
    shm = stage.exec(stage.head_name(), "sh", "-c", "df -k /dev/shm | tail -1")
    caps = stage.exec(stage.head_name(), "sh", "-c", "grep -E '^(CapEff|NoNewPrivs)' /proc/1/status")
    routes = stage.exec(stage.head_name(), "ip", "route")
    print(f"\n[kind] head /dev/shm: {shm.strip()}\n[kind] head {caps.strip()}\n[kind] head routes: {routes.strip()}")
    assert "default" not in routes, "network rule: pods route only 198.19.0.0/16, no default route"
    assert "tmpfs" in shm or "shm" in shm, shm
    assert "CapEff:\t0000000000000000" in caps, "capabilities.drop [ALL] holds in the container"
    assert "NoNewPrivs:\t1" in caps, "allowPrivilegeEscalation false holds"
    for p in (head, replica):
        assert p["spec"]["terminationGracePeriodSeconds"] >= 60, p["spec"]["terminationGracePeriodSeconds"]
    started = {n: cs["state"]["running"]["startedAt"] for n, cs in statuses.items()}
    ready_at = {p["metadata"]["name"]: next(c["lastTransitionTime"] for c in p["status"]["conditions"] if c["type"] == "Ready")
                for p in (head, replica)}
    print("[kind] kubelet vs the cluster tier's stand-in runtime:")
    for n, at in started.items():
        print(f"  {n:<22} container started {at}, pod Ready {ready_at[n]}")
    # The replica's readiness gate: the kubelet holds the pod NotReady until the operator sets the joined
    # condition (the cluster tier's runtime computes Ready the same way; it restarts a head in place
    # like restartPolicy Always).
    gates = [g["conditionType"] for g in replica["spec"].get("readinessGates") or []]
    joined = {c["type"]: c["status"] for c in replica["status"]["conditions"]}
    print(f"  {replica_name} readiness gates {gates}: {[(g, joined.get(g)) for g in gates]}")
    assert gates and all(joined.get(g) == "True" for g in gates), "a joined replica's gate is True"


def test_scale_up_and_down_under_load_with_the_leader_deleted(stage, kubectl, wait_for):
    """`kubectl scale` 2 -> 3 and the leader operator pod deleted right after it (the other replica
    takes the Lease and finishes the join), then 3 -> 2, while a bounded stream of requests runs
    through the head: every request gets a complete answer."""
    with stream(stage, requests=400, concurrency=2, seconds=1200) as load:
        old = leader(kubectl)
        t0 = stage.scale(3)
        kubectl("delete", "pod", old, "-n", OPERATOR_NS, "--wait=false")
        wait_for("another operator pod leads", lambda: leader(kubectl) not in ("", old), timeout=180)
        FIGURES["leader pod deleted after kubectl scale -> new leader"] = time.monotonic() - t0
        stage.wait_serving(3, "scale 2 -> 3 under the new leader: the new replica joined", timeout=HEAD_READY_TIMEOUT)
        FIGURES["kubectl scale 2->3 (leader deleted) -> joined"] = time.monotonic() - t0
        newest = stage.replica_pods()[-1]
        t1 = stage.scale(2)
        stage.wait_for("scale 3 -> 2: a replica pod gone", lambda: len(stage.replica_pods()) == 1
                       and stage.get()["status"].get("replicas") == 2, timeout=300, interval=1)
        FIGURES["kubectl scale 3->2 -> pod gone"] = time.monotonic() - t1
    print(f"\n[kind] scale 2->3->2 under load, leader {old} deleted during the scale-up: {load.summary()} "
          f"(the newest replica was {newest})")
    assert load.finished and load.results, load.summary()
    assert not load.lost(), load.table(load.lost())


@pytest.mark.full
def test_replica_pod_deleted_is_replaced_and_rejoins(stage):
    [victim] = stage.replica_pods()
    t0 = time.monotonic()
    stage.kubectl("delete", "pod", victim, "-n", stage.namespace, "--wait=false")
    def replaced() -> bool:
        joined = stage.joined()
        return len(joined) == 1 and joined[0]["pod"] != victim
    stage.wait_for(f"a replacement for {victim} joined", replaced, timeout=HEAD_READY_TIMEOUT, interval=3)
    FIGURES["kubectl delete pod (replica) -> replacement joined"] = time.monotonic() - t0
    model = client.served_model(stage.base())
    after = Stream(stage.base(), [(f"after #{i}", client.body(model, "audio", 5 + i)) for i in range(4)], 2).run()
    assert after.finished and len(after.results) == 4 and not after.lost(), after.table()


@pytest.mark.full
@pytest.mark.timeout(3 * HEAD_READY_TIMEOUT)
def test_node_drain_evicts_through_the_budget_and_loses_nothing(stage, kubectl):
    """`kubectl drain` of a worker holding both replicas (3 serving: the head and two replicas), through
    the eviction API and NAME-replicas (minAvailable 1): the first eviction is allowed, the second is
    refused until the first one's replacement has joined on the other worker (a replica pod is Ready,
    healthy to the budget, only while joined); each evicted replica drains in its preStop. A bounded
    stream runs through the head; asserted: every request complete, the budget refused at least once,
    and the head routed to at least 2 (itself and a replica) throughout.

    The drain selects the replica pods only: a single head cannot be protected by a budget, and its
    node's drain is the outage docs/scaling.md describes. The head may share the drained node."""
    [first] = stage.replica_pods()
    node = stage.pod(first)["spec"]["nodeName"]
    [other] = [n["metadata"]["name"] for n in kubectl.json("get", "nodes")["items"]
               if "node-role.kubernetes.io/control-plane" not in n["metadata"]["labels"]
               and n["metadata"]["name"] != node]
    replicas = f"serving.omnistage.io/omnistage={NAME},serving.omnistage.io/role=replica"
    # Both replicas on one node: the other worker cordoned while the second one is scheduled.
    kubectl("cordon", other)
    try:
        t0 = stage.scale(3)
        stage.wait_serving(3, f"a second replica joined on {node}", timeout=HEAD_READY_TIMEOUT)
        FIGURES["drain setup: 2->3 with both replicas on one node"] = time.monotonic() - t0
    finally:
        kubectl("uncordon", other)
    before = stage.replica_pods()
    assert {stage.pod(p)["spec"]["nodeName"] for p in before} == {node}, before
    uids = {stage.pod(p)["metadata"]["uid"] for p in before}  # names come back after a scale-down
    token = stage.head.token()
    floor: list[int] = []
    with stream(stage, requests=1500, concurrency=2, seconds=HEAD_READY_TIMEOUT) as load:
        stop = threading.Event()

        def sample() -> None:  # the head's own listing: what it routes to, not what the operator says
            while not stop.is_set():
                body = http_get(stage.membership_base() + MEMBERSHIP_PATH, token=token, timeout=5)
                if body:  # the head's own engine and the replica pods, each while listed live (not draining)
                    floor.append(sum(1 for m in stage0(json.loads(body))
                                     if contract.is_live(m) and (m.get("local") or m.get("pod"))))
                stop.wait(1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t1 = time.monotonic()
        try:
            drain = kubectl("drain", node, f"--pod-selector={replicas}", "--ignore-daemonsets",
                            "--delete-emptydir-data", f"--timeout={HEAD_READY_TIMEOUT}s",
                            timeout=HEAD_READY_TIMEOUT + 60)
        finally:
            kubectl("uncordon", node)
            FIGURES["kubectl drain (2 replicas, budget minAvailable 1)"] = time.monotonic() - t1
        stage.wait_serving(3, f"two replicas joined on {other} after the drain", timeout=HEAD_READY_TIMEOUT)
        FIGURES["kubectl drain -> 2 replicas joined again"] = time.monotonic() - t1
        stop.set()
        sampler.join(10)
    refusals = (drain.stdout + drain.stderr).count("disruption budget")
    after = stage.replica_pods()
    print(f"\n[kind] kubectl drain {node}: replicas {before} -> {after} on "
          f"{sorted({stage.pod(p)['spec']['nodeName'] for p in after})}; evictions refused by the budget "
          f"{refusals}x; {load.summary()}; head routed to >= {min(floor) if floor else None} ({len(floor)} samples)")
    assert load.finished and load.results, load.summary()
    assert not load.lost(), load.table(load.lost())
    assert refusals >= 1, f"the budget never refused an eviction:\n{drain.stdout}{drain.stderr}"
    assert floor and min(floor) >= 2, f"serving fell to {min(floor) if floor else None}"
    assert not {stage.pod(p)["metadata"]["uid"] for p in after} & uids, "every drained replica was replaced"
    t2 = stage.scale(2)
    stage.wait_for("scale 3 -> 2 after the drain: a replica pod gone",
                   lambda: len(stage.replica_pods()) == 1 and stage.get()["status"].get("replicas") == 2,
                   timeout=300, interval=1)
    FIGURES["kubectl scale 3->2 (after the drain) -> pod gone"] = time.monotonic() - t2


@pytest.mark.full
def test_head_container_killed_kubelet_restarts_it_and_replicas_re_attach(stage, kubectl):
    """Under a real kubelet and cluster DNS: the replica pod outlives its head's container (patch
    `reattach`: the same pod and engine core registers with the restarted head, no model reload).
    Before issue 39 the operator rolled it (a new pod, a reload)."""
    head = stage.head_name()
    before = stage.pod(head)["status"]["containerStatuses"][0]["restartCount"]
    [old_replica] = stage.replica_pods()
    replica_uid = stage.pod(old_replica)["metadata"]["uid"]
    loads = stage.logs(old_replica).count("Loading weights took") + stage.logs(old_replica).count("Model loading took")
    node = stage.pod(head)["spec"]["nodeName"]
    t0 = time.monotonic()
    # SIGKILL to the container's main process from its node (what the OOM killer does; from inside the
    # container PID 1 ignores it). crictl gives the process id the node sees.
    cid = stage.pod(head)["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    sh(DOCKER, "exec", node, "sh", "-c",
       f"kill -9 $(crictl inspect --output go-template --template '{{{{.info.pid}}}}' {cid})")
    stage.wait_for("the kubelet restarted the head container", lambda: stage.pod(head)["status"]
                   ["containerStatuses"][0]["restartCount"] > before, timeout=300, interval=2)
    stage.wait_serving(2, "the head serving again with a joined replica", timeout=HEAD_READY_TIMEOUT)
    FIGURES["head container killed -> serving with 2 again"] = time.monotonic() - t0
    print(f"\n[kind] head on {node} restarted by its kubelet; replicas before {old_replica}, after {stage.replica_pods()}")
    assert stage.replica_pods() == [old_replica] and stage.pod(old_replica)["metadata"]["uid"] == replica_uid, \
        "the replica pod was replaced"
    logs = stage.logs(old_replica)
    assert logs.count("Loading weights took") + logs.count("Model loading took") == loads, "the replica reloaded"
    model = client.served_model(stage.base())
    after = Stream(stage.base(), [(f"after head restart #{i}", client.body(model, "audio", 9 + i))
                                  for i in range(4)], 2).run()
    assert after.finished and len(after.results) == 4 and not after.lost(), after.table()


def _head_engine_cores() -> list[int]:
    """The head's own stage-0 engine core (StageEngineCoreProc_*_replica0_*: the head-local replica),
    as this machine sees a kind pod's processes (one kernel: the host's /proc)."""
    from pathlib import Path

    cores = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "StageEngineCoreProc" in cmd and "_replica0_" in cmd:
                cores.append(int(entry.name))
    return cores


@pytest.mark.full
def test_a_stall_of_the_head_s_engine_is_survived_under_a_kubelet(stage):
    """issue 26 on kind: SIGSTOP of the head's own engine core for 45 s (past the default 30 s heartbeat
    timeout) under a stream, then SIGCONT: the engine is not killed, the head's liveness probe does
    not restart it, requests in flight on it wait for it, and it serves again."""
    head = stage.head_name()
    restarts = stage.pod(head)["status"]["containerStatuses"][0]["restartCount"]
    cores = _head_engine_cores()
    assert cores, "no StageEngineCoreProc of the head's replica 0 on this machine"
    samples = []
    with stream(stage, requests=200, concurrency=2, seconds=900) as load:
        time.sleep(5)
        t0 = time.monotonic()
        for pid in cores:
            os.kill(pid, signal.SIGSTOP)
        while time.monotonic() - t0 < 45:
            samples.append(stage.get()["status"].get("readyReplicas"))
            time.sleep(5)
        for pid in cores:
            os.kill(pid, signal.SIGCONT)
        stage.wait_for("the head's engine serving again", lambda: stage.get()["status"].get("readyReplicas") == 2,
                       timeout=300, interval=1)
        FIGURES["head engine stalled 45 s: SIGCONT -> serving with 2 again"] = time.monotonic() - t0 - 45
    print(f"\n[kind] head engine stalled 45 s: readyReplicas every 5 s {samples}; {load.summary()}")
    assert all(os.path.exists(f"/proc/{pid}") for pid in cores), "the stalled engine was killed"
    assert stage.pod(head)["status"]["containerStatuses"][0]["restartCount"] == restarts, "the head was restarted"
    assert 1 in samples, "status never stopped counting the stalled engine"
    assert load.finished and load.results, load.summary()
    assert not load.lost(), load.table(load.lost())


@pytest.mark.full
@pytest.mark.timeout(3 * HEAD_READY_TIMEOUT)
def test_a_head_change_hands_over_to_a_new_head_and_loses_nothing(stage, kubectl, wait_for):
    """A change that reaches the head (an annotation in spec.template.metadata: the head and every
    replica are rendered anew) runs blue/green under real kubelets: the new head starts beside the
    old one, the Services move once it serves, the old set drains and goes. A bounded stream runs
    through the Service (the head it selects, per request); asserted: every request complete, and a
    head selected by the Service throughout. Fails on a head replaced in place: requests sent from
    the old head's deletion until the new one is Ready find no endpoint."""
    old = {p["metadata"]["uid"] for p in kubectl.json("get", "pods", "-n", stage.namespace, "-l",
                                                       f"serving.omnistage.io/omnistage={NAME}")["items"]}
    old_head = stage.head_name()
    manifest = stage.get()
    template = manifest["spec"]["template"]
    template.setdefault("metadata", {}).setdefault("annotations", {})["omnistage-e2e/generation"] = "2"
    no_endpoint: list[float] = []
    with stream(stage, requests=600, concurrency=2, seconds=3 * HEAD_READY_TIMEOUT) as load:
        t0 = time.monotonic()
        kubectl("patch", "omnistage", NAME, "-n", stage.namespace, "--type=merge", "-p",
                json.dumps({"spec": {"template": template}}))

        def handed_over() -> bool:
            if not service_addresses(kubectl, stage.namespace, NAME):
                no_endpoint.append(time.monotonic() - t0)
            pods = kubectl.json("get", "pods", "-n", stage.namespace, "-l", f"serving.omnistage.io/omnistage={NAME}")
            st = stage.get().get("status", {})
            return not ({p["metadata"]["uid"] for p in pods["items"]} & old) and len(pods["items"]) == 2 \
                and st.get("readyReplicas") == 2 and st.get("registeredReplicas") == 2

        wait_for("the new head and its replica serving, the old set gone", handed_over,
                 timeout=3 * HEAD_READY_TIMEOUT, interval=2)
        FIGURES["head change (template) -> new head and replica serving"] = time.monotonic() - t0
    print(f"\n[kind] head change {old_head} -> {stage.head_name()}: {load.summary()}; samples without a Ready "
          f"endpoint: {len(no_endpoint)}")
    assert stage.head_name() != old_head
    assert load.finished and load.results, load.summary()
    assert not load.lost(), load.table(load.lost())
    assert not no_endpoint, f"the Service had no Ready endpoint at {no_endpoint}"


def test_helm_upgrade_while_serving(stage, helm, kubectl, wait_for):
    def engine_pods() -> dict[str, str]:
        return {p["metadata"]["name"]: p["metadata"]["uid"] for p in stage.kubectl.json(
            "get", "pods", "-n", stage.namespace, "-l", f"serving.omnistage.io/omnistage={NAME}")["items"]}
    # A replica the scale-down removed may still be Terminating (its preStop drain): wait it out first.
    wait_for("no engine pod terminating", lambda: len(engine_pods()) == 1 + len(stage.replica_pods()), timeout=300)
    engine_uids = engine_pods()
    with stream(stage, requests=200, concurrency=2, seconds=600) as load:
        t0 = time.monotonic()
        helm("upgrade", RELEASE, str(CHART), "--namespace", OPERATOR_NS, *helm_values(),
             "--set", "podAnnotations.omnistage-e2e/upgraded=yes", "--wait", "--timeout", "5m", timeout=360)
        FIGURES["helm upgrade --wait (operator pods rolled)"] = time.monotonic() - t0
        wait_for("a leader after the upgrade", lambda: leader(kubectl), timeout=180)
        time.sleep(20)  # a reconcile pass of the new leader while requests flow
    after = engine_pods()
    print(f"\n[kind] helm upgrade while serving: {load.summary()}; engine pods "
          f"{'unchanged' if after == engine_uids else 'CHANGED'}")
    assert after == engine_uids, "an operator upgrade must not replace engine pods"
    assert load.finished and load.results, load.summary()
    assert not load.lost(), load.table(load.lost())


def test_helm_uninstall_keeps_serving_and_the_crds(stage, helm, kubectl, wait_for):
    helm("uninstall", RELEASE, "--namespace", OPERATOR_NS, "--wait", timeout=300)
    wait_for("the operator pods gone", lambda: not operator_pods(kubectl), timeout=180)
    crds = [c["metadata"]["name"] for c in kubectl.json("get", "crds")["items"] if "omnistage" in c["metadata"]["name"]]
    model = client.served_model(stage.base())
    without = Stream(stage.base(), [(f"no operator #{i}", client.body(model, "audio", 20 + i)) for i in range(4)], 2).run()
    print(f"\n[kind] helm uninstall: CRDs kept {crds}; requests without an operator: {without.summary()}")
    assert "omnistages.serving.omnistage.io" in crds, "helm keeps CRDs from crds/ on uninstall"
    assert without.finished and len(without.results) == 4 and not without.lost(), \
        f"serving does not depend on the operator being up:\n{without.table()}"
