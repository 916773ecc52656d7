"""What a kubelet would run for an engine pod, as a process on this machine (the runtime's real mode).

The local runtime (tests/standin/runtime.py) normally starts a stand-in for an engine pod. In real
mode it executes the pod's own container instead: the rendered command and args (`vllm serve ...
--omni ...`, or the pool supervisor), the rendered environment (values, downward-API fields,
Secret and ConfigMap keys, `$(VAR)` expansion), and the ConfigMap, Secret and emptyDir volumes
written to a directory of the pod's own. This module is the pure part: a pod and the objects it
references in, a `PodProcess` (argv, env, files to write) out.

There is no container, so what an image and a mount namespace would give is mapped, each in ONE
place below, and nothing else is changed:

* `EngineImage`: the engine image's filesystem is a virtual environment on this machine (the CPU
  engine environment, hack/real-engine-env.sh); its bin directory is the container's PATH, its
  `env` the image's ENV lines. `models` maps a `spec.model` name to a local directory (the tiny
  random-weight model): the ONLY argument rewritten by value.
* `extra_plugins`: vLLM plugins the image adds to the rendered `VLLM_PLUGINS` allow-list (the
  test-only CPU platform plugin of vllm-omni, which a GPU image does not need).
* mounts: a path under a volume's mountPath, in an arg or an env value, becomes the same path under
  the pod's directory (`/etc/omnistage/deploy.yaml` -> `<pod dir>/config/deploy.yaml`); `/dev/shm`
  stays the host's (Python's shared memory has no other place).
* `--host 0.0.0.0`: the pod's own IP (every pod IP here is a loopback address; binding all
  interfaces would listen on the host's).

Anything else a real kubelet would do that this cannot (a PVC, a hostPath outside /dev/shm, a
resourceFieldRef) is refused with what to change: such a pod is not started, never run half-right.

Product code in operator/ must never import this module.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHM = "/dev/shm"
ALL_INTERFACES = "0.0.0.0"
# The image's environment: offline and quiet (the network rule: nothing dials a hub or a telemetry
# endpoint), as an engine image for an air-gapped cluster would set them.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    "LANG": "C.UTF-8",
}
# The CPU engine image's own settings. vLLM's CPU backend binds each engine's OpenMP threads to core 0
# by default ("auto": the first NUMA node's cores minus one reserved); with several engines on a
# 2-core machine they all share that core and a busy head starves a replica starting beside it.
CPU_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# The test-only plugins the CPU image adds to VLLM_PLUGINS (tests/cpu_engine/cpu_platform): vllm-omni's
# CPU platform, the probe of what each engine core admitted, and the CPU's stage defaults.
CPU_TEST_PLUGINS = ("omnistage_cpu", "omnistage_feature_probe", "omnistage_cpu_defaults")
# The source folders of the engine plugin and the test-only CPU platform plugin in this checkout.
PLUGIN_SOURCES = (Path(__file__).resolve().parents[2] / "engine_patches",
                  Path(__file__).resolve().parents[1] / "cpu_engine" / "cpu_platform")
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class NotYet(Exception):
    """A referenced object does not exist yet (the operator writes it first): retry, as a kubelet does."""


class Refused(Exception):
    """This pod cannot run here as rendered; the message says what to change."""


@dataclass(frozen=True)
class EngineImage:
    """The engine image, as this machine provides it (see the module doc)."""

    bin_dir: Path
    models: dict[str, Path] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=lambda: dict(OFFLINE_ENV))
    extra_plugins: tuple[str, ...] = ()
    #: Other images this machine provides, by the container's image reference (an engine upgrade: the
    #: OmniStage's spec.engine.image moves to one of them). Every other reference runs this image.
    others: dict[str, EngineImage] = field(default_factory=dict)

    def for_reference(self, reference: str | None) -> EngineImage:
        return self.others.get(reference or "", self)


def cpu_engine_image(venv: Path, models: dict[str, Path]) -> EngineImage:
    """The CPU engine "image" of the real-engine tier and `make demo`: hack/real-engine-env.sh's venv,
    with THIS checkout's plugins first on PYTHONPATH (as the kind engine image puts them,
    hack/kind/images.py). The venv's editable install points at whichever checkout ran
    real-engine-env.sh: a second worktree or a clone would otherwise test another tree's plugin."""
    plugins = os.pathsep.join(str(d) for d in PLUGIN_SOURCES)
    return EngineImage(bin_dir=venv / "bin", models=models,
                       env={**OFFLINE_ENV, **CPU_ENGINE_ENV, "PYTHONPATH": plugins},
                       extra_plugins=CPU_TEST_PLUGINS)


@dataclass
class PodProcess:
    argv: list[str]
    env: dict[str, str]
    files: dict[Path, tuple[bytes, int]]   # path -> (content, mode): the ConfigMap and Secret volumes
    dirs: list[Path]                        # emptyDirs and the pod's HOME and TMPDIR
    mounts: dict[str, str]                  # container mountPath -> directory on this machine


