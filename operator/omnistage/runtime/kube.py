"""The one Kubernetes client the operator uses (the official `kubernetes` package): its construction
(in-cluster or kubeconfig, every request counted), the API objects of each group, and the few
idempotent verbs the reconcile loop needs on top of it: the OmniStage and its status, Events, the
membership Secrets and pods (read, create, delete, patch). A child's apply, compared whole and
restored exactly, is drift.py's; the leader's Lease, lease.py's."""

from __future__ import annotations

import json
import logging
from functools import cache
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .. import api
from ..api.conditions import timestamp
from ..names import EVENT_SOURCE
from . import metrics

log = logging.getLogger(__name__)


@cache
def api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    api = client.ApiClient()
    send = api.rest_client.request

    def counted(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        # What the operator costs the API server, visible to whoever runs it (and to bench_fleet).
        metrics.API_REQUESTS.labels(*request_kind(method, url, kwargs.get("query_params"))).inc()
        return send(method, url, *args, **kwargs)

    api.rest_client.request = counted
    return api


def request_kind(method: str, url: str, query: Any = None) -> tuple[str, str]:
    """(verb, resource) of one API request, as the API server's apiserver_request_total names them:
    GET /api/v1/namespaces/ns/pods -> ("list", "pods"); ...?watch=true -> ("watch", "pods")."""
    path = urlsplit(url).path.strip("/").split("/")
    rest = path[2:] if path[:1] == ["api"] else path[3:]  # drop api/v1 or apis/GROUP/VERSION
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource, named = (rest[0] if rest else ""), len(rest) > 1
    params = dict(query or []) | dict(parse_qsl(urlsplit(url).query))
    if str(params.get("watch", "")).lower() == "true":
        return "watch", resource
    verb = {"GET": "get" if named else "list", "POST": "create", "PUT": "update",
            "PATCH": "patch", "DELETE": "delete"}.get(method.upper(), method.lower())
    return verb, resource


def core() -> client.CoreV1Api:
    return client.CoreV1Api(api_client())


def custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


def networking() -> client.NetworkingV1Api:
    return client.NetworkingV1Api(api_client())


def policy() -> client.PolicyV1Api:
    return client.PolicyV1Api(api_client())


def get_omnistage(namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return custom().get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def patch_status(namespace: str, name: str, status: dict[str, Any],
                 previous: dict[str, Any] | None, plural: str = api.PLURAL) -> dict[str, Any]:
    """An OmniStage's status (or, with plural api.POOL_PLURAL, an OmniStagePool's)."""
    return custom().patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, namespace, plural, name, {"status": merge_patch(previous or {}, status)})


EVENT_MESSAGE_LIMIT = 1024  # what the API server keeps of a message


def post_event(involved: dict[str, Any], etype: str, reason: str, message: str, count: int = 1,
               first_timestamp: str | None = None) -> None:
    """One core/v1 Event on `involved` (apiVersion, kind, metadata name/namespace/uid). Posted
    through this client, not kopf's, so an Event does not depend on a kopf handler having run first
    (the watch-fed store queues passes before kopf delivers its first event). `count` and
    `first_timestamp`: the occurrences it stands for (events.py aggregates repeats). Never raises:
    an Event is not worth a failed pass."""
    meta = involved["metadata"]
    now = timestamp()
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved["apiVersion"],
            "kind": involved["kind"],
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": etype,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": EVENT_SOURCE},
        "firstTimestamp": first_timestamp or now,
        "lastTimestamp": now,
        "count": count,
    }
    try:
        core().create_namespaced_event(meta["namespace"], body, _request_timeout=10)
    except Exception as err:  # noqa: BLE001 -- a terminating namespace, an API hiccup: say it in the log
        log.warning("%s/%s: Event %s not posted (%s): %s", meta["namespace"], meta["name"], reason,
                    getattr(err, "status", type(err).__name__), message)


