"""A bounded OpenAI chat client for the tiny CPU engine, and the head's per-replica request counts.

Loopback only (the network rule): every URL is checked. Media are generated, never fetched: a WAV
tone or a flat PNG whose bytes depend only on the seed, so the same seed is byte-identical media
(the frontend cache's hash hits) and a new seed is media no cache has seen.

  python -m tests.cpu_engine.client http://127.77.1.5:8000 audio 7 3    # three requests, one line each
  python -m tests.cpu_engine.client load http://127.77.1.5:8000 STOP_FILE [CONCURRENCY]   # until STOP_FILE exists
"""

from __future__ import annotations

import base64
import io
import ipaddress
import json
import math
import re
import struct
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlparse

REQUEST_TIMEOUT = 180.0  # one request; the tiny model answers in well under a second when warm
MAX_TOKENS = 8
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def _check_loopback(base: str) -> str:
    host = urlparse(base).hostname or ""
    if host != "localhost" and ipaddress.ip_address(host) not in ipaddress.ip_network("127.0.0.0/8"):
        raise ValueError(f"{base}: the client talks to 127.0.0.0/8 only")
    return base.rstrip("/")


def wav(seed: int, seconds: float = 1.0, rate: int = 16000) -> bytes:
    freq, n = 220.0 + 37.0 * seed, int(seconds * rate)
    frames = b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * freq * i / rate))) for i in range(n))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames)
    return buf.getvalue()