Lookup = Callable[[str, str], dict[str, Any] | None]  # (kind, name) -> object as JSON, None if absent


def engine_container(pod: dict[str, Any]) -> dict[str, Any]:
    containers = pod["spec"].get("containers") or [{}]
    return next((c for c in containers if c.get("name") == "engine"), containers[0])


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: defined names are replaced, `$$` is a literal `$`, and an
    undefined reference is left as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return VAR_REF.sub(sub, value)


def _field(pod: dict[str, Any], path: str) -> str:
    meta, status, spec = pod["metadata"], pod.get("status") or {}, pod["spec"]
    simple = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
              "metadata.uid": meta.get("uid"), "status.podIP": status.get("podIP"),
              "status.hostIP": status.get("hostIP"), "spec.nodeName": spec.get("nodeName"),
              "spec.serviceAccountName": spec.get("serviceAccountName")}
    if path in simple:
        return simple[path] or ""
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    raise Refused(f"fieldRef {path!r} is not supported by the real-mode runtime")


def _key(lookup: Lookup, kind: str, ref: dict[str, Any]) -> str | None:
    obj = lookup(kind, ref["name"])
    if obj is None:
        if ref.get("optional"):
            return None
        raise NotYet(f"{kind} {ref['name']} not found yet")
    if kind == "Secret":
        raw = (obj.get("data") or {}).get(ref["key"])
        value = base64.b64decode(raw).decode() if raw is not None else None
    else:
        value = (obj.get("data") or {}).get(ref["key"])
    if value is None and not ref.get("optional"):
        raise NotYet(f"{kind} {ref['name']} has no key {ref['key']!r} yet")
    return value


def container_env(pod: dict[str, Any], lookup: Lookup) -> dict[str, str]:
    """The container's environment as a kubelet builds it: envFrom, then env in order, each value
    expanded against the variables defined before it."""
    c, env = engine_container(pod), {}
    for src in c.get("envFrom") or []:
        kind, ref = ("Secret", src["secretRef"]) if "secretRef" in src else ("ConfigMap", src["configMapRef"])
        obj = lookup(kind, ref["name"])
        if obj is None:
            if ref.get("optional"):
                continue
            raise NotYet(f"{kind} {ref['name']} not found yet")
        for k, v in (obj.get("data") or {}).items():
            env[(src.get("prefix") or "") + k] = base64.b64decode(v).decode() if kind == "Secret" else v
    for e in c.get("env") or []:
        source = e.get("valueFrom")
        if source is None:
            env[e["name"]] = expand(e.get("value", ""), env)
        elif "fieldRef" in source:
            env[e["name"]] = _field(pod, source["fieldRef"]["fieldPath"])
        elif "secretKeyRef" in source or "configMapKeyRef" in source:
            kind = "Secret" if "secretKeyRef" in source else "ConfigMap"
            value = _key(lookup, kind, source["secretKeyRef" if kind == "Secret" else "configMapKeyRef"])
            if value is not None:
                env[e["name"]] = value
        else:
            raise Refused(f"env {e['name']}: {sorted(source)} is not supported by the real-mode runtime")
    return env


def _volume_files(volume: dict[str, Any], lookup: Lookup, target: Path) -> dict[Path, tuple[bytes, int]]:
    kind = "ConfigMap" if "configMap" in volume else "Secret"
    source = volume["configMap"] if kind == "ConfigMap" else volume["secret"]
    name = source["name"] if kind == "ConfigMap" else source["secretName"]
    obj = lookup(kind, name)
    if obj is None:
        if source.get("optional"):
            return {}
        raise NotYet(f"{kind} {name} (volume {volume['name']}) not found yet")
    data = dict(obj.get("data") or {})
    if kind == "Secret":
        contents = {k: base64.b64decode(v) for k, v in data.items()}
    else:
        contents = {k: v.encode() for k, v in data.items()}
        contents.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    items = source.get("items")
    paths = {i["key"]: i["path"] for i in items} if items else {k: k for k in contents}
    mode = 0o600 if kind == "Secret" else 0o644
    missing = [k for k in paths if k not in contents]
    if missing:
        raise NotYet(f"{kind} {name} has no key {missing[0]!r} yet")
    return {target / paths[k]: (contents[k], mode) for k in paths}


