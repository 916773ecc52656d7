"""Head and replica pods. Operator-managed pods (not a StatefulSet) so the operator picks which
replica leaves and tells the engine before deleting it."""

from __future__ import annotations

import copy
from typing import Any

from omnistage_engine_patches import contract

from ..api import EnvVar, GpuSpec, PlacementSpec, TransportMode, TransportProtocol, podtemplate
from ..api.podtemplate import (
    CACHE_DIR,
    CONFIG_DIR,
    ENGINE_CONTAINER,
    POD_IP_ENV,
    PORT_HTTP,
    PORT_MASTER,
    SHM_DIR,
    TOKEN_DIR,
    V_CACHE,
    V_CONFIG,
    V_MODEL,
    V_SHM,
    V_TOKEN,
    VLLM_HOST_IP_ENV,
)
from ..names import (
    A_CONFIG_HASH,
    A_HEAD_RESTARTS,
    A_HEAD_UID,
    A_REPLICA_INDEX,
    A_STAGE_IDS,
    A_TEMPLATE_HASH,
    C_JOINED,
    L_OMNISTAGE,
    L_ROLE,
    MEMBERSHIP_SECRET,
    ROLE_HEAD,
    ROLE_POOL,
    ROLE_REPLICA,
)
from .commands import head_args, pool_args, replica_args
from .common import Pool, Target, config_hash, content_hash, labels, metadata
from .config import deploy_yaml
from .hardening import POD_SECURITY_CONTEXT, container_security_context, harden
from .stages import transport

TOKEN_KEY = "token"
# Host CPU and memory each engine container requests per GPU it holds (spec.template overrides
# either). Sized for a 30B model such as Qwen3-Omni-30B-A3B on one H200: the API server, the
# multimodal processor (media decoding, the frontend cache) and the engine core, which busy-polls a
# core, want several cores; ~60 GB of bf16 weights pass through host memory while loading, next to
# the processor and receiver caches and torch/CUDA's own footprint. Requests without limits: the pod
# is Burstable, not BestEffort (first to be evicted under memory pressure), and a memory limit would
# turn a loading spike into an OOM kill. An 8-GPU H200 node (~2 TB, ~200 cores) fits 8 such pods.
CPU_REQUEST_PER_GPU = 8
MEMORY_REQUEST_GIB_PER_GPU = 64
# vLLM loads only allow-listed plugins when VLLM_PLUGINS is set; vllm-omni's own entry must stay in.
VLLM_PLUGINS = f"vllm_omni_register_models,{contract.GENERAL_PLUGIN},{contract.ENDPOINT_PLUGIN}"
# A pool pod runs one headless `vllm serve --stage-id K` per stage under this supervisor (in the
# engine plugin's package), which exits when any of them exits: the pod then fails and is replaced.
STAGE_SUPERVISOR = ["python3", "-m", "omnistage_engine_patches.stages"]
PRESTOP = ["python3", "-m", "omnistage_engine_patches.prestop"]
# What an engine pod's grace period leaves after the drain for vLLM's own shutdown; a pod deleted by
# someone else is drained for what remains of its grace minus this (control/membership.sync).
SHUTDOWN_SECONDS = 30
# UCX over TCP unless the transport's env says otherwise: sm and self for the stages sharing a pod.
UCX_TLS_TCP = "tcp,sm,self"
# sameNode: the host directory every engine pod of an OmniStage mounts as /dev/shm, so the
# SharedMemoryConnector's POSIX shm names resolve to the same files in every pod.
SAME_NODE_SHM_ROOT = "/dev/shm/omnistage"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
JOINED_GATE = {"conditionType": C_JOINED}
UNBOUND = "<head>"  # the head address and uid a replica's template hash is computed for


def head_pod_name(t: Target, template_hash: str | None = None) -> str:
    """NAME-head; a successor started beside a staying head takes its template hash as a suffix."""
    return t.child_name("head" if template_hash is None else f"head-{template_hash[:6]}")


def replica_pod_name(t: Target, index: int) -> str:
    return t.child_name(f"replica-{index}")


