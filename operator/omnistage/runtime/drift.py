"""A child the operator owns, as rendered: created by server-side apply, compared whole with the
watch-fed copy, and restored exactly when it drifted (runtime/act.py applies each EnsureChild here).
What the API server adds by default is not drift (SERVER_DEFAULTS); what a restore cannot put back
is left and said once (UNRESTORABLE)."""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from ..api.child_kinds import BY_KIND
from ..names import FIELD_MANAGER
from .kube import group_api, with_kind

log = logging.getLogger(__name__)


def _applier(kind: str):
    return getattr(group_api(BY_KIND[kind].group), f"patch_namespaced_{BY_KIND[kind].client_name}")


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
    return with_kind(json.loads(resp.data), obj["kind"])  # raw: every field, as the watch delivers it


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
    return with_kind(json.loads(resp.data), obj["kind"])


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