def _projected_files(pod: dict[str, Any], volume: dict[str, Any], lookup: Lookup,
                     target: Path) -> dict[Path, tuple[bytes, int]]:
    """A projected volume, e.g. the ServiceAccount's kube-api-access volume the API server adds to
    every pod: ConfigMap and Secret items, downward-API fields, and a token (`lookup("ServiceAccountToken",
    audience)` asks the API server for one, as the kubelet does; an engine never uses it)."""
    files: dict[Path, tuple[bytes, int]] = {}
    for src in volume["projected"].get("sources") or []:
        if "configMap" in src or "secret" in src:
            kind = "configMap" if "configMap" in src else "secret"
            inner = {"name": volume["name"], kind: {**src[kind], **({"secretName": src[kind]["name"]}
                                                                    if kind == "secret" else {})}}
            files.update(_volume_files(inner, lookup, target))
        elif "downwardAPI" in src:
            for item in src["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise Refused(f"volume {volume['name']}: downwardAPI {sorted(item)} is not supported")
                files[target / item["path"]] = (_field(pod, item["fieldRef"]["fieldPath"]).encode(), 0o644)
        elif "serviceAccountToken" in src:
            token = lookup("ServiceAccountToken", src["serviceAccountToken"].get("audience") or "")
            if token is None:
                raise NotYet(f"no token for the pod's ServiceAccount yet (volume {volume['name']})")
            files[target / src["serviceAccountToken"]["path"]] = (token["token"].encode(), 0o600)
        else:
            raise Refused(f"volume {volume['name']}: projected source {sorted(src)} is not supported")
    return files


def _mounts(pod: dict[str, Any], lookup: Lookup, root: Path) -> tuple[dict[str, str], dict, list[Path]]:
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    mounts: dict[str, str] = {}
    files: dict[Path, tuple[bytes, int]] = {}
    dirs: list[Path] = []
    for m in engine_container(pod).get("volumeMounts") or []:
        path, v = m["mountPath"].rstrip("/") or "/", volumes.get(m["name"])
        if v is None:
            raise Refused(f"volumeMount {m['name']} names no volume of the pod")
        if m.get("subPath"):
            raise Refused(f"volumeMount {m['name']}: subPath is not supported by the real-mode runtime")
        host = root / "volumes" / m["name"]
        if path == SHM:
            mounts[path] = SHM  # the host's: Python's shared memory (multiprocessing, torch) lives there
            continue
        if "configMap" in v or "secret" in v:
            files.update(_volume_files(v, lookup, host))
            dirs.append(host)
        elif "projected" in v:
            files.update(_projected_files(pod, v, lookup, host))
            dirs.append(host)
        elif "emptyDir" in v:
            dirs.append(host)
        elif "hostPath" in v and v["hostPath"]["path"].startswith(SHM + "/"):
            host = Path(v["hostPath"]["path"])  # sameNode's shared /dev/shm directory: it is on this host
            dirs.append(host)
        else:
            kind = next((k for k in v if k != "name"), "?")
            raise Refused(f"volume {m['name']} ({kind}) cannot be mounted by the real-mode runtime: "
                          "use a ConfigMap, Secret or emptyDir volume")
        mounts[path] = str(host)
    return mounts, files, dirs


def localize(value: str, mounts: dict[str, str]) -> str:
    """A container path under a mount -> the same path in the directory standing in for it."""
    if "=" in value and value.startswith("--"):
        flag, _, rest = value.partition("=")
        return f"{flag}={localize(rest, mounts)}"
    for mount in sorted(mounts, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return mounts[mount] + value[len(mount):]
    return value


def _args(args: list[str], image: EngineImage, pod_ip: str) -> list[str]:
    out = []
    for i, a in enumerate(args):
        if i > 0 and args[i - 1] == "--host" and a == ALL_INTERFACES:
            a = pod_ip
        elif a.startswith("--host=") and a.endswith("=" + ALL_INTERFACES):
            a = f"--host={pod_ip}"
        elif a in image.models:
            a = str(image.models[a])
        out.append(a)
    return out


def _plugins(value: str, extra: tuple[str, ...]) -> str:
    names = [n for n in value.split(",") if n]
    return ",".join(names + [n for n in extra if n not in names])


def pod_process(pod: dict[str, Any], lookup: Lookup, image: EngineImage, root: Path,
                tmp: Path | None = None) -> PodProcess:
    """The process a kubelet would run for `pod`'s engine container, mapped onto this machine. `tmp`
    is its TMPDIR (default root/tmp): keep it short, vLLM puts ZMQ ipc:// sockets there and a Unix
    socket path has at most 107 bytes."""
    c = engine_container(pod)
    image = image.for_reference(c.get("image"))
    pod_ip = (pod.get("status") or {}).get("podIP") or ""
    if not c.get("command"):
        raise Refused("the engine container has no command: the real-mode runtime runs no image entrypoint")
    mounts, files, dirs = _mounts(pod, lookup, root)
    env = {k: localize(v, mounts) for k, v in container_env(pod, lookup).items()}
    if "VLLM_PLUGINS" in env:
        env["VLLM_PLUGINS"] = _plugins(env["VLLM_PLUGINS"], image.extra_plugins)
    argv = [localize(expand(a, env), mounts) for a in [*c["command"], *(c.get("args") or [])]]
    argv = _args(argv, image, pod_ip)
    if (image.bin_dir / argv[0]).exists():
        argv[0] = str(image.bin_dir / argv[0])  # the image's PATH
    home, tmp = root / "home", tmp or root / "tmp"
    base = {"PATH": f"{image.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp),
            "HOSTNAME": pod["metadata"]["name"]}
    return PodProcess(argv=argv, env={**base, **image.env, **env}, files=files, dirs=[home, tmp, *dirs],
                      mounts=mounts)