def reason_of(err: ApiException) -> str:
    """The API server's message of a refused request (its Status body), else the HTTP reason."""
    try:
        return json.loads(err.body or "{}").get("message") or str(err.reason)
    except ValueError:
        return str(err.reason)


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`. A key `new` leaves out is sent
    as null: a plain merge patch keeps it, and so a replaced head's stale bootId once survived
    next to its successor's uid, which read as an engine restart and rolled every replica twice."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        out[k] = merge_patch(old[k], v) if isinstance(v, dict) and isinstance(old.get(k), dict) else v
    return out


def _reader(kind: str):
    return {  # the membership token, and a pod whose create answered 409 (the rest comes from watches)
        "Secret": core().read_namespaced_secret,
        "Pod": core().read_namespaced_pod,
    }[kind]


def _creator(kind: str):
    return {
        "Secret": core().create_namespaced_secret,
        "Pod": core().create_namespaced_pod,
    }[kind]


def group_api(group: str) -> Any:  # the client's API object of a child kind's group (api/child_kinds.py)
    return {"": core, "networking.k8s.io": networking, "policy": policy}[group]()


def read(kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        return api_client().sanitize_for_serialization(_reader(kind)(name, namespace))
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def create(obj: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create, or return the existing object of that name: (object, created). A pod of that name that
    the same controller does not own is not taken for the one asked for: the 409 is raised, saying
    whose it is (act says it in an Event and a condition; the operator adopts no pod it did not make).
    A Secret's callers judge its owner themselves (reconcile.ensure_token, credentials.ensure)."""
    meta = obj["metadata"]
    try:
        made = _creator(obj["kind"])(meta["namespace"], obj)
        return with_kind(api_client().sanitize_for_serialization(made), obj["kind"]), True
    except ApiException as e:
        if e.status != 409:
            raise
        conflict = e
    existing = read(obj["kind"], meta["namespace"], meta["name"])
    if existing is None:  # deleted in between; the next reconcile creates it
        raise RuntimeError(f"{obj['kind']} {meta['name']} vanished right after a conflict")
    owner, mine = _controller(existing), _controller(obj) or {}
    if obj["kind"] == "Pod" and (owner or {}).get("uid") != mine.get("uid"):
        whose = (
            f"its controller is {owner.get('kind')} {owner.get('name')} (uid {owner.get('uid')})"
            if owner
            else "it has no controller"
        )
        conflict.body = json.dumps(
            {
                "message": (
                    f"pod {meta['name']} already exists and is not {mine.get('kind')} {mine.get('name')}'s: "
                    f"{whose}. The operator does not adopt a pod it did not make (it would count it, and "
                    f"send its head the membership token); delete or rename pod {meta['name']} and the "
                    "operator creates its own"
                )
            }
        )
        raise conflict
    return with_kind(existing, obj["kind"]), False


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object's controller ownerReference, if any."""
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def with_kind(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    """A typed response's object with its kind, which the client leaves out."""
    return {**obj, "kind": obj.get("kind") or kind}


def delete_pod(namespace: str, name: str, uid: str | None = None) -> dict[str, Any] | None:
    """Delete a pod (only the incarnation `uid`, when given) with its own grace period: the pod as
    the deletion left it (deletionTimestamp set), or None when it was already gone."""
    body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid) if uid else None)
    try:
        gone = core().delete_namespaced_pod(name, namespace, body=body)
    except ApiException as e:
        if e.status in (404, 409):
            return None
        raise
    out = api_client().sanitize_for_serialization(gone)
    return with_kind(out, "Pod") if isinstance(out, dict) and out.get("metadata", {}).get("uid") else None


def patch_pod_condition(namespace: str, name: str, uid: str, ctype: str, status: bool, reason: str,
                        message: str = "") -> dict[str, Any] | None:
    """Set one condition of the pod's status (strategic merge: conditions merge by type, so the
    kubelet's own stay). Only that incarnation (uid); None when it is gone."""
    condition = {"type": ctype, "status": "True" if status else "False", "reason": reason, "message": message,
                 "lastTransitionTime": timestamp()}
    try:
        pod = core().patch_namespaced_pod_status(name, namespace, {"metadata": {"uid": uid},
                                                                   "status": {"conditions": [condition]}})
    except ApiException as e:
        if e.status in (404, 409, 422):
            return None
        raise
    return with_kind(api_client().sanitize_for_serialization(pod), "Pod")


def patch_pod_labels(namespace: str, name: str, uid: str,
                     labels: dict[str, str | None]) -> dict[str, Any] | None:
    """Labels of this incarnation of the pod only (a uid precondition: a same-name successor is not
    touched); None when it is gone (a dead head that a spare took over from may be, by then)."""
    try:
        pod = core().patch_namespaced_pod(name, namespace, {"metadata": {"labels": labels, "uid": uid}})
    except ApiException as e:
        if e.status in (404, 409):
            return None
        raise
    return with_kind(api_client().sanitize_for_serialization(pod), "Pod")


def patch_pod_annotations(namespace: str, name: str,
                          annotations: dict[str, str | None]) -> dict[str, Any] | None:
    """None when the pod is gone (deleted since the pass read it: nothing left to annotate)."""
    try:
        pod = core().patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return with_kind(api_client().sanitize_for_serialization(pod), "Pod")
