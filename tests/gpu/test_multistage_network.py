"""Multi-stage on GPUs, the network run (issue 12, docs/multi-stage.md#verifying-on-a-gpu-cluster).

The speech sample (thinker -> talker -> code2wav, manifests/samples/qwen3-omni-speech.yaml or
OMNISTAGE_GPU_MULTISTAGE_SAMPLE) with transport network: NIXL over UCX between pods, the speech pool's
pods kept off the thinker pods' nodes when the cluster has two GPU nodes or more. In order: Ready only
with every stage registered, within the startup timeouts (nothing restarted); talker and code2wav in one
pod on one GPU within their memory fractions; spoken answers (text and a WAV) and their latency and
throughput; the speech pool scaled 1 -> 2 -> 1 under a bounded load with no failed request beyond the
ones bound to a replica whose drain timed out. Runs with OMNISTAGE_GPU_MULTISTAGE=1 or network.
"""

from __future__ import annotations

import time

import pytest
import yaml
from omnistage_engine_patches import contract

from . import multistage as ms
from . import pipeline as pl
from .checks import wait_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.multistage(ms.NETWORK), pytest.mark.timeout(0)]


@pytest.fixture(scope="module")
def network(settings, kubectl, operator_in_cluster, gpu_nodes, speech_results):
    with pl.deployed(settings, kubectl, ms.NETWORK, gpu_nodes) as p:
        speech_results.setdefault(ms.NETWORK, {})["seconds_to_ready"] = p.seconds_to_ready
        yield p


def test_ready_only_with_every_stage_registered_within_the_timeouts(kubectl, network):
    p = network
    stage, pools, stage_pods, pool_pods = pl.read(kubectl, p)
    assert ms.pipeline_problems(stage, pools, stage_pods, pool_pods, pl.head(kubectl, p).listing()) == []
    st = stage["status"]
    print(f"[gpu] {p.name}: Ready {p.seconds_to_ready:.0f} s after apply; stages {st['stages']}")
    assert [e["id"] for e in st["stages"]] == sorted(ms.remote_stage_ids(pools))
    # The connector ports without the replica term: applied on the head (the stage pods run the same image).
    patches = (st.get("engine") or {}).get("patches") or {}
    assert patches.get(contract.CONNECTOR_PORTS) in contract.EFFECTIVE_OUTCOMES, st.get("engine")
    # Nothing restarted, replaced or rolled while the head waited for the pools: the timeouts sufficed.
    every = [*stage_pods, *(q for qs in pool_pods.values() for q in qs)]
    assert {q["metadata"]["name"]: ms.restarts(q) for q in every if ms.restarts(q)} == {}
    found = pl.events(kubectl, p.namespace)
    again = {r: n for r in ms.RESTART_REASONS if (n := pl.reason_count(found, r, {p.name, *p.pools}))}
    assert again == {}, f"pods were replaced or rolled on the way to Ready: {again}"
    for q in every:
        print(f"[gpu]   {q['metadata']['name']} on {q['spec'].get('nodeName')}: timeouts "
              f"{ms.startup_timeouts(q)}")
    # One deploy config for every stage, NIXL on every edge.
    cm = kubectl.json("get", "configmap", f"{p.name}-config", "-n", p.namespace)
    deploy = yaml.safe_load(cm["data"]["deploy.yaml"])
    assert {c["name"] for c in deploy["connectors"].values()} == {"NixlConnector"}, deploy["connectors"]
    assert all(s.get("num_replicas") == 1 for s in deploy["stages"] if s["stage_id"] > 0), deploy["stages"]
    tcp = (stage["spec"].get("transport") or {}).get("protocol", "tcp") == "tcp"
    user_tls = any(e.get("name") == "UCX_TLS" for e in (stage["spec"].get("transport") or {}).get("env") or [])
    if tcp and not user_tls:
        assert {ms.env_value(q, "UCX_TLS") for q in every} == {"tcp,sm,self"}
    if p.cross_node:
        thinker_nodes = {q["spec"]["nodeName"] for q in stage_pods}
        pool_nodes = {q["spec"]["nodeName"] for qs in pool_pods.values() for q in qs}
        assert not thinker_nodes & pool_nodes, (thinker_nodes, pool_nodes)


