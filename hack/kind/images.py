"""Build the two images the kind tier runs, here, with no registry (hack/kind/e2e.sh calls it):

  omnistage-local/omnistage-operator:dev   the Dockerfile's `operator` target, unchanged. Its base is
      passed as PYTHON_IMAGE: Debian's python3.11 (build.sh's "slim") plus a wheelhouse of the
      operator's dependencies downloaded on the host, with PIP_NO_INDEX/PIP_FIND_LINKS so the
      Dockerfile's own `pip install` lines resolve offline (a container here has no network).
  omnistage-local/omnistage-engine-cpu:dev  test-only: the CPU engine. vLLM 0.30.0 for the CPU,
      vllm-omni 0.30.0 and torch are the real-engine tier's venv, mounted read-only from the host
      (6.8 GB: baking it in and `kind load`ing it into two nodes would copy it three times); the
      image holds this checkout's plugin and the test-only CPU platform as wheels (PYTHONPATH, so
      they win over the venv's editable copies), the CPU environment of tests/standin/realpod.py, and
      a `vllm` that appends the test plugins to the VLLM_PLUGINS the operator renders.

Then both are checked: the operator image runs `omnistage --help` as its non-root user; the engine
image reports its plugin, vllm and vllm-omni versions. Prints figures (build seconds, sizes).
  python hack/kind/images.py [--load CLUSTER] [--kind BIN]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.standin.realpod import CPU_ENGINE_ENV, CPU_TEST_PLUGINS, OFFLINE_ENV

DOCKER = "/usr/bin/docker"
CACHE = Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))
SLIM = "omnistage-local/slim:bookworm"        # hack/kind/build.sh
ENGINE_BASE = "omnistage-local/engine:bookworm"  # slim + torch's and opencv's shared libraries
OPERATOR_IMAGE = "omnistage-local/omnistage-operator:dev"
ENGINE_IMAGE = "omnistage-local/omnistage-engine-cpu:dev"
# Where the kind workers mount the host's engine environment (hack/kind/up.sh) and the pods too.
ENGINE_VENV = "/opt/omnistage-engine"
PLUGINS_DIR = "/opt/omnistage/plugins"
OPERATOR_UID = "65532"


def log(msg: str) -> None:
    print(f"[images {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(*cmd: str | Path, **kw) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)
    except subprocess.CalledProcessError as e:
        sys.stderr.write(f"{' '.join(map(str, cmd))} failed ({e.returncode}):\n{e.stdout or ''}{e.stderr or ''}")
        raise


def size(image: str) -> str:
    b = int(run(DOCKER, "image", "inspect", "-f", "{{.Size}}", image, capture_output=True).stdout)
    return f"{b / 2**20:.0f} MiB"


def operator_requirements() -> list[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    return [d for d in deps if not d.startswith("omnistage-")] + build + ["wheel"]


def wheelhouse_image() -> str:
    """slim + the operator's dependency wheels (and its build backend), keyed by the requirement list."""
    reqs = operator_requirements()
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    tag = f"omnistage-local/python-wheels:3.11-{key}"
    if subprocess.run([DOCKER, "image", "inspect", tag], capture_output=True, check=False).returncode == 0:
        return tag
    with tempfile.TemporaryDirectory() as ctx:
        wheels = Path(ctx) / "wheels"
        log(f"downloading {len(reqs)} requirements' wheels for cp311 manylinux (on the host: containers have no network)")
        run(sys.executable, "-m", "pip", "download", "-q", "-d", wheels, "--only-binary=:all:",
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any", *reqs)
        (Path(ctx) / "Dockerfile").write_text(
            f"FROM {SLIM}\nCOPY wheels/ /wheels/\n"
            "# The Dockerfile's pip installs resolve from here: no index is reachable from a container.\n"
            "ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels\n")
        run(DOCKER, "build", "-q", "-t", tag, ctx, capture_output=True)
    return tag


def operator_image() -> None:
    base = wheelhouse_image()
    run(DOCKER, "build", "-q", "--target", "operator", "--build-arg", f"PYTHON_IMAGE={base}",
        "--build-arg", f"REVISION={git_revision()}", "-t", OPERATOR_IMAGE, ROOT, capture_output=True)


def git_revision() -> str:
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    return r.stdout.strip() or "unknown"


def engine_image() -> None:
    env = {**OFFLINE_ENV, **CPU_ENGINE_ENV, "PYTHONPATH": PLUGINS_DIR}
    plugins = ",".join(CPU_TEST_PLUGINS)
    with tempfile.TemporaryDirectory() as ctx:
        # From copies: setuptools writes build/ and *.egg-info next to the sources it builds.
        srcs = []
        for src in (ROOT / "engine_patches", ROOT / "tests" / "cpu_engine" / "cpu_platform"):
            srcs.append(Path(ctx) / "src" / src.name)
            shutil.copytree(src, srcs[-1], ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", Path(ctx) / "wheels", *srcs,
            capture_output=True)
        shim = Path(ctx) / "vllm"
        shim.write_text(
            "#!/bin/sh\n# The operator renders VLLM_PLUGINS for a GPU image; this CPU image adds its test-only plugins.\n"
            f'export VLLM_PLUGINS="${{VLLM_PLUGINS:+$VLLM_PLUGINS,}}{plugins}"\n'
            f'exec {ENGINE_VENV}/bin/python -m vllm.entrypoints.cli.main "$@"\n')
        shim.chmod(0o755)  # the legacy builder (no BuildKit here) keeps the mode; it has no COPY --chmod
        envs = " ".join(f"{k}={json.dumps(v)}" for k, v in env.items())
        (Path(ctx) / "Dockerfile").write_text(f"""FROM {ENGINE_BASE}
COPY wheels/ /tmp/wheels/
RUN pip install -q --no-index --no-deps --target {PLUGINS_DIR} /tmp/wheels/*.whl && rm -rf /tmp/wheels
COPY vllm /usr/local/bin/vllm
ENV {envs}
""")
        run(DOCKER, "build", "-q", "-t", ENGINE_IMAGE, ctx, capture_output=True)


def check_operator() -> str:
    out = run(DOCKER, "run", "--rm", "--network", "none", "--entrypoint", "sh", OPERATOR_IMAGE, "-c",
              "id -u; omnistage --help | head -3", capture_output=True).stdout
    uid, *helptext = out.splitlines()
    assert uid == OPERATOR_UID, f"the operator image runs as uid {uid}, not {OPERATOR_UID}"
    assert any("usage" in line.lower() for line in helptext), out
    return f"uid {uid}, `omnistage --help`: {helptext[0].strip()}"


def engine_mounts() -> list[str]:
    venv = Path(os.environ.get("OMNISTAGE_CPU_VENV", CACHE / "venv-cpu"))
    home = next(line.split("=", 1)[1].strip() for line in (venv / "pyvenv.cfg").read_text().splitlines()
                if line.startswith("home"))
    prefix = str(Path(home).parent)
    return ["-v", f"{venv}:{ENGINE_VENV}:ro", "-v", f"{prefix}:{prefix}:ro"]


def check_engine() -> str:
    probe = ("import importlib.metadata as m, omnistage_engine_patches as p\n"
             "from omnistage_engine_patches import report\n"
             "print(m.version('omnistage-engine-patches'), report.vllm_version(), m.version('vllm-omni'), p.__file__)")
    out = run(DOCKER, "run", "--rm", "--network", "none", *engine_mounts(), "--entrypoint", f"{ENGINE_VENV}/bin/python",
              ENGINE_IMAGE, "-c", probe, capture_output=True).stdout.split()
    plugin, vllm, omni, where = out
    assert vllm == "0.30.0" and omni == "0.30.0", out
    assert where.startswith(PLUGINS_DIR), f"the plugin loads from {where}, not the image's {PLUGINS_DIR}"
    return f"plugin {plugin} (from {PLUGINS_DIR}), vllm {vllm}, vllm-omni {omni}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load", metavar="CLUSTER", help="kind load both images into this cluster")
    ap.add_argument("--kind", default="kind", help="the kind binary")
    a = ap.parse_args()
    for name, build in (("operator", operator_image), ("engine-cpu", engine_image)):
        t = time.monotonic()
        build()
        log(f"{name} image built in {time.monotonic() - t:.0f}s")
    log(f"{OPERATOR_IMAGE} {size(OPERATOR_IMAGE)}: {check_operator()}")
    log(f"{ENGINE_IMAGE} {size(ENGINE_IMAGE)} (+ the mounted venv, {du(engine_mounts()[1].split(':')[0])}): {check_engine()}")
    if a.load:
        t = time.monotonic()
        # The workers only: nothing of ours runs on the control plane (its taint), and each node is a copy.
        workers = ",".join(n for n in run(a.kind, "get", "nodes", "--name", a.load, capture_output=True).stdout.split()
                           if "control-plane" not in n)
        run(a.kind, "load", "docker-image", OPERATOR_IMAGE, ENGINE_IMAGE, "--name", a.load, "--nodes", workers,
            capture_output=True)
        log(f"loaded into kind cluster {a.load} in {time.monotonic() - t:.0f}s")


def du(path: str) -> str:
    out = subprocess.run(["du", "-sh", path], capture_output=True, text=True, check=False).stdout.split()
    return out[0] if out else "?"


if __name__ == "__main__":
    main()
