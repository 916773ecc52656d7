"""A child the operator owns, as rendered: created by server-side apply, compared whole with the
watch-fed copy, and restored exactly when it drifted (runtime/act.py applies each EnsureChild here).
What the API server adds by default is not drift (ChildKind.server_defaults); a label or annotation in
Kubernetes' own prefixes that it did not render is (child_kinds.reserved_key), and is removed; a
child frozen by a field no write may undo (a ConfigMap made immutable) is deleted and created again;
what a restore cannot put back is left and said once (UNRESTORABLE)."""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from kubernetes.client.exceptions import ApiException

from ..api.child_kinds import ASSIGNED, BY_KIND, reserved_key
from ..names import FIELD_MANAGER
from .kube import group_api, with_kind

log = logging.getLogger(__name__)


def _applier(kind: str):
    return getattr(group_api(BY_KIND[kind].group), f"patch_namespaced_{BY_KIND[kind].client_name}")


def _deleter(kind: str):
    return getattr(group_api(BY_KIND[kind].group), f"delete_namespaced_{BY_KIND[kind].client_name}")


# (kind, namespace, name) -> what a restore left as it was (the API server or a webhook puts it back):
# the same drift again is not worth another request (nor a loop: each write is a watch event).
UNRESTORABLE: dict[tuple[str, str, str], frozenset[str]] = {}


class Applied(NamedTuple):
    result: str  # "created" | "updated" | "replaced" (deleted and created again) | "unchanged"
    obj: dict[str, Any]  # as the API server holds it
    drift: tuple[str, ...] = ()  # what differed from the rendered object ("path: was, not want")
    left: tuple[str, ...] = ()  # what still differs after the write (UNRESTORABLE)