def test_talker_and_code2wav_share_one_gpu_in_one_pod(kubectl, network, speech_results):
    p = network
    stage, pools, _, pool_pods = pl.read(kubectl, p)
    notes = speech_results.setdefault(ms.NETWORK, {})
    for pool in pools:
        ids = sorted(int(i) for i in pool["spec"]["stageIds"])
        budget = ms.memory_budget(stage, ids)
        for pod in pool_pods[pool["metadata"]["name"]]:
            name, c = pod["metadata"]["name"], ms.engine_container(pod)
            assert sorted(ms.stage_ids_of(c)) == ids, c.get("args")
            assert c["resources"]["limits"][pool["spec"]["gpu"]["resource"]] == str(pool["spec"]["gpu"]["count"])
            assert "hostPath" not in ms.shm_volume(pod), ms.shm_volume(pod)
            smi = pl.exec_in(kubectl, p.namespace, pod, "nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                             "--format=csv,noheader,nounits", check=False)
            gpus = ms.parse_gpu_memory(smi.stdout)
            shm = ms.parse_df_kib(pl.exec_in(kubectl, p.namespace, pod, "df", "-k", "/dev/shm", check=False).stdout)
            log = kubectl("logs", "-n", p.namespace, name, "--timestamps", check=False).stdout
            print(f"[gpu] {name}: stages {ids}, GPUs {gpus}, /dev/shm {shm} KiB, memory budget {budget}; startup:\n  "
                  + "\n  ".join(ms.log_highlights(log)))
            notes.setdefault("pool_pods", {})[name] = {"gpus": gpus, "shm_kib": shm, "budget": budget}
            if smi.returncode != 0 or not gpus:
                pytest.fail(f"nvidia-smi in {name} gave nothing ({smi.stderr.strip()[:200]}): the memory the "
                            "stages took cannot be read; check the engine image (NVIDIA_DRIVER_CAPABILITIES utility)")
            assert len(gpus) == int(pool["spec"]["gpu"]["count"]), gpus
            used, total = sum(g[1] for g in gpus), sum(g[2] for g in gpus)
            assert used <= (budget + ms.MEMORY_SLACK) * total, \
                f"{name}: {used:.0f} of {total:.0f} MiB used, the stages' fractions allow {budget} (+{ms.MEMORY_SLACK})"
            assert shm, f"{name}: no /dev/shm size"


def test_spoken_answers_over_the_network(kubectl, network, settings, speech_results):
    pl.spoken_answers(kubectl, network, ms.NETWORK, settings.multistage_clients, speech_results)


def test_speech_pool_scaled_under_load(kubectl, network, settings, gpu_nodes):
    p = network
    pool = p.pools[0]
    if sum(ms.gpus_per_node(gpu_nodes, settings.resource).values()) < ms.gpus_for(p.objects, {pool: 1}):
        pytest.skip(f"one more {pool} pod needs {ms.gpus_for(p.objects, {pool: 1})} {settings.resource} in all; "
                    "the cluster has fewer")
    clients, timeout = settings.multistage_clients, settings.ready_timeout
    _, pools, _, pool_pods = pl.read(kubectl, p)
    ids = [int(i) for i in pools[0]["spec"]["stageIds"]]
    before = {q["metadata"]["name"] for q in pool_pods[pool]}
    names = {p.name, *p.pools}
    timeouts_before = pl.reason_count(pl.events(kubectl, p.namespace), "DrainTimeout", names)
    leaving: list[tuple[float, float]] = []
    with pl.api(kubectl, p) as base, pl.Load(base, p.model, clients) as load:
        wait_gpu(f"{2 * clients} spoken answers under load", lambda: load.reached(2 * clients), timeout,
                 interval=5)
        pl.scale_pool(kubectl, p, pool, 2)
        try:
            pl.wait_converged(kubectl, p, f"with {pool} at 2", timeout)
            _, _, _, grown = pl.read(kubectl, p)
            ips = {q["metadata"]["name"]: q["status"]["podIP"] for q in grown[pool]}
            assert len(set(ips) - before) == 1, sorted(ips)
            served = load.ok()
            wait_gpu("more answers with two speech pods", lambda: load.reached(served + 2 * clients), timeout,
                     interval=5)
        finally:
            start = time.monotonic()
            pl.scale_pool(kubectl, p, pool, 1)
        pl.wait_converged(kubectl, p, f"with {pool} back at 1", timeout)
        leaving.append((start, time.monotonic()))
        _, _, _, shrunk = pl.read(kubectl, p)
        gone = set(ips) - {q["metadata"]["name"] for q in shrunk[pool]}
        served = load.ok()
        wait_gpu("answers after the scale-down", lambda: load.reached(served + clients), timeout, interval=5)
    outcomes = load.outcomes
    timed_out = pl.reason_count(pl.events(kubectl, p.namespace), "DrainTimeout", names) > timeouts_before
    print(f"[gpu] load while scaling {pool} 1 -> 2 -> 1: {ms.summary(outcomes)}, leave window "
          f"{leaving[0][1] - leaving[0][0]:.0f} s, drain timed out: {timed_out}")
    # The pod removed left the head for every stage it ran before it was deleted (the head keeps the
    # record of each leave).
    assert len(gone) == 1, gone
    victim = ips[gone.pop()]
    listing = pl.head(kubectl, p).listing(include_all=True)
    for sid in ids:
        assert ms.left_members(listing, sid, victim), f"no leave of stage {sid} at {victim} in the head's listing"
    assert ms.load_problems(outcomes, leaving, timed_out, clients) == []
