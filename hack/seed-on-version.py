#!/usr/bin/env python3
"""The seed's failure, measured per engine version, with the plugin off and on (issue 42, item 2).

For each engine version and plugin setting asked for, one real head and one joined headless replica
on the CPU, each running the command the operator renders for the tiny OmniStage
(tests/cpu_engine/omnistage.yaml, replicas 2, round-robin routing), mapped onto this machine the way
the real-engine tier's runtime maps a pod (tests/standin/realpod.py): the venv of the version
(hack/real-engine-env.sh) is the image, loopback addresses are the pod IPs. No cluster, no operator:
this script renders the pods, starts the processes and, with the plugin on, joins the replica through
the head's membership port as the operator would (the head holds an unjoined replica unroutable).

Then the seed's sequence (tests/engine/test_replica_aware_cache.py SEQUENCE_28: 28 chat requests,
6 audio clips, fresh ones and repeats) one at a time through the head. A request without a complete
answer is retried with the same body (--retries, default once): by default on the engine that failed
(a request without media first, so round-robin sends the retry there: does the frontend now send the
tensor?), with --retry-on next at once (round-robin: the other engine). Each answer is attributed to
the engine whose success counter moved on the head's /metrics, or whose log got the miss line. The
answers are counted: HTTP 200 complete, HTTP 200 with finish_reason "error", HTTP 503, HTTP 500,
others; and the retries. The last lines print every run side by side.

    hack/seed-on-version.py                                   # 0.32 and 0.30, plugin off and on
    hack/seed-on-version.py --versions 0.32 --patches off on  # one version
    hack/seed-on-version.py --patches off --retries 0         # the sequence alone, no retry

Only one head and one replica run at a time (about 4.4 GB and 3.6 GB); each run stops its engines
(their process groups) before the next starts, also on an error or Ctrl-C. Engine logs stay in
--work (default /tmp/omnistage-seed). Loopback only: every address dialled is in 127.0.0.0/8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "operator", ROOT / "engine_patches"):
    sys.path.insert(0, str(p))

import yaml
from omnistage.render import render_children, target_from
from omnistage_engine_patches import contract

from tests.cpu_engine import client
from tests.standin import realpod
from tests.support.loopback import loopback_ip

CACHE = Path(os.environ.get("OMNISTAGE_CACHE", Path.home() / ".cache" / "omnistage"))
VENVS = {"0.30": CACHE / "venv-cpu", "0.32": CACHE / "venv-cpu-0.32"}
TINY_MODEL = Path(os.environ.get("OMNISTAGE_TINY_MODEL", CACHE / "tiny-omni"))
TINY_MODEL_NAME = "omnistage-test/tiny-qwen2.5-omni-thinker"
SAMPLE = ROOT / "tests" / "cpu_engine" / "omnistage.yaml"
# The GPU reproduction's shape (seed 000), as tests/engine/test_replica_aware_cache.py has it.
SEQUENCE_28 = [0, 1, 2, 2, 2, 3, 3, 0, 1, 0, 0, 1, 1, 4, 4, 4, 4, 2, 3, 5, 5, 0, 5, 1, 4, 2, 3, 3]
AUDIO_SEED0 = 300  # clip k is client.wav(AUDIO_SEED0 + k): media no earlier request of the head saw
START_TIMEOUT = 30 * 60
CACHE_MISS = "Multi-modal cache miss for request"  # an engine core's log line, 0.30 and 0.32 (realstage.py)
HEALTH_PATH = "/health"
REAL_NICE = 10  # the real-engine tier's: beside other work on the machine


def log(msg: str) -> None:
    print(f"[seed {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the pods, rendered by the operator and mapped onto this machine -----------------------------

def render(name: str, head_ip: str, token: str) -> dict[str, Any]:
    manifest = yaml.safe_load(SAMPLE.read_text())
    manifest["metadata"]["name"], manifest["spec"]["replicas"] = name, 2
    children = render_children(target_from(manifest), token, head_ip, "seed-head-uid").all()
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def pod_process(objs: dict, pod_name: str, ip: str, venv: Path, root: Path,
                patches: str) -> realpod.PodProcess:
    pod = json.loads(json.dumps(objs[("Pod", pod_name)]))
    pod.setdefault("status", {})["podIP"] = ip
    c = realpod.engine_container(pod)
    # The master Service's DNS name is for a replica whose head was replaced; nothing here resolves names.
    c["env"] = [e for e in c.get("env") or [] if e["name"] != contract.MASTER_SERVICE_ENV]
    if patches == "off":
        c["env"].append({"name": contract.DISABLE_PATCHES_ENV, "value": "all"})
    image = realpod.cpu_engine_image(venv, {TINY_MODEL_NAME: TINY_MODEL})
    return realpod.pod_process(pod, lambda kind, n: objs.get((kind, n)), image, root, tmp=root / "t")


@dataclass
class Engine:
    name: str
    ip: str
    proc: realpod.PodProcess
    log_path: Path
    popen: subprocess.Popen | None = None

    def start(self) -> None:
        for d in self.proc.dirs:
            d.mkdir(parents=True, exist_ok=True)
        for path, (content, mode) in self.proc.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            path.chmod(mode)
        with open(self.log_path, "ab") as f:
            f.write(f"===== {' '.join(self.proc.argv)}\n".encode())
            f.flush()
            self.popen = subprocess.Popen(self.proc.argv, cwd=self.proc.env["HOME"], env=self.proc.env,
                                          stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        with contextlib.suppress(OSError):  # as the real-engine tier's runtime (tests/standin/processes.py)
            os.setpriority(os.PRIO_PROCESS, self.popen.pid, REAL_NICE)
        log(f"{self.name} started, pid {self.popen.pid}, ip {self.ip}, log {self.log_path}")

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """Its whole process group (the API server, the engine core, its workers): TERM, then KILL."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        log(f"{self.name} stopped (exit {self.popen.returncode})")


