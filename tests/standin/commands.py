"""How an engine pod's rendered command maps to a stand-in process (pure: no API, no processes).

The operator renders `vllm serve` command lines; the stand-in runtime (kubelet.py) runs, per pod role:

  role=head     python -m tests.standin.head --bind-ip <podIP> --http-port <--port> \\
                    --master-port <--omni-master-port> --token-file <token> [--stages N --startup-timeout T]
  role=replica  python -m tests.standin.replica --master-ip <--omni-master-address> \\
                    --master-port <--omni-master-port> --bind-ip <podIP>
  role=pool     the replica, with one --stage-id K per stage id before the pool pod's `--`

and the environment a stand-in gets: the runtime's own (no proxies, no CUDA, offline, this tree
importable) with the pod's OMNISTAGE_* contract variables and its pod IP, name and namespace. The
network rule is checked here: pod IPs and master addresses must be in 127.0.0.0/8.
"""

from __future__ import annotations

import ipaddress
import os
import posixpath
from pathlib import Path
from typing import Any

import yaml

from tests.standin import NO_CUDA_ENV, realpod

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
L_COMPONENT = "serving.omnistage.io/component"
L_ROLE = "serving.omnistage.io/role"
L_POOL = "serving.omnistage.io/pool"  # omnistage.names.L_POOL
HEAD_ROLES = ("head", "next-head", "old-head", "spare-head")  # omnistage.names.HEAD_POD_ROLES
ROLE_STANDBY = "standby"  # omnistage.names.ROLE_STANDBY: a replica or pool pod kept unjoined (spec.standby)
L_OMNISTAGE = "serving.omnistage.io/omnistage"
HEAD_MODULE = "tests.standin.head"
REPLICA_MODULE = "tests.standin.replica"
# Container variables passed to the stand-in process: the engine plugin's contract (operator-
# rendered) and the stand-in's own knobs. The rest (VLLM_CACHE_ROOT, VLLM_HOST_IP, ...) name
# paths and addresses of a real pod and are set here for the process instead.
PASSED_ENV_PREFIX = "OMNISTAGE_"
# The pod cannot be started yet (e.g. its Secret does not exist yet): retried. / The pod will never be
# started by this runtime (network rule, malformed args). One home for both: realpod raises them too.
_NotYet, _Refused = realpod.NotYet, realpod.Refused


def is_loopback(ip: str | None) -> bool:
    try:
        return ip is not None and ipaddress.ip_address(ip) in LOOPBACK
    except ValueError:
        return False


def _arg(args: list[str], flag: str) -> str | None:
    """Value of `flag` in a container's args (`--flag value` or `--flag=value`)."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _arg_values(args: list[str], flag: str) -> list[str]:
    """Every value of a repeatable `flag` (`--flag value` or `--flag=value`), in order."""
    out = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def _expand(value: str | None, pod: dict[str, Any]) -> str | None:
    """Expand the $(VAR) references the kubelet would (only the downward-API ones the renderer uses)."""
    if value is None:
        return None
    return (value.replace("$(POD_IP)", pod["status"].get("podIP") or "")
                 .replace("$(POD_NAME)", pod["metadata"]["name"]))


def _engine_container(pod: dict[str, Any]) -> dict[str, Any]:
    containers = pod["spec"].get("containers") or [{}]
    return next((c for c in containers if c.get("name") == "engine"), containers[0])


def _head_ports(args: list[str]) -> tuple[str, str]:
    """(HTTP port, master port) of a head's `vllm serve` args."""
    master_port = _arg(args, "--omni-master-port")
    if not master_port:
        raise _Refused("head pod has no --omni-master-port in its args")
    return _arg(args, "--port") or "8000", master_port


def head_argv(python: str, module: str, args: list[str], ip: str, token_file: str | os.PathLike,
              stages: int = 1) -> list[str]:
    """The stand-in head for a head pod whose deploy config has `stages` stages. With more than one
    the head pod's `--stage-init-timeout` bounds the wait for the remote stages, as in vllm-omni."""
    http_port, master_port = _head_ports(args)
    argv = [python, "-m", module, "--bind-ip", ip, "--master-port", master_port, "--http-port", http_port,
            "--token-file", str(token_file)]
    if stages > 1:
        argv += ["--stages", str(stages)]
        timeout = _arg(args, "--stage-init-timeout")
        if timeout:
            argv += ["--startup-timeout", timeout]
    return argv