def apply(obj: dict[str, Any], compare: tuple[str, ...], existing: dict[str, Any] | None) -> Applied:
    """A child the operator owns, as rendered: created by server-side apply (one field manager,
    conflicts forced); when `existing` (the watch-fed copy) differs (drifted()), restored in one
    pass. The rendered labels and annotations by server-side apply, which leaves other managers' own
    keys; the `compare` fields that differ (a spec, a ConfigMap's data) and the reserved keys it did
    not render by one JSON patch (restore_ops): apply cannot remove a field another manager set. A
    child frozen() is replaced. Unchanged costs no request."""
    if existing is None:
        return Applied("created", _server_side_apply(obj))
    key = (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
    drift = drifted(obj, existing, compare)
    if not drift or UNRESTORABLE.get(key) == frozenset(drift):
        return Applied("unchanged", existing)
    if frozen(obj, existing):
        result, now = "replaced", _recreate(obj, existing)
    else:
        result, now = "updated", existing
        if _rendered_metadata(obj, now):
            now = _server_side_apply(obj)
        if ops := restore_ops(obj, now, compare):
            now = _json_patch(obj, ops)
    left = drifted(obj, now, compare)  # verified on the API server's answer
    if left:
        UNRESTORABLE[key] = frozenset(left)
        log.warning("%s %s/%s: %s still differs after a restore", *key, "; ".join(left))
    else:
        UNRESTORABLE.pop(key, None)
    return Applied(result, now, tuple(drift), tuple(left))


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


def _json_patch(obj: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    meta = obj["metadata"]
    resp = _applier(obj["kind"])(meta["name"], meta["namespace"], ops, field_manager=FIELD_MANAGER,
                                 _content_type="application/json-patch+json", _preload_content=False)
    return with_kind(json.loads(resp.data), obj["kind"])


def _recreate(obj: dict[str, Any], existing: dict[str, Any]) -> dict[str, Any]:
    """Delete the frozen child (only that one: its uid is a precondition) and create it as rendered.
    Already gone is as good; a pod starting in between waits for the new one as for any mount."""
    meta = existing["metadata"]
    try:
        _deleter(obj["kind"])(meta["name"], meta["namespace"], _preload_content=False,
                              body={"preconditions": {"uid": meta.get("uid")}})
    except ApiException as err:
        if err.status != 404:
            raise
    return _server_side_apply(obj)


def frozen(obj: dict[str, Any], existing: dict[str, Any]) -> list[str]:
    """The fields (child_kinds.ChildKind.frozen_by) someone set on `existing` that forbid any change
    to it from now on, which the operator does not render: then only a new object is as rendered."""
    return [f"{field}: {_shown(existing[field])}" for field in BY_KIND[obj["kind"]].frozen_by
            if existing.get(field) and not obj.get(field)]


def restore_ops(obj: dict[str, Any], existing: dict[str, Any],
                compare: tuple[str, ...]) -> list[dict[str, Any]]:
    """One JSON patch: each `compare` field that differs set to the rendered value, plus what the API
    server assigned there (a Service's clusterIP: immutable; defaults left out are the server's to
    fill), and each reserved label or annotation the operator did not render removed. [] when
    nothing of that differs."""
    defaults = BY_KIND[obj["kind"]].server_defaults
    ops = []
    for field in compare:
        if not _field_drift(obj, existing, field, defaults):
            continue
        want = obj.get(field)
        if isinstance(want, dict):
            want = {**want, **{k: v for k, v in (existing.get(field) or {}).items()
                               if k not in want and defaults.get((field, k)) is ASSIGNED}}
        ops.append({"op": "add", "path": f"/{field}", "value": want})  # add replaces; null removes
    ops += [{"op": "remove", "path": f"/metadata/{field}/{_pointer(k)}"}
            for field, k in _foreign(obj, existing)]
    return ops


def _pointer(key: str) -> str:
    """A map key as one JSON pointer token (RFC 6901): a label key's "/" is "~1"."""
    return key.replace("~", "~0").replace("/", "~1")


def drifted(obj: dict[str, Any], existing: dict[str, Any], compare: tuple[str, ...]) -> list[str]:
    """How `existing` differs from the rendered child `obj`, one "path: what" each; [] when it holds
    the rendered `compare` fields exactly, beside only what the API server defaults there
    (ChildKind.server_defaults), and the rendered labels and annotations among its own: others may add theirs,
    but not in Kubernetes' own prefixes (child_kinds.reserved_key: kube-proxy drops a Service
    labelled `service.kubernetes.io/service-proxy-name`)."""
    defaults = BY_KIND[obj["kind"]].server_defaults
    out: list[str] = []
    for field in compare:
        out += _field_drift(obj, existing, field, defaults)
    out += _rendered_metadata(obj, existing)
    out += [f"metadata.{field}.{k}: {_shown(existing['metadata'][field][k])}, not rendered"
            for field, k in _foreign(obj, existing)]
    return out


def _field_drift(obj: dict[str, Any], existing: dict[str, Any], field: str,
                 defaults: dict[tuple[str, ...], Any]) -> list[str]:
    out: list[str] = []
    _exact(obj.get(field), existing.get(field), (field,), (field,), defaults, out)
    return out


def _rendered_metadata(obj: dict[str, Any], existing: dict[str, Any]) -> list[str]:
    """The rendered labels and annotations that `existing` lacks or holds with another value."""
    out = []
    for field in ("labels", "annotations"):
        have = existing["metadata"].get(field) or {}
        out += [f"metadata.{field}.{k}: {_shown(have.get(k))}, not {_shown(v)}"
                for k, v in (obj["metadata"].get(field) or {}).items() if have.get(k) != v]
    return out


def _foreign(obj: dict[str, Any], existing: dict[str, Any]) -> list[tuple[str, str]]:
    """(labels|annotations, key) of each reserved key `existing` holds that the operator did not render."""
    return [(field, k) for field in ("labels", "annotations")
            for k in sorted(existing["metadata"].get(field) or {})
            if reserved_key(k) and k not in (obj["metadata"].get(field) or {})]


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