def credential_secret_name(pod_name: str) -> str:
    """POD-membership: a replica or pool pod's own credential (contract.pod_credential), which it
    mounts where a head mounts the master token. The suffix is the master Secret's, so every rule
    that keeps specs off `*-membership` Secrets keeps them off these too; a name that collides with
    another OmniStage's master Secret is refused by ownership (runtime/credentials.py)."""
    return f"{pod_name}-{MEMBERSHIP_SECRET}"


def _env(t: Target, role: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # vLLM otherwise finds its address with a UDP route probe; the pod IP is the right answer.
        {"name": VLLM_HOST_IP_ENV, "value": f"$({POD_IP_ENV})"},
        {"name": contract.VLLM_PLUGINS_ENV, "value": VLLM_PLUGINS},
        {"name": "VLLM_CACHE_ROOT", "value": f"{CACHE_DIR}/vllm"},
    ]
    if role == ROLE_HEAD:
        env += [
            {"name": contract.TOKEN_FILE_ENV, "value": f"{TOKEN_DIR}/{TOKEN_KEY}"},
            # The plugin serves the membership routes on this port alone (not on --port).
            {"name": contract.MEMBERSHIP_PORT_ENV, "value": str(t.spec.engine.membership_port)},
            # The engine plugin builds exactly this stage-0 frontend cache and reports what it built.
            {"name": contract.FRONTEND_CACHE_ENV, "value": str(t.cache.mode)},
            {"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": str(t.spec.engine.startup_timeout_seconds)},
            # vLLM's build_app lowers the root logger to ERROR unless this is set, which would
            # hide the engine plugin's "patch applied / no-op" lines.
            {"name": "SAGEMAKER_CONTAINER_LOG_LEVEL", "value": "INFO"},
        ]
        if t.distributed:
            # A replica gets traffic only once the operator has joined it, i.e. once the engine's
            # report proved the cache guarantee (CacheConsistent).
            env.append({"name": contract.ROUTE_JOINED_ONLY_ENV, "value": "1"})
    elif role == ROLE_REPLICA:  # where its engine finds a head pod that replaced its own (patch reattach)
        env.append({"name": contract.MASTER_SERVICE_ENV,
                    "value": f"{t.child_name('master')}.{t.namespace}.svc"})
    return env + _transport_env(t) + [_user_env(v) for v in t.spec.engine.env]


def _transport_env(t: Target) -> list[dict[str, Any]]:
    """Every engine pod of a multi-stage pipeline: connector ports without the replica term (each
    pod has its own network namespace; the head computes its replicas' ports the same way), and
    the transport's UCX settings."""
    if not t.spec.stages:
        return []
    tr = transport(t)
    env = [{"name": contract.CONNECTOR_PORTS_ENV, "value": contract.PORTS_PER_POD}]
    if tr.mode == TransportMode.NETWORK and tr.protocol == TransportProtocol.TCP \
            and all(v.name != "UCX_TLS" for v in tr.env):
        env.append({"name": "UCX_TLS", "value": UCX_TLS_TCP})
    return env + [_user_env(v) for v in tr.env]


def same_node(t: Target) -> bool:
    return bool(t.spec.stages) and transport(t).mode == TransportMode.SAME_NODE


def _user_env(v: EnvVar) -> dict[str, Any]:
    if v.value_from is not None:
        return {"name": v.name, "valueFrom": v.value_from}
    return {"name": v.name, "value": v.value}


def _cache_volume(t: Target) -> dict[str, Any]:
    """Without spec.modelVolume the weights download into the cache volume: bounded then (with a
    volume the cache holds only vLLM's compile caches, left unbounded as before)."""
    return {} if t.spec.model_volume is not None else {"sizeLimit": t.spec.download_volume_size}


