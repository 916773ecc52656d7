"""The one Kubernetes client the operator uses (the official `kubernetes` package), and the few
idempotent verbs the reconcile loop needs on top of it."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from . import api

log = logging.getLogger(__name__)


@cache
def api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def core() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


def networking() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(api_client())


def get_omnistage(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom().get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def list_omnistages(namespace: str | None = None) -> list[dict[str, Any]]:
    if namespace:
        return custom().list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL)["items"]
    return custom().list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL)["items"]


def patch_status(namespace: str, name: str, status: dict[str, Any], previous: dict[str, Any] | None) -> None:
    custom().patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": merge_patch(previous or {}, status)})


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`. A key `new` leaves out is sent
    as null: a plain merge patch keeps it, and so a replaced head's stale bootId once survived
    next to its successor's uid, which read as an engine restart and rolled every replica twice."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        out[k] = merge_patch(old[k], v) if isinstance(v, dict) and isinstance(old.get(k), dict) else v
    return out


def list_pods(namespace: str, selector: str) -> list[dict[str, Any]]:
    pods = core().list_namespaced_pod(namespace, label_selector=selector)
    return [api_client().sanitize_for_serialization(p) for p in pods.items]


def _reader(kind: str):
    return {
        "ConfigMap": core().read_namespaced_config_map,
        "Secret": core().read_namespaced_secret,
        "Service": core().read_namespaced_service,
        "Pod": core().read_namespaced_pod,
        "NetworkPolicy": networking().read_namespaced_network_policy,
    }[kind]


def _creator(kind: str):
    return {
        "ConfigMap": core().create_namespaced_config_map,
        "Secret": core().create_namespaced_secret,
        "Service": core().create_namespaced_service,
        "Pod": core().create_namespaced_pod,
        "NetworkPolicy": networking().create_namespaced_network_policy,
    }[kind]


def _patcher(kind: str):
    return {
        "ConfigMap": core().patch_namespaced_config_map,
        "Service": core().patch_namespaced_service,
        "NetworkPolicy": networking().patch_namespaced_network_policy,
    }[kind]


def read(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return api_client().sanitize_for_serialization(_reader(kind)(name, namespace))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def create(obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create, or return the existing object of that name: (object, created)."""
    meta = obj["metadata"]
    try:
        made = _creator(obj["kind"])(meta["namespace"], obj)
        return api_client().sanitize_for_serialization(made), True
    except ApiException as e:
        if e.status != 409:
            raise
    existing = read(obj["kind"], meta["namespace"], meta["name"])
    if existing is None:  # deleted in between; the next reconcile creates it
        raise RuntimeError(f"{obj['kind']} {meta['name']} vanished right after a conflict")
    return existing, False


def ensure(obj: dict[str, Any], compare: tuple[str, ...]) -> str:
    """Create the object, or patch it when any of the `compare` top-level fields differ.
    Returns "created", "updated" or "unchanged"."""
    existing, created = create(obj)
    if created:
        return "created"
    drift = {k: obj[k] for k in compare if _differs(obj.get(k), existing.get(k))}
    labels_drift = _differs(obj["metadata"].get("labels"), existing["metadata"].get("labels"))
    annotations_drift = _differs(obj["metadata"].get("annotations"), existing["metadata"].get("annotations"))
    if not drift and not labels_drift and not annotations_drift:
        return "unchanged"
    patch = {**drift, "metadata": {k: obj["metadata"][k] for k in ("labels", "annotations") if k in obj["metadata"]}}
    _patcher(obj["kind"])(obj["metadata"]["name"], obj["metadata"]["namespace"], patch)
    return "updated"


def _differs(want: Any, have: Any) -> bool:
    """True when `want` is not contained in `have` (the server adds defaults we do not render)."""
    if isinstance(want, dict):
        return not isinstance(have, dict) or any(_differs(v, have.get(k)) for k, v in want.items())
    if isinstance(want, list):
        return not isinstance(have, list) or len(want) != len(have) or any(
            _differs(w, h) for w, h in zip(want, have))
    return want != have and not (want in (None, {}, []) and have in (None, {}, []))


def delete_pod(namespace: str, name: str, uid: str | None = None, grace_seconds: int | None = None) -> bool:
    """Delete a pod (only the incarnation `uid`, when given). False when it was already gone."""
    body = client.V1DeleteOptions(
        preconditions=client.V1Preconditions(uid=uid) if uid else None,
        grace_period_seconds=grace_seconds,
    )
    try:
        core().delete_namespaced_pod(name, namespace, body=body)
        return True
    except ApiException as e:
        if e.status in (404, 409):
            return False
        raise


def patch_pod_annotations(namespace: str, name: str, annotations: dict[str, str | None]) -> None:
    core().patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})



# ----- leader election (operator/omnistage/leader.py): one coordination.k8s.io/v1 Lease ----------

def coordination() -> client.CoordinationV1Api:
    return client.CoordinationV1Api(api_client())


def read_lease(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return api_client().sanitize_for_serialization(coordination().read_namespaced_lease(name, namespace))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def create_lease(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Create the Lease; None when another replica created it first (409)."""
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}
    try:
        return api_client().sanitize_for_serialization(coordination().create_namespaced_lease(namespace, body))
    except ApiException as e:
        if e.status == 409:
            return None
        raise


def replace_lease(namespace: str, name: str, resource_version: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Update (PUT) the Lease only if it is still at `resource_version`; None when another replica
    wrote it in between (409). The precondition is what makes two replicas unable to both win."""
    body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": resource_version}, "spec": spec}
    try:
        return api_client().sanitize_for_serialization(coordination().replace_namespaced_lease(name, namespace, body))
    except ApiException as e:
        if e.status == 409:
            return None
        raise
