"""Hostile heads benchmark: the operator's resident set added by 1 / 3 / 10 heads serving the largest
answers they can (issue 40 item 2; goal: 10 hostile heads add < 50 MiB). Prints figures, asserts
nothing.

The heads are raw TCP listeners on 127.0.0.1 in this process, each answering the listing and the
engine report with a new ETag every time (so every pass reads them again), in one of two forms:

  flood     4 MiB less a little of `{}` objects (the review's: about 25x as Python objects), sent
            without a Content-Length (the head closes the connection at its end)
  largest   the largest listing and report this tree's bounds accept (runtime/head_answers.py:
            1024 members with the longest pod names and addresses, every patch, and keys nobody
            reads; a report of 60 KiB of patch reasons)

The operator side runs in a fresh interpreter per figure, importing the operator from the tree
given (this checkout by default, or `--before REV`: that commit's operator/ and engine_patches/,
by `git archive` into a temporary directory). It asks every head as a pass does
(`headview.ask_head` on the head's own `HeadView`, kept in `headview.HEADS` as the operator keeps
them), all heads at once on 16 threads (the reconcile workers), `--rounds` times (each head's
backoff cleared between rounds, as a changed head pod clears it), with MALLOC_ARENA_MAX as the
operator's Deployment sets it (manifests/base/deployment.yaml: glibc's arenas per thread would
otherwise keep each worker's freed answers). Figures, from /proc/self/status:

  added   VmRSS after the last round less VmRSS before the first (after a warm-up call to a
          benign head, so that imports and the connection pool are in the baseline)
  peak    VmHWM less the same baseline: the most the heads ever took

  python tests/bench/bench_hostile_heads.py [--heads 1,3,10] [--rounds 3] [--before REV]

Network rule: only 127.0.0.1 is dialled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LISTING_PATH, REPORT_PATH = "/omnistage/v1/membership", "/omnistage/v1/engine"  # contract's paths
PATCHES = ("frontend_cache", "uuid_scope", "replica_metrics", "mm_cache_metrics", "membership",
           "connector_ports", "replica_aware_cache", "replica_affinity", "registration_report",
           "engine_liveness")  # contract.PATCHES (this process imports nothing of the operator)


def flood() -> tuple[bytes, bytes]:
    body = b'{"bootId": "b", "epoch": 1, "stages": {"0": [' + b"{}," * (4 * 1024 * 1024 // 3 - 20) + b"{}]}}"
    return body, body


def largest() -> tuple[bytes, bytes]:
    members = [{"stage": 0, "replicaId": 100_000 + i, "host": f"{i:x}".rjust(45, "f"),
                "pod": f"{i}".rjust(253, "p"), "state": "attached", "coordinatorStatus": "silent",
                "silentSeconds": 12345.5 + i, "local": False, "registered": True, "attached": True,
                "held": False, "queueLength": 7, "inFlight": 9, "draining": False, "metricsRegistered": True,
                "patches": {p: ("applied", "skipped", "disabled", "upstream-fixed")[(i >> k) % 4]
                            for k, p in enumerate(PATCHES)}, "junk": f"{i}" * 20}
               for i in range(1024)]
    listing = json.dumps({"bootId": "b" * 128, "epoch": 2**52, "distributed": True, "metricsEnabled": True,
                          "stages": {"0": members}, "next": None}).encode()
    report = json.dumps({"bootId": "b" * 128, "pluginVersion": "v" * 128, "vllmVersion": "v" * 128,
                         "vllmOmniVersion": "v" * 128, "distributed": True,
                         "frontendCache": {"cacheClass": "c" * 128, "mode": "m" * 128, "requested": "r" * 128},
                         "patches": {f"{p}-{k}"[:128]: {"outcome": "skipped", "reason": "r" * 2900}
                                     for k in range(2) for p in PATCHES}}).encode()
    return listing, report


def benign() -> tuple[bytes, bytes]:
    return (json.dumps({"bootId": "b", "epoch": 1, "stages": {"0": []}}).encode(),
            json.dumps({"bootId": "b", "distributed": True, "frontendCache": {"mode": "none"},
                        "patches": {}}).encode())


class Head:
    """A head on 127.0.0.1 answering every GET with `answers` (listing, report), a new ETag each time;
    `length`: with a Content-Length (else the end of the connection ends the answer)."""

    def __init__(self, answers: tuple[bytes, bytes], length: bool = True) -> None:
        self.answers, self.length, self.served = answers, length, 0
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    got = conn.recv(65536)
                    if not got:
                        return
                    request += got
                path = request.split(b" ", 2)[1].decode()
                body = self.answers[0] if path.startswith(LISTING_PATH) else self.answers[1]
                self.served += 1
                length = b"Content-Length: %d\r\n" % len(body) if self.length else b""
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                             b'ETag: "%d"\r\n%s\r\n' % (self.served, length))
                conn.sendall(body)
            except OSError:
                return


def rss_mib(field: str) -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1)) / 1024


def operator_side(tree: str, ports: list[int], benign_port: int, rounds: int) -> None:
    """In the child: ask every head like the operator's passes, print the figures as JSON."""
    sys.path[:0] = [str(Path(tree) / "operator"), str(Path(tree) / "engine_patches")]
    from concurrent.futures import ThreadPoolExecutor

    from omnistage.runtime import headview
    from omnistage.runtime.head_client import HeadClient

    assert headview.__file__.startswith(tree), f"{headview.__file__} is not from {tree}"

    def ask(i: int, port: int) -> str:
        view = headview.view_for(("bench", f"head-{i}"), f"uid-{i}", "rv")
        view.retry_at = 0.0  # a changed head pod: dialled at once, backoff or not
        _, listing, _, listing_problem = headview.ask_head(HeadClient("127.0.0.1", port, "t"), view, True)
        return "kept" if listing is not None else f"not kept: {str(listing_problem).rpartition(': ')[2]}"

    ask(-1, benign_port)
    headview.HEADS.clear()
    base = rss_mib("VmRSS")
    outcome = ""
    with ThreadPoolExecutor(16) as pool:
        for _ in range(rounds):
            outcomes = list(pool.map(ask, range(len(ports)), ports))
            outcome = outcomes[0]
    print(json.dumps({"added": rss_mib("VmRSS") - base, "peak": rss_mib("VmHWM") - base,
                      "outcome": outcome[:160]}))


