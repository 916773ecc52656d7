"""`kubectl get ... -o json` answered over HTTP, without starting kubectl (issue 28).

The tiers poll the API server through kubectl thousands of times per run; each call costs a process
start and about 47 ms of CPU (2739 calls were 128 s of CPU in the stand-in cluster tier's profile). A
plain read needs none of kubectl's machinery, so Kubectl.json and Kubectl.exists ask this module first
and fall back to kubectl for anything it does not answer the way kubectl would.

What it answers: `get TYPE [NAME]` with `-n NS`, `-l SELECTOR`, `--field-selector`, `-A`, where TYPE
is any name kubectl accepts for a served resource (plural, singular, short name, kind, `plural.group`).
Lists come back as kubectl prints them (`kind: List`, each item with its apiVersion and kind). A
missing object raises the error kubectl's would (NotFound in stderr, exit code 1). Everything else
(other flags, several names, a namespaced TYPE without -n, a failed request) returns None: the caller
runs kubectl. The resource table is read from the API server's discovery once per kubeconfig, and
again when a TYPE is not in it (a CRD installed since).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, NamedTuple

_LOCK = threading.Lock()
_CLIENTS: dict[str, Any] = {}
_TABLES: dict[str, dict[str, Resource]] = {}


class Resource(NamedTuple):
    path: str  # /api/v1 or /apis/GROUP/VERSION
    group_version: str
    plural: str
    kind: str
    namespaced: bool


class Query(NamedTuple):
    type: str
    name: str | None
    namespace: str | None
    all_namespaces: bool
    params: tuple[tuple[str, str], ...]  # labelSelector, fieldSelector


def parse(args: tuple[str, ...]) -> Query | None:
    """The query of `get TYPE [NAME] [flags]`, or None for anything this module leaves to kubectl."""
    if len(args) < 2 or args[0] != "get":
        return None
    positional: list[str] = []
    namespace, everywhere, params = None, False, []
    flags = {"-n": "ns", "--namespace": "ns", "-l": "labelSelector", "--selector": "labelSelector",
             "--field-selector": "fieldSelector"}
    rest = list(args[1:])
    while rest:
        a = rest.pop(0)
        key, value = (a.split("=", 1) + [None])[:2] if a.startswith("--") and "=" in a else (a, None)
        if key in flags:
            if value is None:
                if not rest:
                    return None
                value = rest.pop(0)
            if flags[key] == "ns":
                namespace = value
            else:
                params.append((flags[key], value))
        elif key in ("-A", "--all-namespaces"):
            everywhere = True
        elif a.startswith("-"):
            return None
        else:
            positional.append(a)
    if len(positional) == 1 and "/" in positional[0]:
        positional = positional[0].split("/", 1)
    if not 1 <= len(positional) <= 2 or (everywhere and len(positional) == 2):
        return None
    return Query(positional[0], positional[1] if len(positional) == 2 else None, namespace, everywhere,
                 tuple(params))


def get(kubeconfig: str | Path, args: tuple[str, ...], timeout: float) -> Any | None:
    """What `kubectl get ... -o json` prints, parsed; None: ask kubectl. Raises LookupError(message)
    for a missing object, with kubectl's message."""
    q = parse(args)
    if q is None:
        return None
    try:
        client = _client(str(kubeconfig))
        res = _resource(client, str(kubeconfig), q.type, timeout)
        if res is None or (res.namespaced and q.namespace is None and not q.all_namespaces):
            return None
        where = f"/namespaces/{q.namespace}" if res.namespaced and not q.all_namespaces else ""
        url = f"{res.path}{where}/{res.plural}" + (f"/{q.name}" if q.name else "")
        status, body = _get(client, url, dict(q.params), timeout)
    except Exception:  # noqa: BLE001 - any trouble here is kubectl's to report
        return None
    if status == 404 and q.name:
        ref = f"{res.plural}.{_group(res)}" if _group(res) else res.plural
        raise LookupError(f'Error from server (NotFound): {ref} "{q.name}" not found\n')
    if status != 200:
        return None
    obj = json.loads(body)
    if q.name:
        return obj
    items = [{"apiVersion": res.group_version, "kind": res.kind, **item} for item in obj.get("items") or []]
    return {"apiVersion": "v1", "items": items, "kind": "List", "metadata": {"resourceVersion": ""}}


def _group(res: Resource) -> str:
    return res.group_version.rsplit("/", 1)[0] if "/" in res.group_version else ""


def _client(kubeconfig: str) -> Any:
    with _LOCK:
        if kubeconfig not in _CLIENTS:
            from kubernetes import config

            _CLIENTS[kubeconfig] = config.new_client_from_config(config_file=kubeconfig)
        return _CLIENTS[kubeconfig]


def _get(client: Any, path: str, query: dict[str, str], timeout: float) -> tuple[int, bytes]:
    method, url, headers, _body, _ = client.param_serialize(
        "GET", path, query_params=list(query.items()), header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"])
    resp = client.rest_client.request(method, url, headers=headers, _request_timeout=timeout)
    resp.read()
    return resp.status, resp.data


def _resource(client: Any, kubeconfig: str, name: str, timeout: float) -> Resource | None:
    table = _TABLES.get(kubeconfig)
    if table is None or name.lower() not in table:
        table = _TABLES[kubeconfig] = _discover(client, timeout)
    return table.get(name.lower())


def _discover(client: Any, timeout: float) -> dict[str, Resource]:
    """Every name kubectl accepts for a served resource -> the resource; the first in discovery order
    wins, as kubectl's does (the core group first, then the groups by priority)."""
    versions = ["/api/v1"]
    status, body = _get(client, "/apis", {}, timeout)
    if status == 200:
        versions += [f"/apis/{g['preferredVersion']['groupVersion']}" for g in json.loads(body)["groups"]]
    table: dict[str, Resource] = {}
    for path in versions:
        status, body = _get(client, path, {}, timeout)
        if status != 200:
            continue
        listing = json.loads(body)
        for r in listing.get("resources") or []:
            if "/" in r["name"] or "get" not in (r.get("verbs") or []):
                continue
            res = Resource(path, listing["groupVersion"], r["name"], r["kind"], bool(r.get("namespaced")))
            group = _group(res)
            names = [r["name"], r.get("singularName") or "", r["kind"], *(r.get("shortNames") or [])]
            names += [f"{r['name']}.{group}", f"{r.get('singularName') or ''}.{group}"] if group else []
            for n in names:
                if n and not n.startswith("."):
                    table.setdefault(n.lower(), res)
    return table
