"""Invariants of the rendered children that every scenario must keep."""

import base64
import copy
import re

import pytest
import yaml
from omnistage.names import A_HEAD_UID, A_TEMPLATE_HASH, ROLE_SPARE_HEAD, ROLE_STANDBY
from omnistage.render import render_children, render_head_pod, render_replica_pod, selector, target_from

from tests.support.repo import SAMPLE

HEAD_IP, HEAD_UID = "127.77.0.10", "uid-1"


def target(**spec):
    obj = copy.deepcopy(SAMPLE)
    obj["spec"].update(spec)
    obj["metadata"].update(namespace="serving", uid="ost-uid")
    return target_from(obj)


def args_of(pod):
    return pod["spec"]["containers"][0]["args"]


def flag(args, name):
    return args[args.index(name) + 1]


def test_engine_pods_request_h200_gpus_and_shm():
    t = target(replicas=3)
    for pod in [render_head_pod(t), render_replica_pod(t, 1, HEAD_IP, HEAD_UID)]:
        spec = pod["spec"]
        assert spec["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]
        assert pod["metadata"]["ownerReferences"][0]["uid"] == "ost-uid"


def _cache_and_storage(pod):
    cache = next(v for v in pod["spec"]["volumes"] if v["name"] == "cache")
    return cache["emptyDir"], pod["spec"]["containers"][0]["resources"]["requests"].get("ephemeral-storage")


def test_weights_downloaded_into_the_pod_are_bounded_and_requested():
    """Without spec.modelVolume the download fills the cache emptyDir: the scheduler must find the
    room (request) and the kubelet evict an outgrowing pod rather than fill the node's disk (sizeLimit)."""
    t = target(replicas=2)
    for pod in [render_head_pod(t), render_replica_pod(t, 1, HEAD_IP, HEAD_UID)]:
        assert _cache_and_storage(pod) == ({"sizeLimit": "100Gi"}, "100Gi")
    assert _cache_and_storage(render_head_pod(target(downloadVolumeSize="200Gi"))) == (
        {"sizeLimit": "200Gi"},
        "200Gi",
    )
    mounted = target(modelVolume={"pvc": {"claimName": "weights"}}, downloadVolumeSize="200Gi")
    assert _cache_and_storage(render_head_pod(mounted)) == ({}, None)


def test_head_binds_master_on_its_pod_ip_and_replicas_dial_it():
    t = target(replicas=2)
    head_args = args_of(render_head_pod(t))
    assert flag(head_args, "--omni-master-address") == "$(POD_IP)"
    assert flag(head_args, "--stage-id") == "0" and "--headless" not in head_args
    replica = render_replica_pod(t, 1, HEAD_IP, HEAD_UID)
    r_args = args_of(replica)
    assert "--headless" in r_args
    assert flag(r_args, "--omni-master-address") == HEAD_IP
    assert flag(r_args, "--omni-master-port") == flag(head_args, "--omni-master-port")
    assert flag(r_args, "--deploy-config") == flag(head_args, "--deploy-config")
    assert replica["metadata"]["annotations"][A_HEAD_UID] == HEAD_UID


def test_static_single_replica_runs_a_local_runtime():
    t = target(replicas=1, membership="static")
    assert "--stage-id" not in args_of(render_head_pod(t))
    assert render_children(t, "tok", HEAD_IP, HEAD_UID).replicas == []
    with pytest.raises(ValueError):
        render_replica_pod(t, 1, HEAD_IP, HEAD_UID)


def test_heartbeat_timeout_is_the_distributed_head_s_alone():
    """The coordinator runs in the head: only a distributed head takes --omni-heartbeat-timeout."""
    assert flag(args_of(render_head_pod(target(replicas=2))), "--omni-heartbeat-timeout") == "30"
    t = target(replicas=2, engine={"heartbeatTimeoutSeconds": 90})
    assert flag(args_of(render_head_pod(t)), "--omni-heartbeat-timeout") == "90"
    assert "--omni-heartbeat-timeout" not in args_of(render_replica_pod(t, 1, HEAD_IP, HEAD_UID))
    static = target(replicas=1, membership="static", engine={"heartbeatTimeoutSeconds": 90})
    assert "--omni-heartbeat-timeout" not in args_of(render_head_pod(static))


@pytest.mark.parametrize("bad", [4, 591, 600])
def test_heartbeat_timeout_out_of_range_is_refused_naming_the_field(bad):
    from omnistage.api.validation import InvalidSpec
    with pytest.raises(InvalidSpec, match="heartbeatTimeoutSeconds"):
        target(replicas=2, engine={"heartbeatTimeoutSeconds": bad})


@pytest.mark.parametrize(("membership", "replicas"), [("dynamic", 2), ("static", 1)])
def test_head_liveness_asks_whether_its_own_engine_lives(membership, replicas):
    from omnistage_engine_patches import contract
    t = target(replicas=replicas, membership=membership)
    head = render_head_pod(t)["spec"]["containers"][0]
    assert head["livenessProbe"] == {"httpGet": {"path": contract.LIVE_PATH, "port": "http"},
                                     "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3}
    assert "http" in [p["name"] for p in head["ports"]]
    if replicas > 1:  # replicas serve no HTTP: nothing to probe
        assert "livenessProbe" not in render_replica_pod(t, 1, HEAD_IP, HEAD_UID)["spec"]["containers"][0]


def test_one_replica_pod_per_extra_replica():
    children = render_children(target(replicas=4), "tok", HEAD_IP, HEAD_UID)
    assert [p["metadata"]["name"] for p in children.replicas] == [
        "qwen3-omni-replica-1", "qwen3-omni-replica-2", "qwen3-omni-replica-3"]


def selects(expression: str, labels: dict[str, str]) -> bool:
    """A label selector's `k=v` and `k notin (v)` terms, as this selector writes them (the real parse:
    `kubectl scale` on the stand-in cluster tier, which refuses `!=` in a scale selector)."""
    def term(t: str) -> bool:
        if " notin (" in t:
            k, values = t.split(" notin (")
            return labels.get(k) not in values.rstrip(")").split(",")
        k, v = t.split("=")
        return labels.get(k) == v
    return all(term(t) for t in re.split(r",(?![^()]*\))", expression))


def test_selector_matches_head_and_replicas_only():
    """Not a standby (spec.standby): spec.replicas, status.replicas and an HPA count serving pods only.
    On main's selector (no role term) the standby matched."""
    t = target(replicas=2, standby=1)
    children = render_children(t, "tok", HEAD_IP, HEAD_UID)
    for pod in [children.head, *children.replicas]:
        assert selects(selector(t), pod["metadata"]["labels"])
    standby = render_replica_pod(t, 1, HEAD_IP, HEAD_UID, role=ROLE_STANDBY)
    assert standby["metadata"]["annotations"][A_TEMPLATE_HASH] == \
        children.replicas[0]["metadata"]["annotations"][A_TEMPLATE_HASH]  # its role is not in its hash
    spare = render_head_pod(t, "qwen3-omni-head-abcdef", ROLE_SPARE_HEAD)  # spec.head.standby's
    for other in [standby, spare, children.configmap, children.api_service, children.secret]:
        assert not selects(selector(t), other["metadata"]["labels"])


def test_config_change_changes_every_pod_hash():
    before, after = target(replicas=2), target(replicas=2, cache={"mode": "disabled"})
    for render in (render_head_pod, lambda t: render_replica_pod(t, 1, HEAD_IP, HEAD_UID)):
        assert render(before)["metadata"]["annotations"][A_TEMPLATE_HASH] != \
            render(after)["metadata"]["annotations"][A_TEMPLATE_HASH]


def test_scaling_does_not_change_pod_hashes():
    """kubectl scale must add or remove replicas, not roll the ones that serve."""
    two, five = target(replicas=2), target(replicas=5)
    assert render_head_pod(two)["metadata"]["annotations"] == render_head_pod(five)["metadata"]["annotations"]
    assert render_replica_pod(two, 1, HEAD_IP, HEAD_UID) == render_replica_pod(five, 1, HEAD_IP, HEAD_UID)


def test_a_new_head_is_recorded_on_a_replica_but_is_not_its_template():
    """Which head a replica is bound to is read from its annotations (control/rollout.retire_stale,
    control/reattach.py), not from its template hash: one that re-attached is not outdated."""
    t = target(replicas=2)
    a = render_replica_pod(t, 1, HEAD_IP, HEAD_UID)["metadata"]["annotations"]
    b = render_replica_pod(t, 1, "127.77.0.11", "uid-2")["metadata"]["annotations"]
    assert a[A_HEAD_UID] != b[A_HEAD_UID] and a[A_TEMPLATE_HASH] == b[A_TEMPLATE_HASH]


def test_processor_only_is_rendered_for_the_engine_plugin():
    t = target(replicas=2)
    cm = render_children(t, "tok", HEAD_IP, HEAD_UID).configmap
    stage0 = yaml.safe_load(cm["data"]["deploy.yaml"])["stages"][0]
    assert stage0["mm_processor_cache_gb"] == 4 and stage0["num_replicas"] == 1
    env = {e["name"]: e.get("value") for e in render_head_pod(t)["spec"]["containers"][0]["env"]}
    assert env["OMNISTAGE_FRONTEND_CACHE"] == "processor-only"
    assert "vllm_omni_register_models" in env["VLLM_PLUGINS"].split(",")


@pytest.mark.parametrize(("membership", "replicas"), [("dynamic", 2), ("static", 1)])
def test_replica_aware_is_rendered_for_the_engine_plugin(membership, replicas):
    """Opt-in replica-aware: the same deploy-config keys as processor-only (the mirrors take the
    replicas' receiver capacity from mm_processor_cache_gb) and the mode in the head's env."""
    t = target(replicas=replicas, membership=membership, cache={"mode": "replica-aware", "sizeGiB": 2})
    assert str(t.cache.mode) == "replica-aware" and "replica-aware requested" in t.cache.reason
    stage0 = yaml.safe_load(render_children(t, "tok", HEAD_IP, HEAD_UID).configmap["data"]["deploy.yaml"])[
        "stages"
    ][0]
    assert (stage0["mm_processor_cache_gb"], stage0["mm_processor_cache_type"]) == (2, "lru")
    env = {e["name"]: e.get("value") for e in render_head_pod(t)["spec"]["containers"][0]["env"]}
    assert env["OMNISTAGE_FRONTEND_CACHE"] == "replica-aware"


def test_network_policy_fences_every_engine_pod_and_admits_only_its_own():
    np = render_children(target(replicas=2), "tok", HEAD_IP, HEAD_UID).network_policy
    own_engines = {"matchLabels": {"serving.omnistage.io/omnistage": "qwen3-omni"},
                   "matchExpressions": [{"key": "serving.omnistage.io/component", "operator": "In",
                                         "values": ["engine", "pool"]}]}
    # The replicas are selected too: their listeners (--omni-replica-address) are unauthenticated.
    assert np["spec"]["podSelector"] == own_engines
    http_rule, membership_rule, engine_rule = np["spec"]["ingress"]
    # Everyone: the head's OpenAI API only, by its port's name.
    assert "from" not in http_rule and http_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    # The membership port (issue 27 item 6): the operator's namespace and the OmniStage's own pods.
    assert membership_rule["ports"] == [{"port": "membership", "protocol": "TCP"}]
    assert membership_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "omnistage-system"}}},
        {"podSelector": own_engines}]
    # Engine to engine: every port (vllm-omni's coordinator and per-replica sockets are on random ports).
    assert engine_rule == {"from": [{"podSelector": own_engines}]}


