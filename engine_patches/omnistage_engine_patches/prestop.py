"""The preStop hook of an engine pod: a replica or pool pod leaves the head, drained, and a head waits
for its requests in flight, before the kubelet stops the engine.

  python3 -m omnistage_engine_patches.prestop --stage-id 0 [--stage-id K ...]
  python3 -m omnistage_engine_patches.prestop --head

A replica pod is deleted by the operator only after the head let it go; anyone else (an eviction, a
node drain, `kubectl delete pod`) would stop its engine with SIGTERM at once and cut off the
requests it runs. The kubelet runs this hook first, inside the pod's terminationGracePeriodSeconds,
even when the operator is down: it asks the head (its membership port, contract.HEAD_URL_ENV; bearer
token from contract.TOKEN_FILE_ENV: this pod's own credential, contract.pod_credential, which the
head accepts for this pod's leave and nothing else) to stop routing to this pod's replica of each
stage and to wait up to
contract.DRAIN_SECONDS_ENV for its requests in flight (one leave per stage, side by side; the
head's leave is idempotent, so the operator asking too changes nothing). Then the hook returns and
the kubelet sends SIGTERM.

A head pod that is deleted is out of its Services' endpoints already; with `--head` the hook polls
the head's own membership listing (a static head: vLLM's num_requests_running) until no replica it
routes to (its own included) has a request in flight, up to the drain timeout (a head holds the
master token; the static head's gauge is on its public port, contract.API_URL_ENV), so that the requests
it accepted are answered before SIGTERM stops vLLM (a head change hands the Service to a new head
first, then deletes the old one). A head that answers neither (not started) is not waited for.

It always exits 0: a hook that fails only loses the drain, the pod goes anyway. Standard library
only (it runs in the engine image before anything else is imported).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from . import contract

# Room for the head's answer after the drain itself (it detaches the replica, removes its series).
ANSWER_SECONDS = 10.0


def leave(base: str, token: str, pod: str, stage: int, drain_seconds: float) -> str:
    """POST one leave (contract.LeaveRequest, by pod name); what happened, in one line."""
    body: contract.LeaveRequest = {"stage": stage, "pod": pod, "drainTimeoutSeconds": drain_seconds}
    request = urllib.request.Request(base.rstrip("/") + contract.LEAVE_PATH, data=json.dumps(body).encode(),
                                     method="POST", headers={"Authorization": f"Bearer {token}",
                                                             "Content-Type": "application/json"})
    # No proxies: the head's pod IP is dialled directly.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=drain_seconds + ANSWER_SECONDS) as resp:
            ack = json.loads(resp.read() or b"{}")
        return f"stage {stage}: left (drained={ack.get('drained', True)})"
    except urllib.error.HTTPError as err:
        return f"stage {stage}: the head refused the leave (HTTP {err.code}: {err.read()[:200]!r})"
    except (urllib.error.URLError, OSError, ValueError) as err:
        return f"stage {stage}: no answer from the head ({err})"


# How often, and how many times in a row, a head's listing must show nothing in flight: the Service's
# endpoints reach every node's proxy a moment after the pod turned terminating, and a request sent
# in that moment must be counted too.
POLL_SECONDS = 0.5
IDLE_POLLS = 3


# vLLM's gauge of the requests its engines run, for a head without a membership listing (static).
RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.e+]+)$", re.MULTILINE)


def in_flight(base: str, token: str, api: str | None = None) -> int | None:
    """Requests in flight over every replica the head lists (its membership port, `base`); a static
    head's from vLLM's num_requests_running gauge (its public port, `api`; None: neither answers)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def get(path: str, auth: bool) -> bytes | None:
        request = urllib.request.Request((base if auth else api or base).rstrip("/") + path,
                                         headers={"Authorization": f"Bearer {token}"} if auth else {})
        try:
            with opener.open(request, timeout=5) as resp:
                return resp.read()
        except (urllib.error.URLError, OSError, ValueError):
            return None

    body = get(contract.MEMBERSHIP_PATH, True)
    if body is not None:
        try:
            stages = (json.loads(body or b"{}").get("stages") or {}).values()
            return sum(int(m.get("inFlight") or 0) for members in stages for m in members)
        except (ValueError, AttributeError):
            return None
    metrics = get("/metrics", False)
    if metrics is None:
        return None
    values = RUNNING.findall(metrics.decode(errors="replace"))
    return round(sum(float(v) for v in values)) if values else None


def wait_idle(base: str, token: str, drain_seconds: float, clock=time.monotonic, sleep=time.sleep,
              api: str | None = None) -> str:
    """A head's hook: wait until nothing is in flight IDLE_POLLS times in a row; what happened, in one
    line."""
    deadline, idle, most = clock() + drain_seconds, 0, 0
    while True:
        n = in_flight(base, token, api)
        if n is None:
            return "no membership listing and no num_requests_running: not waiting"
        most = max(most, n)
        idle = idle + 1 if n == 0 else 0
        if idle >= IDLE_POLLS:
            return f"idle ({most} requests were in flight when it stopped)" if most else "idle"
        if clock() >= deadline:
            return f"{n} requests still in flight after the {drain_seconds:.0f}s drain timeout"
        sleep(POLL_SECONDS)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m omnistage_engine_patches.prestop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stage-id", type=int, action="append", dest="stages", metavar="K",
                    help="a stage this pod runs a replica of; repeatable (default: 0)")
    ap.add_argument("--head", action="store_true", help="a head pod: wait for its requests in flight")
    args = ap.parse_args(argv)
    base, pod = os.environ.get(contract.HEAD_URL_ENV), os.environ.get("POD_NAME")
    token_file = os.environ.get(contract.TOKEN_FILE_ENV)
    try:
        drain = float(os.environ.get(contract.DRAIN_SECONDS_ENV) or 30)
        token = Path(token_file).read_text().strip() if token_file else os.environ.get(contract.TOKEN_ENV, "")
    except (OSError, ValueError) as err:
        print(f"prestop: cannot leave: {err}", file=sys.stderr)
        return 0
    if not (base and pod and token):
        print(
            f"prestop: cannot leave: {contract.HEAD_URL_ENV}, POD_NAME and a token are needed",
            file=sys.stderr,
        )
        return 0
    if args.head:
        print(
            f"prestop: head {pod} {wait_idle(base, token, drain, api=os.environ.get(contract.API_URL_ENV))}",
            flush=True,
        )
        return 0
    results: list[str] = []
    threads = [threading.Thread(target=lambda k=k: results.append(leave(base, token, pod, k, drain)))
               for k in args.stages or [0]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for line in results:
        print(f"prestop: {pod} {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
