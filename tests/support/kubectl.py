"""The kubectl wrapper of the cluster, GPU and bench tiers (and, through a subclass, helm's).

kubectl("get", "pods", "-n", ns) returns the CompletedProcess (text); it raises KubectlError, whose
message carries the command, its exit code, stderr and stdout, unless check=False.
kubectl.json(...) adds -o json and parses. `binary` and `kubeconfig` are public: the stand-in
harness's HeadEndpoint and port_forward start their own `kubectl port-forward` from them.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.support import kube_rest

ROOT = Path(__file__).resolve().parents[2]


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{' '.join(self.cmd)} exited {self.returncode}:\n{self.stderr}{self.stdout}"


class Kubectl:
    """A CLI pointed at one cluster by --kubeconfig. `timeout` is each call's default bound (a GPU
    cluster's API server is slower to answer than the local one); `env` and `cwd` are the process's
    (None: this one's)."""

    def __init__(self, binary: str, kubeconfig: str | Path, timeout: float = 60,
                 env: dict[str, str] | None = None, cwd: Path | None = None):
        self.binary, self.kubeconfig = binary, kubeconfig
        self.timeout, self.env, self.cwd = timeout, env, cwd

    def __call__(self, *args: str, check: bool = True, input: str | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [self.binary, f"--kubeconfig={self.kubeconfig}", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, input=input, check=False,
                              timeout=self.timeout if timeout is None else timeout, env=self.env, cwd=self.cwd)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def json(self, *args: str, **kw: Any) -> Any:
        answer = self._read(args, kw)
        return answer if answer is not None else json.loads(self(*args, "-o", "json", **kw).stdout)

    def exists(self, *ref: str) -> bool:
        """Whether the object (kind name, and -n NS) is there; never raises for a missing one."""
        try:
            answer = self._read(("get", *ref), {})
        except KubectlError:
            return False
        if answer is not None:
            return bool(answer["items"]) if answer.get("kind") == "List" else True
        return self("get", *ref, "--ignore-not-found", "-o", "name", check=False).stdout.strip() != ""

    def _read(self, args: tuple[str, ...], kw: dict[str, Any]) -> Any | None:
        """A plain `get` over HTTP (kube_rest says which and why), else None: kubectl answers it. Only
        for this process's own environment (a Kubectl with env of its own may carry credentials there)."""
        if self.env is not None or set(kw) - {"timeout"}:
            return None
        try:
            return kube_rest.get(self.kubeconfig, args, kw.get("timeout") or self.timeout)
        except LookupError as missing:
            cmd = [self.binary, f"--kubeconfig={self.kubeconfig}", *args, "-o", "json"]
            raise KubectlError(1, cmd, "", str(missing)) from None


def k8s_bin_dir() -> Path | None:
    """Where hack/build-k8s-bins.sh cached the Kubernetes binaries it built (with --check it builds
    nothing), or None."""
    proc = subprocess.run(["bash", str(ROOT / "hack" / "build-k8s-bins.sh"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    return Path(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None


def cached_binary(name: str, env: str) -> str | None:
    """The binary `name` (kubectl, helm) the environment variable `env` names, else the cached build's,
    else None."""
    if os.environ.get(env):
        return os.environ[env]
    bin_dir = k8s_bin_dir()
    return str(bin_dir / name) if bin_dir is not None else None