def malloc_arena_max() -> str:
    deployment = (ROOT / "manifests" / "base" / "deployment.yaml").read_text()
    return re.search(r'name: MALLOC_ARENA_MAX, value: "(\d+)"', deployment).group(1)


def measure(tree: Path, heads: list[Head], benign_head: Head, rounds: int) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(tree), "--ports", ",".join(str(h.port) for h in heads),
         "--benign", str(benign_head.port), "--rounds", str(rounds)],
        capture_output=True, text=True, timeout=1200, check=False,
        env={**os.environ, "PYTHONPATH": "", "MALLOC_ARENA_MAX": malloc_arena_max()},
    )
    if proc.returncode != 0:
        raise SystemExit(f"the operator side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="1,3,10")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forms", default="flood,largest")
    ap.add_argument("--before", help="a commit whose operator to measure too (e.g. the branch's base)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--ports", help=argparse.SUPPRESS)
    ap.add_argument("--benign", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        operator_side(args.child, [int(p) for p in args.ports.split(",")], args.benign, args.rounds)
        return 0

    trees = {"after": ROOT}
    with tempfile.TemporaryDirectory(prefix="omnistage-before-") as before_dir:
        if args.before:
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "operator", "engine_patches"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", before_dir], input=archive, check=True)
            trees = {f"before ({args.before})": Path(before_dir), **trees}
        counts = [int(n) for n in args.heads.split(",")]
        benign_head = Head(benign())
        print(f"operator-side RSS added by hostile heads, MiB ({args.rounds} rounds, 16 threads, "
              f"MALLOC_ARENA_MAX={malloc_arena_max()}): added after the rounds / peak")
        print(f"{'form':<8} {'heads':>5}  " + "  ".join(f"{label:>30}" for label in trees) + "  outcome (after)")
        for form in args.forms.split(","):
            answers = {"flood": flood, "largest": largest}[form]()
            heads = [Head(answers, length=form != "flood") for _ in range(max(counts))]
            for n in counts:
                row, outcome = [], ""
                for tree in trees.values():
                    got = measure(tree, heads[:n], benign_head, args.rounds)
                    row.append(f"{got['added']:>14.1f} / {got['peak']:>6.1f} peak")
                    outcome = str(got["outcome"])
                print(f"{form:<8} {n:>5}  " + "  ".join(f"{cell:>30}" for cell in row) + f"  {outcome[:70]}",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
