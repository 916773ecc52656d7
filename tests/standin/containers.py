"""A pod's engine container as this machine runs it, read through the API as a kubelet would: its
command line (commands.py's stand-in, or in real mode the pod's own, realpod.py) and what it mounts
(the membership token from its Secret, the deploy config's stage count from its ConfigMap, real
mode's volumes). A pod whose objects are not there yet is retried (NotYet); one this runtime will
never run is refused (Refused), with the reason."""

from __future__ import annotations

import base64
import os
import socket
from pathlib import Path
from typing import Any

from kubernetes.client.rest import ApiException
from omnistage_engine_patches import contract

from tests.standin import realpod
from tests.standin.commands import (
    L_OMNISTAGE,
    L_ROLE,
    _arg,
    _engine_container,
    _expand,
    _master,
    _NotYet,
    _Refused,
    count_stages,
    deploy_config_source,
    head_argv,
    pool_argv,
    replica_argv,
)


class Containers:
    """The StandinRuntime's part that turns a pod into the argv of its process (kubelet.py mixes it in)."""

    def _command(self, pod: dict[str, Any], role: str, ip: str) -> list[str]:
        container = _engine_container(pod)
        args = [_expand(a, pod) or "" for a in container.get("args") or []]
        if role == "head":
            # A single-engine head (membership static, 1 replica) has no master port: only its HTTP port
            # and the plugin's membership port (the container port of that name).
            membership = next((str(p["containerPort"]) for p in container.get("ports") or []
                               if p.get("name") == contract.MEMBERSHIP_PORT_NAME), None)
            for port in filter(None, (_arg(args, "--port") or "8000", _arg(args, "--omni-master-port"), membership)):
                if not _port_free(ip, int(port)):
                    # Not one of ours (we wait for our own previous holder of an IP): most likely another
                    # local cluster on this machine whose nodes have the same loopback pod CIDRs.
                    raise _NotYet(f"{ip}:{port} is already in use by a process this runtime did not start "
                                  f"(another local cluster with the same pod CIDRs?)")
        if self.image is not None:
            return self._real_process(pod, role, args).argv
        if role == "head":
            stages = self._stage_count(pod)
            return head_argv(self.python, self.head_module, args, ip, self._token_file(pod), stages)
        if role == "replica":
            return replica_argv(self.python, self.replica_module, args, ip)
        if role == "pool":
            return pool_argv(self.python, self.replica_module, args, ip)
        raise _Refused(f"unknown role {role!r} (label {L_ROLE})")

    def _real_process(self, pod: dict[str, Any], role: str, args: list[str]) -> realpod.PodProcess:
        """Real mode: the pod's own container as a process (realpod.pod_process), its ConfigMap and
        Secret volumes written to the pod's directory. The environment waits on the Proc (_spawn)."""
        if role not in ("head", "replica", "pool"):
            raise _Refused(f"unknown role {role!r} (label {L_ROLE})")
        if role != "head":
            _master(args if role == "replica" else args[args.index("--") + 1:] if "--" in args else args,
                    f"{role} pod")  # the network rule: the master it dials must be a loopback address
        ns, meta = pod["metadata"]["namespace"], pod["metadata"]
        readers = {"ConfigMap": self._api.read_namespaced_config_map, "Secret": self._api.read_namespaced_secret}

        def lookup(kind: str, name: str) -> dict[str, Any] | None:
            try:
                if kind == "ServiceAccountToken":  # as the kubelet does: a token bound to this pod
                    body = {"spec": {"audiences": [name] if name else None, "expirationSeconds": 3600,
                                     "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": meta["name"],
                                                        "uid": meta["uid"]}}}
                    sa = pod["spec"].get("serviceAccountName") or "default"
                    out = self._api.create_namespaced_service_account_token(sa, ns, body, _request_timeout=10)
                    return {"token": out.status.token}
                return self._serialize(readers[kind](name, ns, _request_timeout=10))
            except ApiException as err:
                if err.status == 404:
                    return None
                raise _NotYet(f"{kind} {ns}/{name}: HTTP {err.status} reading it") from None

        proc = realpod.pod_process(pod, lookup, self.image, self.pod_root(ns, meta["name"], meta["uid"]),
                                   tmp=Path("/tmp") / f"omnistage-pod-{meta['uid'][:8]}")
        for d in proc.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, (content, mode) in proc.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
        self._pending_env[(ns, meta["name"], meta["uid"])] = proc.env
        return proc

    def pod_root(self, namespace: str, pod: str, uid: str) -> Path:
        """Real mode: the pod's own directory (its volumes, HOME and TMPDIR)."""
        return self.state_dir / "pods" / f"{namespace}_{pod}_{uid[:8]}"

    def _stage_count(self, pod: dict[str, Any]) -> int:
        """Stages of the head's pipeline: len(stages) of the deploy config its pod mounts (ConfigMap)."""
        source = deploy_config_source(pod)
        if source is None:
            return 1
        ns, (name, key) = pod["metadata"]["namespace"], source
        cm = _read_or_not_yet(self._api.read_namespaced_config_map, "ConfigMap", ns, name)
        text = (cm.data or {}).get(key)
        if text is None:
            raise _NotYet(f"ConfigMap {ns}/{name} has no key {key!r} yet")
        return count_stages(text)

    def _token_file(self, pod: dict[str, Any]) -> Path:
        """The membership token, as the kubelet would mount it: from the pod's Secret volume."""
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        secret_name = None
        for v in pod["spec"].get("volumes") or []:
            if (v.get("secret") or {}).get("secretName", "").endswith("-membership"):
                secret_name = v["secret"]["secretName"]
        if not secret_name:
            owner = (pod["metadata"].get("labels") or {}).get(L_OMNISTAGE)
            if not owner:
                raise _Refused("head pod has neither a membership Secret volume nor an omnistage label")
            secret_name = f"{owner}-membership"
        secret = _read_or_not_yet(self._api.read_namespaced_secret, "Secret", ns, secret_name)
        raw = (secret.data or {}).get("token")
        if not raw:
            raise _NotYet(f"Secret {ns}/{secret_name} has no key 'token' yet")
        path = self.state_dir / "tokens" / f"{ns}_{name}_{pod['metadata']['uid'][:8]}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(raw))
        return path


def _read_or_not_yet(read: Any, kind: str, namespace: str, name: str) -> Any:
    """An object the pod mounts; missing or unreadable is "not yet" (the operator writes it first)."""
    try:
        return read(name, namespace, _request_timeout=10)
    except ApiException as err:
        why = "not found yet" if err.status == 404 else f"HTTP {err.status} reading it"
        raise _NotYet(f"{kind} {namespace}/{name}: {why}") from None


def _port_free(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of our own last run is fine
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False
