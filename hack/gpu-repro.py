#!/usr/bin/env python3
"""The serving reproduction on a real GPU cluster (docs/gpu-tests.md). Needs kubectl and KUBECONFIG.

Against a running OmniStage it checks, through `kubectl port-forward` to its API Service (so this
script only ever dials 127.0.0.1):
  1. the same new audio sent three times gives three answers (the defect: stop, error, stop);
  2. 64 concurrent requests repeating one audio all finish without finish_reason "error";
  3. 8 conversations of 4 turns at once, each turn sending a new audio clip and every earlier one
     again (as chat clients do), all finish without "error": the multi-turn traffic a replicated
     stage-0 cache must survive, in every cache mode (for `replica-aware`, the run that decides
     whether `auto` may resolve to it: docs/cache-modes.md);
  4. kubectl scale 1 -> 2 with stats on: the new replica's vllm:* series appear on the head's
     /metrics before it served traffic, and disappear after scaling back to 1.

    hack/gpu-repro.py --namespace serving --name qwen3-omni [--model SERVED_NAME]

The port is the OmniStage's spec.engine.httpPort; the model name is spec.model (or the
--served-model-name in spec.engine.extraArgs). The script scales the OmniStage and always puts
spec.replicas back to the value it found, also when a step fails or it is interrupted.
Environment: OMNISTAGE_KUBECTL (kubectl binary, default `kubectl` on PATH), KUBECONFIG.
Exit status 0 when every check passed, 1 when one failed, 2 when the reproduction could not run.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import io
import ipaddress
import json
import math
import os
import queue
import re
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Self

# The CRD's default of spec.engine.httpPort: the API server writes it into every stored object, so
# it is used only for an object read from somewhere else.
DEFAULT_HTTP_PORT = 8000
FORWARDING = re.compile(r"Forwarding from 127\.0\.0\.1:(\d+)")
# Never through a proxy: the only address this script dials is the port-forward on 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

Log = Callable[[str], None]


def _print(message: str) -> None:
    print(message, flush=True)


# ----- the OmniStage, read and scaled with kubectl -------------------------------------------------

def kubectl_binary() -> str:
    return os.environ.get("OMNISTAGE_KUBECTL") or "kubectl"


def run_kubectl(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run([kubectl_binary(), *args], capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


class OmniStage:
    """One OmniStage through kubectl (`run` is replaceable: the unit tests pass a fake)."""

    def __init__(self, namespace: str, name: str, run: Callable[..., str] = run_kubectl):
        self.namespace, self.name, self.run = namespace, name, run

    def get(self) -> dict[str, Any]:
        return json.loads(self.run("-n", self.namespace, "get", "omnistage", self.name, "-o", "json"))

    def scale(self, replicas: int) -> None:
        self.run("-n", self.namespace, "scale", "omnistage", self.name, f"--replicas={replicas}")


def http_port(obj: dict[str, Any]) -> int:
    """spec.engine.httpPort: the port of the head's API Service and container."""
    return int(((obj.get("spec") or {}).get("engine") or {}).get("httpPort") or DEFAULT_HTTP_PORT)


def served_model(obj: dict[str, Any]) -> str:
    """The name the OpenAI API serves: --served-model-name from spec.engine.extraArgs, else spec.model."""
    spec = obj.get("spec") or {}
    args = list((spec.get("engine") or {}).get("extraArgs") or [])
    for i, arg in enumerate(args):
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
        if arg == "--served-model-name" and i + 1 < len(args):
            return args[i + 1]
    return spec["model"]


def converged(obj: dict[str, Any], replicas: int) -> bool:
    """The operator has acted on the current spec and every one of `replicas` is Ready and registered."""
    st = obj.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    return (ready and st.get("observedGeneration") == obj["metadata"].get("generation")
            and st.get("readyReplicas") == replicas and st.get("registeredReplicas") == replicas)


def wait_converged(stage: OmniStage, replicas: int, timeout: float, interval: float = 10, log: Log = _print,
                   clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    deadline = clock() + timeout
    while True:
        obj = stage.get()
        st = obj.get("status") or {}
        if converged(obj, replicas):
            log(f"  {stage.name}: {replicas} replicas ready and registered")
            return
        log(f"  {stage.name}: ready {st.get('readyReplicas')}/{replicas}, registered {st.get('registeredReplicas')}")
        if clock() >= deadline:
            raise TimeoutError(f"{stage.name} did not reach {replicas} ready and registered replicas in {timeout:.0f}s")
        sleep(interval)


@contextlib.contextmanager
def replicas_restored(stage: OmniStage, log: Log = _print) -> Iterator[int]:
    """Yields spec.replicas as found; afterwards, whatever happened, sets it back if it changed."""
    original = int(stage.get()["spec"].get("replicas", 1))
    try:
        yield original
    finally:
        try:
            now = int(stage.get()["spec"].get("replicas", 1))
            if now != original:
                log(f"restoring {stage.name} to {original} replicas (found {now})")
                stage.scale(original)
        except Exception as err:  # noqa: BLE001 -- report, never hide the error that got us here
            log(f"could not restore {stage.name} to {original} replicas: {err}; "
                f"run: kubectl -n {stage.namespace} scale omnistage {stage.name} --replicas={original}")


# ----- HTTP on 127.0.0.1 only ----------------------------------------------------------------------

def _loopback(url: str) -> str:
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"refusing to dial {url}: this script only talks to its port-forward on 127.0.0.1")
    return url