def _volumes(t: Target, role: str, pod_name: str) -> tuple[list[dict], list[dict]]:
    volumes = [
        {"name": V_CONFIG, "configMap": {"name": t.child_name("config")}},
        {
            "name": V_SHM,
            "hostPath": {"path": f"{SAME_NODE_SHM_ROOT}/{t.namespace}/{t.name}", "type": "DirectoryOrCreate"},
        }
        if same_node(t)
        else {"name": V_SHM, "emptyDir": {"medium": "Memory", "sizeLimit": t.spec.shm_size}},
        {"name": V_CACHE, "emptyDir": _cache_volume(t)},
    ]
    mounts = [
        {"name": V_CONFIG, "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": V_SHM, "mountPath": SHM_DIR},
        {"name": V_CACHE, "mountPath": CACHE_DIR},
    ]
    # A head: the master token, which its membership endpoint checks (and derives the pods'
    # credentials from). A replica or pool pod, which runs model code: only its own credential, with
    # which its preStop hook makes itself leave, and nothing else (contract.pod_credential).
    secret = t.child_name(MEMBERSHIP_SECRET) if role == ROLE_HEAD else credential_secret_name(pod_name)
    volumes.append({"name": V_TOKEN, "secret": {"secretName": secret}})
    mounts.append({"name": V_TOKEN, "mountPath": TOKEN_DIR, "readOnly": True})
    mv = t.spec.model_volume
    if mv is not None:
        if mv.pvc is not None:
            volumes.append({"name": V_MODEL, "persistentVolumeClaim": {
                "claimName": mv.pvc.claim_name, "readOnly": mv.pvc.read_only}})
        else:
            volumes.append({"name": V_MODEL, "hostPath": {"path": mv.host_path.path, "type": "Directory"}})
        mounts.append({"name": V_MODEL, "mountPath": mv.mount_path, "readOnly": True})
    return volumes, mounts


def _leave_on_stop(
    t: Target, head_ip: str, drain: int, stage_ids: list[int]
) -> tuple[list[dict[str, Any]], dict]:
    """A replica or pool pod's preStop hook (omnistage_engine_patches.prestop) and what it reads:
    whoever deletes the pod (an eviction, a node drain, kubectl delete), the kubelet first has the
    head stop routing to it and drain it, up to the drain timeout, even with the operator down."""
    env = [{"name": contract.HEAD_URL_ENV, "value": f"http://{head_ip}:{t.spec.engine.membership_port}"},
           {"name": contract.DRAIN_SECONDS_ENV, "value": str(drain)},
           {"name": contract.TOKEN_FILE_ENV, "value": f"{TOKEN_DIR}/{TOKEN_KEY}"}]
    hook = {
        "preStop": {"exec": {"command": [*PRESTOP, *(a for k in stage_ids for a in ("--stage-id", str(k)))]}}
    }
    return env, hook