def _master(args: list[str], what: str) -> tuple[str, str]:
    master_ip = _arg(args, "--omni-master-address")
    master_port = _arg(args, "--omni-master-port")
    if not master_ip or not master_port:
        raise _Refused(f"{what} lacks --omni-master-address/--omni-master-port in its args")
    if not is_loopback(master_ip):
        raise _Refused(f"master address {master_ip} is not in 127.0.0.0/8 (network rule); not started")
    return master_ip, master_port


def replica_argv(python: str, module: str, args: list[str], ip: str) -> list[str]:
    """The stand-in replica for a stage-0 replica pod (`vllm serve --headless --stage-id 0`)."""
    master_ip, master_port = _master(args, "replica pod")
    return [python, "-m", module, "--master-ip", master_ip, "--master-port", master_port, "--bind-ip", ip]


def pool_argv(python: str, module: str, args: list[str], ip: str) -> list[str]:
    """One stand-in replica process for a pool pod: `--stage-id K ... -- vllm serve ... --headless
    --omni-master-address A --omni-master-port P ...` (the supervisor's args) registers a replica of
    every K with A:P. Stage ids after `--` (if any) belong to the supervised command, not the pod."""
    if "--" not in args:
        raise _Refused("pool pod args have no '--' between its stage ids and the command")
    split = args.index("--")
    ids, command = args[:split], args[split + 1:]
    stage_ids = _arg_values(ids, "--stage-id")
    if not stage_ids or not all(k.isdigit() for k in stage_ids):
        raise _Refused(f"pool pod has no valid --stage-id before '--': {ids}")
    master_ip, master_port = _master(command, "pool pod")
    return [python, "-m", module, "--master-ip", master_ip, "--master-port", master_port, "--bind-ip", ip,
            *(a for k in stage_ids for a in ("--stage-id", k))]


def deploy_config_source(pod: dict[str, Any]) -> tuple[str, str] | None:
    """(ConfigMap name, key) behind the engine container's `--deploy-config` file: the configMap
    volume mounted at the file's directory (as the operator renders it), else `<omnistage>-config`.
    None when the container names no deploy config."""
    container = _engine_container(pod)
    path = _arg(container.get("args") or [], "--deploy-config")
    if not path:
        return None
    directory, key = posixpath.split(path)
    mount = next((m for m in container.get("volumeMounts") or []
                  if (m.get("mountPath") or "").rstrip("/") == directory), None)
    volume = next((v for v in pod["spec"].get("volumes") or [] if mount and v.get("name") == mount.get("name")), None)
    source = (volume or {}).get("configMap")
    if source is None:
        owner = (pod["metadata"].get("labels") or {}).get(L_OMNISTAGE)
        if not owner:
            raise _Refused(f"no configMap volume at {directory} and no omnistage label")
        return f"{owner}-config", key
    # `items` maps keys to other file names.
    key = next((i["key"] for i in source.get("items") or [] if i.get("path") == key), key)
    return source["name"], key


def count_stages(deploy_yaml: str) -> int:
    """len(stages) of a vllm-omni deploy config (1, stage 0 only, when it has no stages list)."""
    try:
        config_ = yaml.safe_load(deploy_yaml)
    except yaml.YAMLError as err:
        raise _Refused(f"deploy config is not YAML: {err}") from None
    stages = config_.get("stages") if isinstance(config_, dict) else None
    return len(stages) if isinstance(stages, list) and stages else 1


def _container_env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: _expand(e.get("value", ""), pod) for e in _engine_container(pod).get("env") or []
            if e.get("name", "").startswith(PASSED_ENV_PREFIX) and "valueFrom" not in e}


def _base_env() -> dict[str, str]:
    """The runtime's environment as its stand-ins get it: no proxy variables, this tree importable."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(NO_CUDA_ENV)
    # Offline from the first import: huggingface_hub reads HF_HUB_OFFLINE once, at import, which for
    # a child of the fork server happened in the server, before head.py's own setting.
    env.update(realpod.OFFLINE_ENV)
    env.update({"PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    return env


def _child_env(ip: str, pod: dict[str, Any]) -> dict[str, str]:
    base = _base_env()
    env = {**base, **_container_env(pod)}  # the pod's contract variables win over the runtime's own
    env.update({
        "PYTHONUNBUFFERED": base["PYTHONUNBUFFERED"],  # ... but not over these
        "PYTHONPATH": base["PYTHONPATH"],
        # vLLM / vllm-omni otherwise find their address with a UDP route probe to a public IP.
        "VLLM_HOST_IP": ip,
        "POD_IP": ip,
        "POD_NAME": pod["metadata"]["name"],
        "POD_NAMESPACE": pod["metadata"]["namespace"],
    })
    return env
