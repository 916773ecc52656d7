"""The leader's Lease (runtime/leader.py): one coordination.k8s.io/v1 Lease, read, created, replaced
under a resourceVersion precondition, and watched, through the operator's one API client (kube.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from .kube import api_client


def coordination() -> client.CoordinationV1Api:
    return client.CoordinationV1Api(api_client())


def read_lease(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return api_client().sanitize_for_serialization(coordination().read_namespaced_lease(name, namespace))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def _lease_write(write: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
    """A Lease write; None when another replica wrote first (409)."""
    try:
        return api_client().sanitize_for_serialization(write(*args))
    except ApiException as e:
        if e.status == 409:
            return None
        raise


def _lease(namespace: str, name: str, spec: dict[str, Any], **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace, **metadata}, "spec": spec}


def create_lease(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Create the Lease; None when another replica created it first (409)."""
    return _lease_write(coordination().create_namespaced_lease, namespace, _lease(namespace, name, spec))


def replace_lease(
    namespace: str, name: str, resource_version: str, spec: dict[str, Any]
) -> dict[str, Any] | None:
    """Update (PUT) the Lease only if it is still at `resource_version`; None when another replica
    wrote it in between (409). The precondition is what makes two replicas unable to both win."""
    return _lease_write(coordination().replace_namespaced_lease, name, namespace,
                        _lease(namespace, name, spec, resourceVersion=resource_version))


def watch_lease(namespace: str, name: str, resource_version: str, idle_timeout: float
                ) -> Iterator[dict[str, Any] | None]:
    """The Lease's changes after `resource_version` (None: deleted), from one watch that the server
    ends after 5 minutes. A watch that delivers nothing for `idle_timeout` s raises urllib3's
    ReadTimeoutError: that silence is what a follower waits for."""
    w = watch.Watch()
    try:
        for event in w.stream(
            coordination().list_namespaced_lease,
            namespace,
            field_selector=f"metadata.name={name}",
            resource_version=resource_version,
            timeout_seconds=300,
            _request_timeout=(5, idle_timeout),
        ):
            if event["type"] in ("ADDED", "MODIFIED"):
                yield api_client().sanitize_for_serialization(event["object"])
            elif event["type"] == "DELETED":
                yield None
            elif event["type"] == "ERROR":  # e.g. 410 Gone: the caller reads the Lease afresh
                raise RuntimeError(f"Lease watch error: {event.get('raw_object')}")
    finally:
        w.stop()