def http(url: str, body: dict | None = None, token: str | None = None,
         timeout: float = 10) -> tuple[int | None, Any]:
    client._check_loopback(url)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None,
                                 headers=headers, method="POST" if body is not None else "GET")
    try:
        with client._OPENER.open(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read().decode(errors="replace")
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text
    except (urllib.error.URLError, OSError):
        return None, None


def wait(what: str, check, engines: list[Engine], timeout: float = START_TIMEOUT, every: float = 5) -> Any:
    t0, said = time.monotonic(), 0.0
    while True:
        got = check()
        if got:
            log(f"{what}: after {time.monotonic() - t0:.0f}s")
            return got
        for e in engines:
            if not e.alive():
                raise RuntimeError(f"{e.name} exited ({e.popen.returncode}) while waiting for {what}:\n"
                                   f"{e.tail(40)}")
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        if time.monotonic() - said > 60:
            said = time.monotonic()
            log(f"waiting for {what} ({said - t0:.0f}s)")
        time.sleep(every)


def served(base: str) -> dict[str, int]:
    try:
        return client.served_by(client.get(base + "/metrics"))
    except (OSError, urllib.error.URLError):
        return {}


def misses(e: Engine) -> int:
    return e.log_path.read_text(errors="replace").count(CACHE_MISS)


# ---- one run -------------------------------------------------------------------------------------

@dataclass
class Outcome:
    version: str
    patches: str
    versions: str = ""
    frontend: str = ""
    retry_on: str = "same"
    results: list[client.Result] = field(default_factory=list)
    where: list[str] = field(default_factory=list)  # the engine of each first answer (or of its miss)
    retries: list[tuple[int, client.Result, str]] = field(default_factory=list)
    served_by: dict[str, int] = field(default_factory=dict)
    misses_logged: dict[str, int] = field(default_factory=dict)
    start_seconds: float = 0.0
    error: str = ""

    @staticmethod
    def kind(r: client.Result) -> str:
        if r.complete:
            return "200 complete"
        if r.status == 200 and r.finish_reason == "error":
            return "200 error"
        if r.status in (503, 500):
            return str(r.status)
        return "other"

    def counts(self, results: list[client.Result]) -> dict[str, int]:
        out = {"200 complete": 0, "200 error": 0, "503": 0, "500": 0, "other": 0}
        for r in results:
            out[self.kind(r)] += 1
        return out


@contextlib.contextmanager
def engines_of(version: str, patches: str, work: Path) -> Iterator[tuple[Engine, Engine, str, dict]]:
    venv = VENVS[version]
    if not (venv / "bin" / "vllm").exists():
        raise RuntimeError(f"no {venv}/bin/vllm: run OMNISTAGE_ENGINE_VERSION={version} "
                           "bash hack/real-engine-env.sh")
    run_dir = work / f"{version}-{patches}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    head_ip, replica_ip = loopback_ip(), loopback_ip()
    token = secrets.token_urlsafe(32)
    objs = render("tiny", head_ip, token)
    head = Engine("head", head_ip, pod_process(objs, "tiny-head", head_ip, venv, run_dir / "head", patches),
                  run_dir / "head.log")
    replica = Engine("replica", replica_ip,
                     pod_process(objs, "tiny-replica-1", replica_ip, venv, run_dir / "replica", patches),
                     run_dir / "replica.log")
    try:
        yield head, replica, token, objs
    finally:
        for e in (replica, head):
            e.stop()


def one_run(version: str, patches: str, work: Path, retries: int, retry_on: str) -> Outcome:
    out = Outcome(version, patches, retry_on=retry_on)
    log(f"==== vLLM {version}, plugin {patches}: a head and one headless replica ====")
    with engines_of(version, patches, work) as (head, replica, token, _objs):
        t0 = time.monotonic()
        base = f"http://{head.ip}:8000"
        port = head.proc.env.get(contract.MEMBERSHIP_PORT_ENV, contract.DEFAULT_MEMBERSHIP_PORT)
        membership = f"http://{head.ip}:{port}"
        head.start()
        wait("the head answers /health", lambda: http(base + HEALTH_PATH)[0] == 200, [head])
        replica.start()

        def attached() -> dict | None:
            status, listing = http(membership + contract.MEMBERSHIP_PATH, token=token)
            if status == 200:
                return next((m for m in (listing.get("stages") or {}).get("0") or []
                             if m.get("host") == replica.ip and m.get("state") == "attached"), None)
            # The plugin off: no membership port. The head's own log says when the replica attached.
            return "attached remote replica" in head.log_path.read_text(errors="replace") or None

        member = wait("the replica registered and attached", attached, [head, replica])
        if patches == "on":
            status, answer = http(membership + contract.JOIN_PATH,
                                  {"stage": 0, "pod": "tiny-replica-1", "ip": replica.ip, "waitSeconds": 30},
                                  token=token, timeout=60)
            log(f"join: HTTP {status} {json.dumps(answer)[:300]}")
            if status != 200:
                raise RuntimeError(f"the head refused the join: HTTP {status} {answer}")
        elif isinstance(member, dict):
            log(f"the replica as the head lists it: {member}")
        out.start_seconds = time.monotonic() - t0
        status, report = http(membership + contract.ENGINE_PATH, token=token)
        if status == 200:
            out.versions = f"vllm {report.get('vllmVersion')}, vllm-omni {report.get('vllmOmniVersion')}"
            out.frontend = str((report.get("frontendCache") or {}).get("cacheClass"))
            outcomes = {n: p.get("outcome") for n, p in (report.get("patches") or {}).items()}
            log(f"engine report: {out.versions}, frontend {report.get('frontendCache')}, patches {outcomes}")
        model = client.served_model(base)
        engines = {"0": head, "1": replica}  # stage-0 replica ids as the head's /metrics labels them

        def send(payload: dict, label: str) -> tuple[client.Result, str]:
            """The answer, and the engine that served it (its success counter moved) or logged its miss."""
            before = (served(base), {k: misses(e) for k, e in engines.items()})
            r = client.chat(base, payload, label)
            after = (served(base), {k: misses(e) for k, e in engines.items()})
            moved = [k for k in engines if after[0].get(k, 0) > before[0].get(k, 0)] \
                or [k for k in engines if after[1][k] > before[1][k]]
            where = "+".join(engines[k].name for k in moved) or "?"
            log(f"{r.line()}  [{Outcome.kind(r)}] on the {where}")
            return r, where

        for i, clip in enumerate(SEQUENCE_28):
            payload = client.body(model, "audio", AUDIO_SEED0 + clip)
            r, where = send(payload, f"#{i + 1:<2} clip {clip}")
            out.results.append(r)
            out.where.append(where)
            for k in range(retries if not r.complete else 0):
                if retry_on == "same":  # round-robin: a request without media first, the retry after it
                    send(client.body(model, "text", 0), f"#{i + 1:<2} text between")
                again, where = send(payload, f"#{i + 1:<2} clip {clip} retry {k + 1}")
                out.retries.append((i, again, where))
                if again.complete:
                    break
        with contextlib.suppress(OSError, urllib.error.URLError):
            out.served_by = client.served_by(client.get(base + "/metrics"))
        time.sleep(1)
        out.misses_logged = {e.name: misses(e) for e in (head, replica)}
    return out


def summary(o: Outcome) -> list[str]:
    if o.error:
        return [f"vLLM {o.version} plugin {o.patches}: did not run: {o.error}"]
    first, again = o.counts(o.results), o.counts([r for _, r, _ in o.retries])
    failed = len(o.results) - first["200 complete"]
    recovered = len({i for i, r, _ in o.retries if r.complete})
    failed_on = {e: sum(1 for r, w in zip(o.results, o.where, strict=True) if not r.complete and w == e)
                 for e in sorted(set(o.where))}
    retried_on = {e: sum(1 for _, _, w in o.retries if w == e) for e in sorted({w for _, _, w in o.retries})}
    on = {"same": "on the engine that failed (a request without media between)",
          "next": "at once"}[o.retry_on]
    def counted(c: dict[str, int]) -> str:
        return ", ".join(f"{k}: {v}" for k, v in c.items())

    return [(f"vLLM {o.version} plugin {o.patches} ({o.versions}; frontend {o.frontend}; up and joined in "
             f"{o.start_seconds:.0f}s)"),
            f"  first answers of {len(o.results)}: {counted(first)}",
            f"  failed {failed} of {len(o.results)}, by engine: {failed_on}",
            (f"  retried {on}: {len(o.retries)} retries ({retried_on}): {counted(again)}; "
             f"a retry succeeded for {recovered} of {failed}") if o.retries else "  not retried",
            (f"  finished per stage-0 replica (head /metrics): {o.served_by}; misses the engines logged "
             f"('{CACHE_MISS}'): {o.misses_logged}")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", nargs="+", default=["0.32", "0.30"], choices=sorted(VENVS))
    ap.add_argument("--patches", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--retries", type=int, default=1, help="retries of a request without a complete answer")
    ap.add_argument("--retry-on", choices=["same", "next"], default="same",
                    help="same: a request without media first, so round-robin sends the retry to the engine "
                         "that failed (does the frontend resend the tensor?); next: at once (the other one)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/omnistage-seed"))
    args = ap.parse_args()
    os.environ.setdefault("TMPDIR", "/tmp")
    outcomes = []
    for version in args.versions:
        for patches in args.patches:
            try:
                o = one_run(version, patches, args.work, args.retries, args.retry_on)
            except (RuntimeError, TimeoutError, OSError) as err:
                what = str(err).splitlines()[0] if str(err) else type(err).__name__
                o = Outcome(version, patches, error=what)
                log(f"vLLM {version} plugin {patches} failed: {err}")
            outcomes.append(o)
            for line in summary(o):
                log(line)
    print("\n==== the seed's sequence (28 requests, 6 audio clips, round-robin over a head and a joined "
          "replica) ====", flush=True)
    for o in outcomes:
        print("\n".join(summary(o)), flush=True)
    return 1 if any(o.error for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