def http_status(url: str, timeout: float = 5) -> int | None:
    """The HTTP status of GET url, or None when nothing answered (refused, reset, timed out)."""
    try:
        with _OPENER.open(_loopback(url), timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code  # an answer: the head's /health is 503 while a stage has no live replica
    except (urllib.error.URLError, OSError):
        return None


def wait_until_answers(url: str, timeout: float, alive: Callable[[], bool] = lambda: True,
                       interval: float = 0.2) -> int:
    """Poll url until the server answers with any HTTP status; returns it. Raises RuntimeError when
    alive() turns False (the port-forward died), TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if not alive():
            raise RuntimeError(f"gave up on {url}: the port-forward exited")
        status = http_status(url, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
        if status is not None:
            return status
        if time.monotonic() >= deadline:
            raise TimeoutError(f"nothing answered at {url} within {timeout:.0f}s")
        time.sleep(interval)


def tone_wav(freq: float, seconds: float = 1.0, rate: int = 16000) -> str:
    """A fresh sine tone, base64 WAV: media the frontend has never seen (a different frequency each run)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * i / rate)))
                               for i in range(int(seconds * rate))))
    return base64.b64encode(buf.getvalue()).decode()


@dataclass(frozen=True)
class Answer:
    finish_reason: str | None
    content: str

    @property
    def failed(self) -> bool:
        """The defect's signature: HTTP 200 with finish_reason "error" and no content."""
        return self.finish_reason == "error"


def _user_turn(audio_b64: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}},
                                        {"type": "text", "text": "Describe this sound in three words."}]}


def chat(base_url: str, model: str, audio_b64: str, timeout: float = 300) -> Answer:
    return complete(base_url, model, [_user_turn(audio_b64)], timeout)


def converse(base_url: str, model: str, clips: list[str], timeout: float = 300) -> list[Answer]:
    """One conversation, a turn per clip; turn k carries clips 0..k (the history is re-sent)."""
    messages: list[dict[str, Any]] = []
    answers = []
    for clip in clips:
        messages.append(_user_turn(clip))
        answer = complete(base_url, model, messages, timeout)
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer.content or "(no answer)"})
    return answers


def complete(base_url: str, model: str, messages: list[dict[str, Any]], timeout: float = 300) -> Answer:
    body = {"model": model, "max_tokens": 16, "messages": messages}
    req = urllib.request.Request(_loopback(f"{base_url}/v1/chat/completions"), data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=timeout) as resp:
        out = json.load(resp)
    choice = out["choices"][0]
    return Answer(choice.get("finish_reason"), (choice.get("message") or {}).get("content") or "")


def replica_series(metrics_text: str, stage: str = "0") -> set[str]:
    """Replica ids with a vllm:* series of this stage on the head's /metrics (the frontend cache's
    own `replica="frontend"` series excluded)."""
    out = set()
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:") or "{" not in line:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("{", 1)[1].split("}", 1)[0]))
        if labels.get("stage") == stage and labels.get("replica") not in (None, "frontend"):
            out.add(labels["replica"])
    return out


def head_replica_series(base_url: str) -> set[str]:
    with _OPENER.open(_loopback(f"{base_url}/metrics"), timeout=30) as resp:
        return replica_series(resp.read().decode())


# ----- kubectl port-forward -------------------------------------------------------------------------

class PortForward:
    """`kubectl port-forward` on 127.0.0.1 to a random local port; usable once the far end answers.

    `argv` is the whole command (port_forward_argv builds kubectl's); it must print kubectl's
    "Forwarding from 127.0.0.1:PORT" line. Entering waits for that line and then for an HTTP answer
    on `probe_path` through the forward, instead of sleeping a fixed time."""

    def __init__(self, argv: list[str], probe_path: str = "/health", timeout: float = 120):
        self.argv, self.probe_path, self.timeout = argv, probe_path, timeout
        self.proc: subprocess.Popen[str] | None = None
        self.base_url = ""
        self.output: list[str] = []

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     stdin=subprocess.DEVNULL)
        lines: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            self.base_url = f"http://127.0.0.1:{self._local_port(lines)}"
            status = wait_until_answers(self.base_url + self.probe_path, self.timeout, alive=self.alive)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        _print(f"port-forward {self.base_url} answers ({self.probe_path}: HTTP {status})")
        return self

    def _local_port(self, lines: queue.Queue[str | None]) -> int:
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                line = lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                line = ""
            if line is None:
                raise RuntimeError("the port-forward exited: " + " ".join(s.strip() for s in self.output))
            if line:
                self.output.append(line)
                m = FORWARDING.search(line)
                if m:
                    return int(m.group(1))
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no 'Forwarding from 127.0.0.1:PORT' from {self.argv[0]} in {self.timeout:.0f}s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def port_forward_argv(namespace: str, name: str, port: int) -> list[str]:
    """kubectl port-forward to the OmniStage's API Service (named like the OmniStage), local port random."""
    return [kubectl_binary(), "-n", namespace, "port-forward", "--address", "127.0.0.1", f"svc/{name}", f":{port}"]


