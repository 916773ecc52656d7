"""What spec.template cannot loosen in an engine pod: the operator's hardening, written before the
merge and put back after it (pods._pod), because a strategic merge replaces what the template sets.

- Every container the pod runs (the engine, sidecars, init containers, native sidecars) drops every
  capability and may not gain privileges. A template's `capabilities: {drop: []}` would otherwise
  bring back the container runtime's defaults (NET_RAW, CHOWN, SETUID...), and a sidecar the operator
  did not harden would keep them; validation refuses only the additions (api/template_rules.py), and
  what a container may add back is IPC_LOCK and SYS_NICE (api/security.ALLOWED_CAPABILITIES).
- Every mount of a host directory is read-only, in every container: a writable allow-listed
  directory lets one pod plant a symlink that a later hostPath follows to the node's root, or code
  (an engine venv) that every engine of the node runs. The one exception is the operator's own
  sameNode /dev/shm directory (pods.SAME_NODE_SHM_ROOT), the stages' shared memory, written by design.
"""

from __future__ import annotations

import copy
from typing import Any

from ..api.podtemplate import V_SHM

# The hardening vLLM tolerates (the production sample runs with it): no privilege escalation, no
# capabilities, the runtime's seccomp profile. Not runAsNonRoot or a read-only root: the engine image
# runs as root and writes its caches under /root/.cache. spec.template's securityContext merges over
# these (e.g. `capabilities: {add: [IPC_LOCK]}` for RDMA); harden() puts these two back.
CONTAINER_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
POD_SECURITY_CONTEXT = {"seccompProfile": {"type": "RuntimeDefault"}}
DROP_ALL = "ALL"
CONTAINER_LISTS = ("containers", "initContainers")


def container_security_context() -> dict[str, Any]:
    return copy.deepcopy(CONTAINER_SECURITY_CONTEXT)


def _objects(node: Any) -> list[dict[str, Any]]:
    return [x for x in node if isinstance(x, dict)] if isinstance(node, list) else []


def _harden_container(c: dict[str, Any]) -> None:
    ctx = c.get("securityContext")
    ctx = c["securityContext"] = ctx if isinstance(ctx, dict) else {}
    ctx["allowPrivilegeEscalation"] = False
    caps = ctx.get("capabilities")
    caps = ctx["capabilities"] = caps if isinstance(caps, dict) else {}
    drop = [d for d in _strings(caps.get("drop")) if d != DROP_ALL]
    # ALL first: the runtime drops every capability, then adds back the ones `add` names.
    caps["drop"] = [DROP_ALL, *drop]


def _strings(node: Any) -> list[str]:
    return [x for x in node if isinstance(x, str)] if isinstance(node, list) else []


def _host_path_volumes(spec: dict[str, Any]) -> set[str]:
    return {v.get("name") for v in _objects(spec.get("volumes"))
            if v.get("hostPath") is not None and v.get("name") != V_SHM}


def harden(spec: dict[str, Any]) -> dict[str, Any]:
    """The merged pod spec, every container hardened and every host-directory mount read-only (in
    place; returned for convenience)."""
    host = _host_path_volumes(spec)
    for field in CONTAINER_LISTS:
        for c in _objects(spec.get(field)):
            _harden_container(c)
            for m in _objects(c.get("volumeMounts")):
                if m.get("name") in host:
                    m["readOnly"] = True
    return spec
