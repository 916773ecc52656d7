"""Watch-fed, in-memory copies of what the operator reads: OmniStages, engine pods and the children
(ConfigMap, Services, NetworkPolicy), indexed by OmniStage. A reconcile pass reads these and talks
to the API server only to write (and to read the membership Secret, below).

One list + watch per kind and watched namespace (client-go's informer, reduced to what is needed):
list, then watch from the list's resourceVersion with bookmarks; a watch that times out is resumed
from the last resourceVersion seen, a 410 Gone relists. The operator's own writes are put in the
store at once (`wrote`), so the next pass does not act again on what it has just changed before the
watch event arrives; a write older than what the watch already delivered (or deleted) is ignored,
and so is a deletion older than a write (drift.apply deleting a frozen child and creating it again).

The membership token Secret is not here: RBAC refuses the operator list/watch on Secrets (least
privilege), so reconcile.py reads it once per OmniStage and keeps the token in memory (and reads it
again, re-creating it when it is gone, whenever an engine pod is about to mount it and on the
resync's full pass, once a minute).

Followers watch nothing (leader.py): an informer lists only while its replica leads, and drops its
store when leadership is lost."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from .. import api
from ..api.child_kinds import CHILD_KINDS, ChildKind
from ..names import L_MANAGED_BY, L_OMNISTAGE, MANAGED_BY
from . import kube, leader

log = logging.getLogger(__name__)

WATCH_SECONDS = 300  # server-side watch timeout: a resumed watch is one request per kind per 5 min
TOMBSTONE_SECONDS = 120.0  # how long a deletion outranks a late write-through of the same object
LIST_PAGE = 500  # objects per list request

Key = tuple[str, str]  # (namespace, name)
OnChange = Callable[[str, str], None]  # (namespace, OmniStage name)


def _rv(obj: dict[str, Any]) -> int | None:
    try:
        return int(obj["metadata"].get("resourceVersion"))
    except (TypeError, ValueError):
        return None  # opaque on some API servers: then every write-through is taken


def _trim(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"].pop("managedFields", None)  # the biggest part of an applied object, never read
    return obj


def _trim_pod(obj: dict[str, Any]) -> dict[str, Any]:
    """A pod's spec (containers, env, volumes, tolerations and the API server's defaults: half the
    pod) is never read back, only where it was scheduled; the template hash annotation says which
    spec it runs. At 1,000 OmniStages this is about a third of the stores' memory. Kept besides:
    the readiness gates (whether the pod waits for its join) and the grace period (how long a pod
    deleted by someone else may still drain)."""
    obj = _trim(obj)
    spec = obj.get("spec") or {}
    obj["spec"] = {k: spec[k] for k in KEPT_POD_SPEC if spec.get(k) is not None}
    return obj


KEPT_POD_SPEC = ("nodeName", "readinessGates", "terminationGracePeriodSeconds")


class Informer:
    """One kind: list + watch per scope (a namespace, or None for cluster-wide)."""

    def __init__(self, kind: str, list_call: Callable[..., Any], selector: str | None,
                 owner: Callable[[dict[str, Any]], str | None], on_change: OnChange | None = None,
                 significant: Callable[[dict[str, Any] | None, dict[str, Any]], bool] = lambda old, new: True,
                 trim: Callable[[dict[str, Any]], dict[str, Any]] = _trim, notify_listed: bool = False,
                 owned_only: bool = False):
        self.kind, self._list_call, self.selector, self._owner = kind, list_call, selector, owner
        self.on_change, self._significant, self._trim = on_change, significant, trim
        self._notify_listed = notify_listed
        # Keep only objects with an owner (the pods: a watch without a selector sees every pod of the
        # scope; the others are dropped as they arrive, never stored).
        self._owned_only = owned_only
        self._lock = threading.Lock()
        self._items: dict[Key, dict[str, Any]] = {}
        self._by_owner: dict[Key, dict[str, dict[str, Any]]] = {}
        self._tombstones: dict[Key, tuple[int | None, float]] = {}
        self._synced: dict[str | None, threading.Event] = {}

    # -- reads
    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._items.get((namespace, name))

    def owned(self, namespace: str, omnistage: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._by_owner.get((namespace, omnistage), {}).values())

    def all(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items.values())

    def synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(ev.wait(max(0.0, deadline - time.monotonic())) for ev in list(self._synced.values()))

    # -- writes to the store
    def _put(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        key = (meta.get("namespace") or "", meta["name"])
        old = self._items.get(key)
        if old is not None:
            self._unindex(key, old)
        self._items[key] = obj
        owner = self._owner(obj)
        if owner:
            self._by_owner.setdefault((key[0], owner), {})[key[1]] = obj

    def _unindex(self, key: Key, obj: dict[str, Any]) -> None:
        owner = self._owner(obj)
        if owner:
            group = self._by_owner.get((key[0], owner), {})
            group.pop(key[1], None)
            if not group:
                self._by_owner.pop((key[0], owner), None)

    def _delete(self, key: Key, rv: int | None) -> None:
        old = self._items.pop(key, None)
        if old is not None:
            self._unindex(key, old)
        self._tombstones[key] = (rv, time.monotonic())

    def wrote(self, obj: dict[str, Any] | None) -> None:
        """What one of the operator's own writes returned: newer than the store, unless the watch
        already delivered something newer (or the deletion)."""
        if not obj or not obj.get("metadata") or not self._keeps(obj):
            return
        obj = self._trim(obj)
        key, rv = (obj["metadata"].get("namespace") or "", obj["metadata"]["name"]), _rv(obj)
        with self._lock:
            have = self._items.get(key)
            dead = self._tombstones.get(key)
            if rv is not None and ((have is not None and (_rv(have) or 0) >= rv)
                                   or (dead is not None and (dead[0] or 0) >= rv)):
                return
            self._put(obj)

    def _keeps(self, obj: dict[str, Any]) -> bool:
        return not self._owned_only or self._owner(obj) is not None

    def _event(self, etype: str, obj: dict[str, Any]) -> None:
        key = (obj["metadata"].get("namespace") or "", obj["metadata"]["name"])
        if not self._keeps(obj):
            with self._lock:
                had = self._items.get(key)
            if had is None:
                return  # never one of ours: not stored, nobody told
            etype, obj = "DELETED", {**obj, "metadata": {**obj["metadata"], "ownerReferences":
                                                         had["metadata"].get("ownerReferences")}}
        obj = self._trim(obj)
        with self._lock:
            have = self._items.get(key)
            notify = etype == "DELETED" or self._significant(have, obj)
            if etype == "DELETED":
                if have is None or _rv(have) is None or _rv(obj) is None or _rv(obj) >= (_rv(have) or 0):
                    self._delete(key, _rv(obj))  # not a write-through made after it (drift.apply's re-create)
            else:
                if have is None or _rv(have) is None or _rv(obj) is None or _rv(obj) >= (_rv(have) or 0):
                    self._put(obj)
            if len(self._tombstones) > 256:
                cutoff = time.monotonic() - TOMBSTONE_SECONDS
                self._tombstones = {k: v for k, v in self._tombstones.items() if v[1] > cutoff}
        owner = self._owner(obj)
        if owner and notify and self.on_change is not None:
            self.on_change(key[0], owner)

    def _replace(self, scope: str | None, items: list[dict[str, Any]]) -> None:
        with self._lock:
            for key in [k for k in self._items if scope is None or k[0] == scope]:
                self._unindex(key, self._items.pop(key))
            for obj in items:
                if self._keeps(obj):
                    self._put(self._trim(obj))

    # -- the list + watch loop
    def start(self, scopes: list[str | None]) -> None:
        for scope in scopes:
            self._synced[scope] = threading.Event()
            threading.Thread(target=self._run, args=(scope,), daemon=True,
                             name=f"informer-{self.kind}-{scope or 'all'}").start()

    def _call(self, scope: str | None) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """The client's list method (kubernetes.watch needs the method itself) and its arguments."""
        fn, args = self._list_call(scope)
        return fn, args, ({"label_selector": self.selector} if self.selector else {})

    def _list(self, scope: str | None) -> str:
        """One consistent list, in pages (a scope's every pod need not fit in memory at once: only the
        kept ones are)."""
        fn, args, kw = self._call(scope)
        items, more = [], None
        while True:
            resp = fn(*args, **kw, limit=LIST_PAGE, _continue=more, _preload_content=False)
            data = json.loads(resp.data)
            items += [
                {**o, "kind": o.get("kind") or self.kind} for o in data.get("items") or [] if self._keeps(o)
            ]
            more = data["metadata"].get("continue")
            if not more:
                break
        self._replace(scope, items)
        if self._notify_listed and self.on_change is not None:
            for obj in items:  # what kopf's resume did: every listed object gets a pass now
                owner = self._owner(obj)
                if owner:
                    self.on_change(obj["metadata"].get("namespace") or "", owner)
        return data["metadata"]["resourceVersion"]

    def _run(self, scope: str | None) -> None:
        synced, backoff = self._synced[scope], 1.0
        while True:
            if not leader.is_leading():
                if synced.is_set():
                    synced.clear()
                    self._replace(scope, [])
                time.sleep(1.0)
                continue
            try:
                rv = self._list(scope)
                synced.set()
                backoff = 1.0
                self._watch(scope, rv)
            except Exception as err:  # noqa: BLE001 -- a watch never dies; it relists after a pause
                if isinstance(err, ApiException) and err.status == 410:
                    log.info("%s watch (%s): resourceVersion too old; relisting", self.kind, scope or "all")
                    continue
                log.warning(
                    "%s watch (%s) failed: %s; relisting in %.0fs", self.kind, scope or "all", err, backoff
                )
                time.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    def _watch(self, scope: str | None, rv: str) -> None:
        fn, args, kw = self._call(scope)
        while leader.is_leading():
            w = watch.Watch()
            for ev in w.stream(fn, *args, **kw, resource_version=rv, allow_watch_bookmarks=True,
                               timeout_seconds=WATCH_SECONDS, _request_timeout=WATCH_SECONDS + 30,
                               deserialize=False):
                obj = ev["object"]  # deserialize=False: the object as the API server sent it
                rv = obj.get("metadata", {}).get("resourceVersion") or rv
                if ev["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    self._event(ev["type"], {**obj, "kind": obj.get("kind") or self.kind})
                if not leader.is_leading():
                    w.stop()


def _label(key: str) -> Callable[[dict[str, Any]], str | None]:
    return lambda obj: (obj["metadata"].get("labels") or {}).get(key)


def _custom_lister(plural: str):
    def pick(scope: str | None):
        c = kube.custom()
        if scope is None:
            return c.list_cluster_custom_object, (api.GROUP, api.VERSION, plural)
        return c.list_namespaced_custom_object, (api.GROUP, api.VERSION, scope, plural)
    return pick


def _new_generation(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """A custom object's own status writes are not worth a pass; a new generation (spec, scale) is."""
    return old is None or old["metadata"].get("generation") != new["metadata"].get("generation")


# What the API server and other controllers write on a child without changing what the operator
# renders: the disruption controller rewrites a PodDisruptionBudget's status each time a replica turns
# Ready or a selector changes, and every write bumps resourceVersion and managedFields.
_NOT_RENDERED = ("status",)
_NOT_RENDERED_META = ("resourceVersion", "managedFields")


def _rendered_part(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in obj["metadata"].items() if k not in _NOT_RENDERED_META}
    return {**{k: v for k, v in obj.items() if k not in _NOT_RENDERED}, "metadata": meta}


def _rendered_changed(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """A child's status-only writes are not worth a pass (a PodDisruptionBudget's status changes with
    every replica's readiness: a pass each, for nothing); a change to anything the operator renders
    or restores is, and so is the operator's own write whose watch event shows something else."""
    return old is None or _rendered_part(old) != _rendered_part(new)


def _core_lister(namespaced: str, cluster: str):
    def pick(scope: str | None):
        c = kube.core()
        return (getattr(c, cluster), ()) if scope is None else (getattr(c, namespaced), (scope,))
    return pick


def _child_lister(c: ChildKind):
    def pick(scope: str | None):
        group = kube.group_api(c.group)
        if scope is None:
            return getattr(group, f"list_{c.client_name}_for_all_namespaces"), ()
        return getattr(group, f"list_namespaced_{c.client_name}"), (scope,)
    return pick


OWNED = f"{L_MANAGED_BY}={MANAGED_BY}"


def _omnistage_controller(obj: dict[str, Any]) -> str | None:
    """The name of the OmniStage that is the object's controller (its uid is the pass's to check)."""
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == api.KIND and \
                (ref.get("apiVersion") or "").split("/")[0] == api.GROUP:
            return ref.get("name")
    return None


class ClusterState:
    """Every informer the reconcile loop reads."""

    def __init__(self) -> None:
        # An OmniStage's own status writes are not worth a pass; a new generation (spec, scale) is,
        # even when kopf's handler queued it first: that pass may have read the store before this
        # event reached it.
        # Every OmniStage listed (at a start, on becoming leader) is queued at once, as kopf's resume
        # handler did, rather than at the resync's first tick.
        self.omnistages = Informer(
            api.KIND,
            _custom_lister(api.PLURAL),
            None,
            lambda o: o["metadata"]["name"],
            significant=_new_generation,
            notify_listed=True,
        )
        # Pools are indexed by the OmniStage they name: its pass decides for their pods and status.
        self.pools = Informer(api.POOL_KIND, _custom_lister(api.POOL_PLURAL), None,
                              lambda o: (o.get("spec") or {}).get("omniStage"), significant=_new_generation)
        # Engine pods by their controller ownerReference, not by label: a pod whose
        # labels someone removed is still the OmniStage's (observe restores them), and one that carries
        # them without the reference is not. No selector can say that, so every pod of the scope is
        # watched and only those an OmniStage controls are kept.
        self.pods = Informer("Pod", _core_lister("list_namespaced_pod", "list_pod_for_all_namespaces"), None,
                             _omnistage_controller, trim=_trim_pod, owned_only=True)
        self.children = {c.kind: Informer(c.kind, _child_lister(c), OWNED, _label(L_OMNISTAGE),
                                          significant=_rendered_changed)
                         for c in CHILD_KINDS}
        self.started = False

    def informers(self) -> list[Informer]:
        return [self.omnistages, self.pools, self.pods, *self.children.values()]

    def start(self, scopes: list[str | None], on_change: OnChange) -> None:
        """`on_change` is called for every watch event on an engine pod or a child, for every new
        OmniStage or generation of one, and for every OmniStage a list returned (a start, a new
        leader, a relist)."""
        for inf in self.informers():
            inf.on_change = on_change
            inf.start(scopes)
        self.started = True

    def synced(self, timeout: float) -> bool:
        return self.started and all(inf.synced(timeout) for inf in self.informers())

    def of(self, kind: str) -> Informer | None:
        if kind == "Pod":
            return self.pods
        if kind == api.KIND:
            return self.omnistages
        if kind == api.POOL_KIND:
            return self.pools
        return self.children.get(kind)

    def wrote(self, obj: dict[str, Any] | None) -> None:
        inf = self.of((obj or {}).get("kind", ""))
        if inf is not None:
            inf.wrote(obj)


STATE = ClusterState()
