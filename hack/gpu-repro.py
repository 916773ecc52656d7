#!/usr/bin/env python3
"""The serving reproduction on a real GPU cluster (DESIGN.md tier 4). Not run on this machine.

Against an OmniStage on a GPU cluster it checks, through `kubectl port-forward` (so this script
only ever dials 127.0.0.1):
  1. the same new audio sent three times gives three answers (the defect: stop, error, stop);
  2. 64 concurrent requests repeating one audio all finish without finish_reason "error";
  3. kubectl scale 1 -> 2 with stats on: the new replica's vllm:* series appear on the head's
     /metrics before it served traffic, and disappear after scaling back to 1.

    hack/gpu-repro.py --namespace serving --name qwen3-omni [--model MODEL]
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import io
import json
import math
import struct
import subprocess
import sys
import time
import urllib.request
import wave

LOCAL_PORT = 18000


def tone_wav(freq: float, seconds: float = 1.0, rate: int = 16000) -> str:
    """A fresh sine tone: new media the frontend has never seen (a different frequency each run)."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * freq * i / rate)))
                               for i in range(int(seconds * rate))))
    return base64.b64encode(buf.getvalue()).decode()


def chat(model: str, audio_b64: str, timeout: float = 300) -> str:
    body = {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}},
        {"type": "text", "text": "Describe this sound in three words."}]}]}
    req = urllib.request.Request(f"http://127.0.0.1:{LOCAL_PORT}/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        out = json.load(resp)
    return out["choices"][0]["finish_reason"]


def metrics_replicas() -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{LOCAL_PORT}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {line.split('replica="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith("vllm:num_requests_running") and 'replica="' in line}


def kubectl(*args: str) -> str:
    return subprocess.run(["kubectl", *args], check=True, capture_output=True, text=True, timeout=120).stdout


def wait_ready(ns: str, name: str, replicas: int, timeout: float = 1800) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = json.loads(kubectl("-n", ns, "get", "omnistage", name, "-o", "json")).get("status", {})
        print(f"  ready {st.get('readyReplicas')}/{replicas}, registered {st.get('registeredReplicas')}", flush=True)
        if st.get("registeredReplicas") == replicas and st.get("readyReplicas") == replicas:
            return
        time.sleep(10)
    raise TimeoutError(f"{name} did not reach {replicas} registered replicas in {timeout}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--namespace", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--model", default="Qwen/Qwen3-Omni-30B-A3B-Instruct")
    args = ap.parse_args()
    forward = subprocess.Popen(["kubectl", "-n", args.namespace, "port-forward", f"svc/{args.name}",
                                f"{LOCAL_PORT}:8000"], stdout=subprocess.DEVNULL)
    failures = 0
    try:
        time.sleep(3)
        kubectl("-n", args.namespace, "scale", "omnistage", args.name, "--replicas=2")
        wait_ready(args.namespace, args.name, 2)
        audio = tone_wav(440 + time.time() % 400)
        three = [chat(args.model, audio) for _ in range(3)]
        print(f"same audio three times: {three}")
        failures += three.count("error")
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            many = list(pool.map(lambda _: chat(args.model, audio), range(64)))
        print(f"64 concurrent repeats: {many.count('error')} errors")
        failures += many.count("error")
        kubectl("-n", args.namespace, "scale", "omnistage", args.name, "--replicas=1")
        wait_ready(args.namespace, args.name, 1)
        before = metrics_replicas()
        kubectl("-n", args.namespace, "scale", "omnistage", args.name, "--replicas=2")
        wait_ready(args.namespace, args.name, 2)
        joined = metrics_replicas()
        print(f"replica series: before {sorted(before)}, after join (no traffic yet) {sorted(joined)}")
        failures += len(joined) <= len(before)
        kubectl("-n", args.namespace, "scale", "omnistage", args.name, "--replicas=1")
        wait_ready(args.namespace, args.name, 1)
        left = metrics_replicas()
        print(f"replica series after leave: {sorted(left)}")
        failures += len(left) >= len(joined)
    finally:
        forward.terminate()
    print("PASS" if failures == 0 else f"FAIL ({failures} problems)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