# ----- the reproduction -----------------------------------------------------------------------------

def reproduce(stage: OmniStage, base_url: str, model: str, ready_timeout: float, log: Log = _print,
              wait: Callable[..., None] = wait_converged) -> list[str]:
    """The four checks; returns the problems found (empty: pass). Scales the OmniStage to 2, 1, 2, 1."""
    problems: list[str] = []
    stage.scale(2)
    wait(stage, 2, ready_timeout, log=log)
    audio = tone_wav(440 + time.time() % 400)
    three = [chat(base_url, model, audio) for _ in range(3)]
    log(f"same audio three times: {[a.finish_reason for a in three]}")
    if any(a.failed for a in three):
        problems.append(f"same audio three times: {[a.finish_reason for a in three]}")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        many = list(pool.map(lambda _: chat(base_url, model, audio), range(64)))
    errors = sum(a.failed for a in many)
    log(f"64 concurrent repeats: {errors} errors")
    if errors:
        problems.append(f"64 concurrent repeats: {errors} finished with finish_reason=error")
    base = 440 + time.time() % 400
    talks = [[tone_wav(base + 7 * (4 * c + t)) for t in range(4)] for c in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        turns = [a for answers in pool.map(lambda clips: converse(base_url, model, clips), talks) for a in answers]
    errors = sum(a.failed for a in turns)
    log(f"8 conversations x 4 turns (history re-sent): {errors} errors in {len(turns)} turns")
    if errors:
        problems.append(f"multi-turn conversations: {errors} of {len(turns)} turns finished with finish_reason=error")
    stage.scale(1)
    wait(stage, 1, ready_timeout, log=log)
    before = head_replica_series(base_url)
    stage.scale(2)
    wait(stage, 2, ready_timeout, log=log)
    joined = head_replica_series(base_url)
    new = joined - before
    log(f"replica series: before {sorted(before)}, after the join (no traffic yet) {sorted(joined)}")
    if not new:
        problems.append(f"no vllm:* series for the joined replica (before {sorted(before)}, after {sorted(joined)})")
    stage.scale(1)
    wait(stage, 1, ready_timeout, log=log)
    left = head_replica_series(base_url)
    log(f"replica series after the leave: {sorted(left)}")
    if new & left:
        problems.append(f"series of the departed replica {sorted(new & left)} are still on /metrics")
    return problems


def run(stage: OmniStage, open_forward: Callable[[int], contextlib.AbstractContextManager[Any]],
        model: str | None, ready_timeout: float, log: Log = _print,
        wait: Callable[..., None] = wait_converged) -> list[str]:
    """Read the OmniStage, forward its port, reproduce, and leave spec.replicas as it was found."""
    obj = stage.get()
    port, name = http_port(obj), model or served_model(obj)
    log(f"{stage.namespace}/{stage.name}: port {port}, model {name}, spec.replicas {obj['spec'].get('replicas', 1)}")
    with replicas_restored(stage, log) as original, open_forward(port) as forward:
        problems = reproduce(stage, forward.base_url, name, ready_timeout, log, wait)
        if original != 1:
            stage.scale(original)
            wait(stage, original, ready_timeout, log=log)
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", help="model name for the OpenAI API (default: from the OmniStage)")
    ap.add_argument("--ready-timeout", type=float, default=1800,
                    help="seconds to wait for each scale step to converge (a replica loads the model)")
    args = ap.parse_args(argv)
    stage = OmniStage(args.namespace, args.name)
    try:
        problems = run(stage, lambda port: PortForward(port_forward_argv(args.namespace, args.name, port)),
                       args.model, args.ready_timeout)
    except (RuntimeError, TimeoutError, OSError, ValueError, KeyError) as err:
        print(f"ERROR: {type(err).__name__}: {err}", flush=True)
        return 2
    print("PASS" if not problems else "FAIL: " + "; ".join(problems), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