def png(seed: int, size: int = 56) -> bytes:
    """A flat colour image, PNG-encoded with zlib only (no PIL in the test environment)."""
    import zlib

    colour = bytes(((37 * seed) % 256, (91 * seed + 17) % 256, (53 * seed + 101) % 256))
    raw = b"".join(b"\x00" + colour * size for _ in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def body(model: str, kind: str, seed: int, max_tokens: int = MAX_TOKENS) -> dict:
    """A chat request with one generated media item (vllm-omni 0.30.0's chat endpoint passes no
    logprobs through: what an engine computed on is read by the feature probe instead)."""
    content: list[dict] = []
    if kind == "audio":
        content.append({"type": "audio_url",
                        "audio_url": {"url": "data:audio/wav;base64," + base64.b64encode(wav(seed)).decode()}})
    elif kind == "image":
        content.append({"type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + base64.b64encode(png(seed)).decode()}})
    elif kind != "text":
        raise ValueError(f"kind {kind!r}: text, image or audio")
    content.append({"type": "text", "text": "transcribe the audio briefly" if kind == "audio" else "describe the image"})
    return {"model": model, "modalities": ["text"], "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}


@dataclass
class Result:
    """One request's outcome. `complete`: HTTP 200 with a finished choice. When a request is lost (no
    complete answer, or one past its bound) is said once, in tests/support/stream.py."""

    label: str
    status: int | None          # HTTP status; None when no answer came (connection refused/reset, timeout)
    finish_reason: str | None
    seconds: float
    error: str = ""
    started: float = 0.0        # time.time() at the send
    prompt_tokens: int | None = None
    body: dict | None = field(default=None, repr=False)  # the decoded answer (the speech tier reads its audio)
    base: str = ""              # where it was sent (a stream through a Service: which head)

    @property
    def complete(self) -> bool:
        return self.status == 200 and self.finish_reason in ("length", "stop")

    def line(self) -> str:
        what = f"finish_reason={self.finish_reason}" if self.status == 200 else (self.error[:120] or "no answer")
        return f"{self.label:<22} HTTP {self.status} {what:<40} {self.seconds:6.2f}s"


def get(url: str, token: str | None = None, timeout: float = 10.0) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with _OPENER.open(req, timeout=timeout) as r:
        return r.read().decode()


def post(base: str, path: str, timeout: float = 120.0, payload: dict | None = None) -> int:
    """POST with no body (vLLM's dev routes: /sleep, /wake_up), or `payload` as JSON; the HTTP status."""
    data = json.dumps(payload).encode() if payload is not None else b""
    req = urllib.request.Request(_check_loopback(base) + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json"} if payload is not None else {})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def healthy(base: str) -> bool:
    try:
        get(_check_loopback(base) + "/health", timeout=5)
        return True
    except (OSError, urllib.error.URLError):
        return False


def served_model(base: str) -> str:
    return json.loads(get(_check_loopback(base) + "/v1/models", timeout=30))["data"][0]["id"]


def chat(base: str, payload: dict, label: str, timeout: float = REQUEST_TIMEOUT) -> Result:
    base = _check_loopback(base)
    t0, started = time.monotonic(), time.time()
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            out = json.load(r)
            choice = out["choices"][0]
            return Result(label, r.status, choice.get("finish_reason"), time.monotonic() - t0, started=started,
                          prompt_tokens=(out.get("usage") or {}).get("prompt_tokens"), body=out, base=base)
    except urllib.error.HTTPError as err:
        text = err.read().decode(errors="replace")
        try:
            text = json.loads(text).get("error", {}).get("message", text)
        except (ValueError, AttributeError):
            pass
        return Result(label, err.code, None, time.monotonic() - t0, text, started, base=base)
    except (urllib.error.URLError, OSError, TimeoutError) as err:  # refused, reset, timed out: no answer
        return Result(label, None, None, time.monotonic() - t0, f"{type(err).__name__}: {err}", started, base=base)


def run_many(base: str | Callable[[], str], payloads: Iterable[tuple[str, dict]], concurrency: int,
             deadline: float | None = None, on_result=None, timeout: float = REQUEST_TIMEOUT) -> list[Result]:
    """Send the payloads with `concurrency` workers, each taking the next one when its last answer
    came (so a lazy, unbounded iterable is fine); stop taking at `deadline` (time.monotonic()).
    `base` may be a function: asked again for every request (a Service's endpoints, as a proxy
    picks one per new connection)."""
    lock, results, items = threading.Lock(), [], iter(payloads)

    def worker() -> None:
        while deadline is None or time.monotonic() < deadline:
            with lock:
                item = next(items, None)
            if item is None:
                return
            r = chat(base() if callable(base) else base, item[1], item[0], timeout=timeout)
            with lock:
                results.append(r)
            if on_result:
                on_result(r)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


SUCCESS = re.compile(r'^vllm:request_success_total\{(?P<labels>[^}]*)\}\s+(?P<value>[0-9.e+]+)$', re.MULTILINE)


def served_by(metrics_text: str, stage: str = "0") -> dict[str, int]:
    """Finished requests per stage-0 replica id, from the head's /metrics (vllm-omni labels every
    vllm:* series with stage and replica; the engine plugin keeps them true to membership)."""
    out: dict[str, int] = {}
    for m in SUCCESS.finditer(metrics_text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        if labels.get("stage", stage) == stage and "replica" in labels:
            out[labels["replica"]] = out.get(labels["replica"], 0) + int(float(m.group("value")))
    return out


def table(results: list[Result]) -> str:
    return "\n".join(r.line() for r in results)


def load(base: str, stop_file: str, concurrency: int = 2, clips: int = 4, max_seconds: float = 3600,
         pace: float = 0.5) -> int:
    """Repeated audio (`clips` clips in turn) at `concurrency` until `stop_file` exists (bounded by
    max_seconds): one line per request as it is answered, the head's per-replica counts every 10 s,
    a summary at the end. Exit 1 when any request got no complete answer (`make demo` fails then).
    Each worker waits `pace` seconds between requests: a saturated head on a 2-core machine would
    starve the replica that is starting beside it."""
    import itertools
    import os

    base = _check_loopback(base)
    model = served_model(base)
    payloads = ((f"audio clip {i % clips}", body(model, "audio", 100 + i % clips)) for i in itertools.count())
    t0, results, lock = time.monotonic(), [], threading.Lock()
    last_report = [t0]

    def printed(r: Result) -> None:
        with lock:
            results.append(r)
            print(f"[requests +{time.monotonic() - t0:5.0f}s] #{len(results):<4} {r.line()}", flush=True)
            if time.monotonic() - last_report[0] > 10:
                last_report[0] = time.monotonic()
                try:
                    print(f"[requests] finished per stage-0 replica (head /metrics): {served_by(get(base + '/metrics'))}",
                          flush=True)
                except OSError:
                    pass

    def until_stopped():
        for item in payloads:
            if os.path.exists(stop_file) or time.monotonic() - t0 > max_seconds:
                return
            yield item
            time.sleep(pace / concurrency)  # under run_many's lock: spaces the requests of all workers

    run_many(base, until_stopped(), concurrency, on_result=printed)
    bad = [r for r in results if not r.complete]
    print(f"[requests] {len(results)} requests with repeated audio, {len(bad)} without a complete answer; "
          f"per replica {served_by(get(base + '/metrics'))}", flush=True)
    return 1 if bad or not results else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["load"]:
        return load(argv[1], argv[2], *(int(a) for a in argv[3:4]))
    base, kind, seed = argv[0], argv[1], int(argv[2])
    count = int(argv[3]) if len(argv) > 3 else 3
    payload = body(served_model(base), kind, seed)
    for i in range(count):
        print(chat(base, payload, f"{kind} seed={seed} #{i + 1}").line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