def _pod_spec(t: Target, role: str, args: list[str], pool: Pool | None = None, head_ip: str = "",
              name: str = "") -> dict[str, Any]:
    s = t.spec
    gpu: GpuSpec = pool.spec.gpu if pool else s.gpu
    placement: PlacementSpec = pool.spec.placement if pool else s.placement
    drain = pool.spec.drain_timeout_seconds if pool else s.engine.drain_timeout_seconds
    volumes, mounts = _volumes(t, role, name)
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": t.engine_image,
        "command": STAGE_SUPERVISOR if role == ROLE_POOL else ["vllm"],
        "args": args,
        "env": _env(t, role),
        "resources": {
            "limits": {gpu.resource: str(gpu.count)},
            "requests": {
                "cpu": str(CPU_REQUEST_PER_GPU * gpu.count),
                "memory": f"{MEMORY_REQUEST_GIB_PER_GPU * gpu.count}Gi",
                **({} if s.model_volume is not None else {"ephemeral-storage": s.download_volume_size}),
            },
        },
        "volumeMounts": mounts,
        "securityContext": container_security_context(),
    }
    if s.engine.image_pull_policy:
        container["imagePullPolicy"] = s.engine.image_pull_policy
    if role != ROLE_HEAD:
        env, container["lifecycle"] = _leave_on_stop(
            t, head_ip, drain, list(pool.spec.stage_ids) if pool else [0]
        )
        container["env"] = container["env"] + env
    if role == ROLE_HEAD:
        port = s.engine.http_port
        # Its own requests answered before SIGTERM (it is out of the Services once deleted): what
        # makes deleting the old head of a head change lose nothing (control/headswap.py).
        container["env"] = container["env"] + [
            {"name": contract.HEAD_URL_ENV, "value": f"http://$({POD_IP_ENV}):{s.engine.membership_port}"},
            {"name": contract.API_URL_ENV, "value": f"http://$({POD_IP_ENV}):{port}"},
            {"name": contract.DRAIN_SECONDS_ENV, "value": str(drain)}]
        container["lifecycle"] = {"preStop": {"exec": {"command": [*PRESTOP, "--head"]}}}
        container["ports"] = [
            {"name": PORT_HTTP, "containerPort": port, "protocol": "TCP"},
            {"name": PORT_MASTER, "containerPort": s.engine.master_port, "protocol": "TCP"},
            {"name": contract.MEMBERSHIP_PORT_NAME, "containerPort": s.engine.membership_port,
             "protocol": "TCP"},
        ]
        # /health is 503 while any stage has no live engine (engine_liveness leaves a silent one out):
        # readiness means "this head can route a request", and the operator still reads a head that
        # is not Ready once it started (control/pods.answers). Fatal as liveness (restarting the head
        # restarts every replica). Liveness asks the plugin's LIVE_PATH, 503 only
        # once the head's own stage-0 engine is gone (nothing else restarts an in-head engine); it is
        # answered off the engine's loop, and 10 s per probe so a busy machine does not fail it.
        container["startupProbe"] = {"httpGet": {"path": "/health", "port": PORT_HTTP}, "periodSeconds": 10,
                                     "failureThreshold": max(1, s.engine.startup_timeout_seconds // 10)}
        container["readinessProbe"] = {"httpGet": {"path": "/health", "port": PORT_HTTP}, "periodSeconds": 5,
                                       "failureThreshold": 3}
        container["livenessProbe"] = {"httpGet": {"path": contract.LIVE_PATH, "port": PORT_HTTP},
                                      "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 3}
    tolerations = [_gpu_toleration(gpu), *placement.tolerations]
    spec: dict[str, Any] = {
        "restartPolicy": "Always" if role == ROLE_HEAD else "Never",
        "containers": [container],
        "volumes": volumes,
        "nodeSelector": {gpu.product_label: gpu.product, **placement.node_selector},
        "tolerations": tolerations,
        # The drain (the operator's leave, or the preStop hook's), then room for vLLM's own shutdown.
        "terminationGracePeriodSeconds": drain + SHUTDOWN_SECONDS,
        "enableServiceLinks": False,
        # The engine never calls the API: no ServiceAccount token in its pods unless spec.template asks.
        "automountServiceAccountToken": False,
        "securityContext": copy.deepcopy(POD_SECURITY_CONTEXT),
    }
    if role != ROLE_HEAD:
        # Ready only once joined: a headless replica has no HTTP port a probe could ask, and what
        # makes it serve is the head's join, which only the operator knows (names.C_JOINED).
        spec["readinessGates"] = [dict(JOINED_GATE)]
    affinity = _with_head_node(t, role, placement.affinity)
    if affinity:
        spec["affinity"] = affinity
    if placement.priority_class_name:
        spec["priorityClassName"] = placement.priority_class_name
    if placement.scheduler_name:
        spec["schedulerName"] = placement.scheduler_name
    return spec


def _with_head_node(t: Target, role: str, affinity: dict[str, Any] | None) -> dict[str, Any] | None:
    """sameNode: every other engine pod on the head's node (they share its /dev/shm directory). The
    head goes first (replicas and pool pods are created once it has an IP), so it is the anchor."""
    if not same_node(t) or role == ROLE_HEAD:
        return affinity
    out = copy.deepcopy(affinity or {})
    terms = out.setdefault("podAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    terms.append({"labelSelector": {"matchLabels": {L_OMNISTAGE: t.name, L_ROLE: ROLE_HEAD}},
                  "topologyKey": HOSTNAME_TOPOLOGY})
    return out


def _gpu_toleration(gpu: GpuSpec) -> dict[str, Any]:
    return {"key": gpu.resource, "operator": "Exists", "effect": "NoSchedule"}


def _pod(t: Target, name: str, role: str, spec: dict[str, Any], extra: dict[str, str],
         pool: Pool | None = None) -> dict[str, Any]:
    """The pod from the operator's spec with spec.template merged onto it (strategic merge; what the
    operator owns was refused by validation, so the merge cannot change it)."""
    merged = podtemplate.overlay({"metadata": {"labels": labels(t, role, pool and pool.name)}, "spec": spec},
                                 t.spec.template)
    spec = harden(merged["spec"])  # what the template cannot loosen, put back
    # Tolerations are an atomic list: a template's list replaces the operator's, so the GPU
    # toleration (the operator's, like the GPU limit) is put back.
    toleration = _gpu_toleration(pool.spec.gpu if pool else t.spec.gpu)
    if toleration not in spec.get("tolerations", []):
        spec["tolerations"] = [toleration, *spec.get("tolerations", [])]
    # readinessGates too: a template's own gates are kept, the operator's is put back.
    if role != ROLE_HEAD and JOINED_GATE not in spec.get("readinessGates", []):
        spec["readinessGates"] = [dict(JOINED_GATE), *spec.get("readinessGates", [])]
    overlay_meta = merged.get("metadata") or {}
    annotations = {
        A_CONFIG_HASH: config_hash(deploy_yaml(t)),
        # One hash over the config, the pod spec and the template's labels and annotations: any change
        # rolls the pod. Not the head it is bound to (render_replica_pod hashes it for UNBOUND).
        A_TEMPLATE_HASH: content_hash({"config": deploy_yaml(t), "spec": spec, "metadata": overlay_meta,
                                       "extra": {k: v for k, v in extra.items() if k != A_HEAD_RESTARTS}}),
        **extra,
        **overlay_meta.get("annotations", {}),
    }
    meta = metadata(t, name, role, annotations, overlay_meta.get("labels"), pool and pool.name)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def render_head_pod(t: Target, name: str | None = None, role: str = ROLE_HEAD) -> dict[str, Any]:
    """`name` and `role`: a successor's (control/headswap.py); neither is part of the template hash."""
    pod = _pod(t, name or head_pod_name(t), ROLE_HEAD, _pod_spec(t, ROLE_HEAD, head_args(t)), {})
    pod["metadata"]["labels"][L_ROLE] = role
    return pod


def render_replica_pod(
    t: Target, index: int, head_ip: str, head_uid: str, head_restarts: int = 0, role: str = ROLE_REPLICA
) -> dict[str, Any]:
    """A headless stage-0 replica, bound to the head pod it registers with (its IP in the args, its UID
    in an annotation) and that pod's engine (the head's restart count, in an annotation), until its
    engine re-attaches to another (control/reattach.py). `role`: ROLE_STANDBY for a standby
    (control/standby.py), the same pod otherwise: the role is not part of the template hash, so a
    standby that joins is not rolled."""
    if not t.distributed:
        raise ValueError("a static single-replica OmniStage has no replica pods")
    name = replica_pod_name(t, index)

    def bound_to(ip: str, uid: str) -> dict[str, Any]:
        spec = _pod_spec(t, ROLE_REPLICA, replica_args(t, ip), head_ip=ip, name=name)
        return _pod(t, name, ROLE_REPLICA, spec,
                    {A_HEAD_UID: uid, A_HEAD_RESTARTS: str(head_restarts), A_REPLICA_INDEX: str(index)})
    pod = bound_to(head_ip, head_uid)
    # Its template is the pod bound to no head: one that re-attached to a replaced head pod (another
    # IP and uid in its args and annotations) is not outdated.
    annotations = pod["metadata"]["annotations"]
    annotations[A_TEMPLATE_HASH] = bound_to(UNBOUND, UNBOUND)["metadata"]["annotations"][A_TEMPLATE_HASH]
    pod["metadata"]["labels"][L_ROLE] = role
    return pod



def render_pool_pod(t: Target, pool: Pool, index: int, head_ip: str, head_uid: str,
                    head_restarts: int = 0) -> dict[str, Any]:
    """One pod of an OmniStagePool: a headless replica of each of its stages, bound to one head
    incarnation like a stage-0 replica. Owned by the OmniStage (it goes with its head); the pool
    only says how many there are."""
    spec = _pod_spec(t, ROLE_POOL, pool_args(t, pool, head_ip), pool, head_ip, pool.pod_name(index))
    extra = {A_HEAD_UID: head_uid, A_HEAD_RESTARTS: str(head_restarts), A_REPLICA_INDEX: str(index),
             A_STAGE_IDS: ",".join(map(str, pool.spec.stage_ids))}
    return _pod(t, pool.pod_name(index), ROLE_POOL, spec, extra, pool)