def test_the_network_policy_names_the_namespace_the_operator_runs_in(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "platform-operators")
    np = render_children(target(replicas=2), "tok", HEAD_IP, HEAD_UID).network_policy
    assert np["spec"]["ingress"][1]["from"][0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "platform-operators"}}}


def test_membership_is_on_its_own_port_and_replicas_hold_only_their_own_credential():
    """Issue 27 item 6: the head's membership port is a container port of its own (the plugin serves
    the token routes there, not on the OpenAI port); a replica pod mounts a Secret with its own
    credential, never the master token, which only the head mounts."""
    from omnistage_engine_patches import contract

    children = render_children(target(replicas=3), "master-token", HEAD_IP, HEAD_UID)
    head = children.head["spec"]["containers"][0]
    assert head["ports"][-1] == {"name": "membership", "containerPort": 8090, "protocol": "TCP"}
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env[contract.MEMBERSHIP_PORT_ENV] == "8090"
    assert [v["secret"]["secretName"] for v in children.head["spec"]["volumes"] if "secret" in v] == [
        "qwen3-omni-membership"]
    assert children.secret["metadata"]["name"] == "qwen3-omni-membership"
    for pod, cred in zip(children.replicas, children.credentials, strict=True):
        name = pod["metadata"]["name"]
        mounted = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v]
        assert mounted == [f"{name}-membership"] == [cred["metadata"]["name"]]
        token = base64.b64decode(cred["data"]["token"]).decode()
        assert token == contract.pod_credential("master-token", name) and "master-token" not in token
        assert contract.credential_pod("master-token", token) == name
        assert cred["metadata"]["ownerReferences"] == children.secret["metadata"]["ownerReferences"]


def test_master_service_publishes_not_ready_head():
    svc = render_children(target(replicas=2), "tok", HEAD_IP, HEAD_UID).master_service
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
