"""Multi-stage on GPUs, the sameNode run (issue 12, docs/multi-stage.md#verifying-on-a-gpu-cluster).

The speech sample with transport sameNode, one thinker and one speech pod (2 GPUs on one node): the
shipped SharedMemoryConnector through a host directory every engine pod mounts as /dev/shm. In order:
every engine pod on the head's node with that directory, and a file written in the head pod really read
in the speech pod (on the local control plane every pod shares the machine's /dev/shm anyway); spoken
answers; then the thinker's text at temperature 0 against the network run (equal), and the latency and
throughput of both. The tier creates the namespace with the privileged Pod Security level (hostPath);
a namespace you give must allow hostPath. Runs with OMNISTAGE_GPU_MULTISTAGE=1.
"""

from __future__ import annotations

import uuid

import pytest
import yaml

from tests.standin.harness import L_ROLE

from . import multistage as ms
from . import pipeline as pl

pytestmark = [pytest.mark.gpu, pytest.mark.multistage(ms.SAME_NODE), pytest.mark.timeout(0)]


@pytest.fixture(scope="module")
def same_node(settings, kubectl, operator_in_cluster, gpu_nodes, speech_results):
    with pl.deployed(settings, kubectl, ms.SAME_NODE, gpu_nodes, thinker_replicas=1, pool_replicas=1) as p:
        speech_results.setdefault(ms.SAME_NODE, {})["seconds_to_ready"] = p.seconds_to_ready
        yield p


def test_every_engine_pod_on_one_node_sharing_one_shm_directory(kubectl, same_node):
    p = same_node
    _, _, stage_pods, pool_pods = pl.read(kubectl, p)
    every = [*stage_pods, *(q for qs in pool_pods.values() for q in qs)]
    assert len({q["spec"]["nodeName"] for q in every}) == 1, {q["metadata"]["name"]: q["spec"]["nodeName"] for q in every}
    for q in every:
        assert ms.shm_volume(q).get("hostPath") == {"path": f"/dev/shm/omnistage/{p.namespace}/{p.name}",
                                                    "type": "DirectoryOrCreate"}, ms.shm_volume(q)
    cm = kubectl.json("get", "configmap", f"{p.name}-config", "-n", p.namespace)
    deploy = yaml.safe_load(cm["data"]["deploy.yaml"])
    assert {c["name"] for c in deploy["connectors"].values()} == {"SharedMemoryConnector"}, deploy["connectors"]
    # What the SharedMemoryConnector relies on: a name created in one pod's /dev/shm is there in the others.
    head_pod = next(q for q in stage_pods if q["metadata"]["labels"].get(L_ROLE) == "head")
    probe, token = f"/dev/shm/omnistage-gpu-probe-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    pl.exec_in(kubectl, p.namespace, head_pod, "sh", "-c", f"echo {token} > {probe}")
    try:
        for q in every:
            seen = pl.exec_in(kubectl, p.namespace, q, "cat", probe, check=False)
            assert seen.stdout.strip() == token, f"{q['metadata']['name']} does not see {probe}: {seen.stderr}"
    finally:
        pl.exec_in(kubectl, p.namespace, head_pod, "rm", "-f", probe, check=False)


def test_spoken_answers_over_shared_memory(kubectl, same_node, settings, speech_results):
    pl.spoken_answers(kubectl, same_node, ms.SAME_NODE, settings.multistage_clients, speech_results)


def test_thinker_text_is_the_same_over_the_network_and_what_the_network_costs(speech_results, settings):
    net, shm = speech_results.get(ms.NETWORK, {}), speech_results.get(ms.SAME_NODE, {})
    if "texts" not in net or "texts" not in shm:
        pytest.skip("needs both runs' answers (OMNISTAGE_GPU_MULTISTAGE=1, neither answer test failed)")
    rows = [("", "network", "sameNode")]
    for key, label in (("seconds_to_ready", "time to Ready (s)"),):
        rows.append((label, f"{net.get(key, 0):.0f}", f"{shm.get(key, 0):.0f}"))
    for part, label in (("sequential", "one request at a time"), ("burst", f"{settings.multistage_clients} clients")):
        for key in ("median_s", "per_second", "failed"):
            rows.append((f"{label}: {key}", str(net[part][key]), str(shm[part][key])))
    print("[gpu] the speech pipeline, network against sameNode:\n" + "\n".join(f"  {a:<36} {b:>10} {c:>10}"
                                                                             for a, b, c in rows))
    # The thinker (stage 0) never reads what the connectors carry: at temperature 0, one request at a
    # time on the same GPUs, its text must not depend on the transport.
    assert ms.text_differences(shm["texts"], net["texts"]) == []
