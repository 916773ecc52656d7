"""The one Kubernetes client the operator uses (the official `kubernetes` package), and the few
idempotent verbs the reconcile loop needs on top of it."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, urlsplit

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from .. import api
from ..api.child_kinds import BY_KIND
from ..api.conditions import timestamp
from ..names import EVENT_SOURCE, FIELD_MANAGER
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


def _applier(kind: str):
    return getattr(group_api(BY_KIND[kind].group), f"patch_namespaced_{BY_KIND[kind].client_name}")


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
        return _with_kind(api_client().sanitize_for_serialization(made), obj["kind"]), True
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
    return _with_kind(existing, obj["kind"]), False


def _controller(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The object's controller ownerReference, if any."""
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def _with_kind(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return {**obj, "kind": obj.get("kind") or kind}  # typed responses leave kind out


# ----- children: server-side applied, compared whole, restored exactly -------------------------------

class _Assigned:
    """A value the API server assigns (a Service's clusterIP): any value is the server's."""

    def __repr__(self) -> str:
        return "ASSIGNED"


ASSIGNED = _Assigned()


def _port_of(item: dict[str, Any]) -> Any:
    return item.get("port")


# What the API server adds to a child the operator renders, by kind: the field's path (a list's items
# "[]") -> its default, ASSIGNED (any value), or a function of the object holding it (a Service port's
# targetPort defaults to its port). Any other field the operator did not render is drift, and so is
# one of these with another value: a Service made NodePort, sessionAffinity ClientIP, a selector or a
# NetworkPolicy peer with one more key (`namespaceSelector: {}` admits every namespace). Read from
# Kubernetes 1.36 (tests/unit/test_kube.py holds its answers); a default a later server adds is
# restored once, then left (UNRESTORABLE) and said in a Warning.
SERVER_DEFAULTS: dict[str, dict[tuple[str, ...], Any]] = {
    "Service": {
        ("spec", "type"): "ClusterIP", ("spec", "sessionAffinity"): "None",
        ("spec", "internalTrafficPolicy"): "Cluster",
        ("spec", "clusterIP"): ASSIGNED, ("spec", "clusterIPs"): ASSIGNED,
        ("spec", "ipFamilies"): ASSIGNED, ("spec", "ipFamilyPolicy"): ASSIGNED,
        ("spec", "ports", "[]", "protocol"): "TCP", ("spec", "ports", "[]", "targetPort"): _port_of,
    },
    "NetworkPolicy": {
        ("spec", "policyTypes"): ["Ingress"],
        ("spec", "ingress", "[]", "ports", "[]", "protocol"): "TCP",
    },
    "PodDisruptionBudget": {},
    "ConfigMap": {},
}

# (kind, namespace, name) -> what a restore left as it was (the API server or a webhook puts it back):
# the same drift again is not worth another request (nor a loop: each write is a watch event).
UNRESTORABLE: dict[tuple[str, str, str], frozenset[str]] = {}


class Applied(NamedTuple):
    result: str  # "created" | "updated" | "unchanged"
    obj: dict[str, Any]  # as the API server holds it
    drift: tuple[str, ...] = ()  # what differed from the rendered object ("path: was, not want")
    left: tuple[str, ...] = ()  # what still differs after the write (UNRESTORABLE)


def apply(obj: dict[str, Any], compare: tuple[str, ...], existing: dict[str, Any] | None) -> Applied:
    """A child the operator owns, as rendered: created by server-side apply (one field manager,
    conflicts forced); when `existing` (the watch-fed copy) differs (drifted()), restored. The rendered
    labels and annotations by server-side apply, which leaves other managers' own keys; the `compare`
    fields (a spec, a ConfigMap's data) by a JSON patch that replaces them whole, keeping what the API
    server assigned: apply cannot remove a field another manager set. Unchanged costs no request."""
    if existing is None:
        return Applied("created", _server_side_apply(obj))
    key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
    drift = drifted(obj, existing, compare)
    if not drift or UNRESTORABLE.get(key) == frozenset(drift):
        return Applied("unchanged", existing)
    now = existing
    if any(d.startswith("metadata.") for d in drift):
        now = _server_side_apply(obj)
    if drifted(obj, now, compare):
        now = _replace(obj, now, compare)
    left = drifted(obj, now, compare)  # verified on the API server's answer
    if left:
        UNRESTORABLE[key] = frozenset(left)
        log.warning("%s %s/%s: %s still differs after a restore", *key, "; ".join(left))
    else:
        UNRESTORABLE.pop(key, None)
    return Applied("updated", now, tuple(drift), tuple(left))


def _server_side_apply(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    resp = _applier(obj["kind"])(
        meta["name"],
        meta["namespace"],
        obj,
        field_manager=FIELD_MANAGER,
        force=True,
        _content_type="application/apply-patch+yaml",
        _preload_content=False,
    )
    return _with_kind(json.loads(resp.data), obj["kind"])  # raw: every field, as the watch delivers it


def _replace(obj: dict[str, Any], existing: dict[str, Any], compare: tuple[str, ...]) -> dict[str, Any]:
    """One JSON patch setting each `compare` field to the rendered value, plus what the API server
    assigned there (a Service's clusterIP: immutable); defaults left out are the server's to fill."""
    defaults = SERVER_DEFAULTS.get(obj["kind"], {})
    ops = []
    for field in compare:
        want = obj.get(field)
        if isinstance(want, dict):
            want = {**want, **{k: v for k, v in (existing.get(field) or {}).items()
                               if k not in want and defaults.get((field, k)) is ASSIGNED}}
        ops.append({"op": "add", "path": f"/{field}", "value": want})  # add replaces; null removes
    meta = obj["metadata"]
    resp = _applier(obj["kind"])(meta["name"], meta["namespace"], ops, field_manager=FIELD_MANAGER,
                                 _content_type="application/json-patch+json", _preload_content=False)
    return _with_kind(json.loads(resp.data), obj["kind"])


def drifted(obj: dict[str, Any], existing: dict[str, Any], compare: tuple[str, ...]) -> list[str]:
    """How `existing` differs from the rendered child `obj`, one "path: what" each; [] when it holds
    the rendered `compare` fields exactly, beside only what the API server defaults there
    (SERVER_DEFAULTS), and the rendered labels and annotations among its own (others may add theirs)."""
    defaults = SERVER_DEFAULTS.get(obj["kind"], {})
    out: list[str] = []
    for field in compare:
        _exact(obj.get(field), existing.get(field), (field,), (field,), defaults, out)
    for field in ("labels", "annotations"):
        have = existing["metadata"].get(field) or {}
        out += [f"metadata.{field}.{k}: {_shown(have.get(k))}, not {_shown(v)}"
                for k, v in (obj["metadata"].get(field) or {}).items() if have.get(k) != v]
    return out


def _exact(want: Any, have: Any, path: tuple[str, ...], pattern: tuple[str, ...],
           defaults: dict[tuple[str, ...], Any], out: list[str]) -> None:
    """`path` names the field (list items by index), `pattern` finds its defaults (items as "[]")."""
    here = ".".join(path)
    if _empty(want) and _empty(have):
        return  # {} or [] rendered, the field left out by the server (or the other way round)
    if isinstance(want, dict) and isinstance(have, dict):
        for k, v in want.items():
            _exact(v, have.get(k), (*path, k), (*pattern, k), defaults, out)
        for k in sorted(have.keys() - want.keys()):
            default = defaults.get((*pattern, k), _NONE)
            if default is _NONE:
                out.append(f"{here}.{k}: {_shown(have[k])}, not rendered")
            elif default is not ASSIGNED:
                expected = default(have) if callable(default) else default
                if have[k] != expected:
                    out.append(f"{here}.{k}: {_shown(have[k])}, not {_shown(expected)}")
    elif isinstance(want, list) and isinstance(have, list) and len(want) == len(have):
        for i, (w, h) in enumerate(zip(want, have, strict=True)):
            _exact(w, h, (*path[:-1], f"{path[-1]}[{i}]"), (*pattern, "[]"), defaults, out)
    elif want != have:
        out.append(f"{here}: {_shown(have)}, not {_shown(want)}")


_NONE = object()


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == []


def _shown(value: Any) -> str:
    text = "absent" if value is None else json.dumps(value, sort_keys=True, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."


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
    return _with_kind(out, "Pod") if isinstance(out, dict) and out.get("metadata", {}).get("uid") else None


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
    return _with_kind(api_client().sanitize_for_serialization(pod), "Pod")


def patch_pod_labels(namespace: str, name: str, uid: str, labels: dict[str, str | None]) -> dict[str, Any]:
    """Labels of this incarnation of the pod only (a uid precondition: a same-name successor is not
    touched)."""
    pod = core().patch_namespaced_pod(name, namespace, {"metadata": {"labels": labels, "uid": uid}})
    return _with_kind(api_client().sanitize_for_serialization(pod), "Pod")


def patch_pod_annotations(namespace: str, name: str, annotations: dict[str, str | None]) -> dict[str, Any]:
    pod = core().patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations}})
    return _with_kind(api_client().sanitize_for_serialization(pod), "Pod")



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
