"""Membership listing benchmark: GET time and orchestrator-loop stall at 1k / 4k / 16k routes.

The head's OmniMasterServer keeps a route for every replica that ever registered (replica ids are
never reused), so routes grow with churn while the live membership stays small; the operator
GETs the listing on every reconcile (at least every 5 s). The listing runs on the orchestrator's
event loop, where inference output processing runs too: whatever it costs stalls serving.

Real: ``membership_ops.LiveHead`` (the code the endpoint runs: ``snapshot`` handed from a
caller's event loop to the "orchestrator" loop on its own thread with
``asyncio.run_coroutine_threadsafe``, exactly as the HTTP handler does), ``patches.membership``'
``MembershipState`` (departures recorded through its own methods), vllm-omni's
``StagePool._client_input_addr``, and a ticker task on the orchestrator loop that records the
largest gap between its 1 ms ticks while a GET runs: that gap is the stall serving would see.
Faked (no engine, no network): the OmniMasterServer, the stage pool, the coordinator hub and the
orchestrator are plain objects carrying only the attributes the listing reads, shaped like the
review's ``probes/probe_listing.py``. The scenario is churn: every route but the head-local
replica and ``--live`` remote ones departed (half left through the operator, half dropped by
the head), with ``--in-flight`` requests spread over the live replicas.

  python tests/bench/bench_listing.py [--sizes 1000,4000,16000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runnable as a script: `python tests/bench/bench_listing.py`

TARGET_MS = 5.0


def fake_head(head_cls: type, n_routes: int, *, live: int, in_flight: int, loop: asyncio.AbstractEventLoop,
              state_of: Any) -> Any:
    """A head with ``n_routes`` routes on stage 0: replica 0 head-local, the last ``live`` ones
    attached, every other one registered and departed."""
    routes = {(0, r): SimpleNamespace(replica_host=f"10.0.{r // 250}.{r % 250}",
                                      input_bind_address=f"tcp://127.9.0.1:{20000 + r}")
              for r in range(n_routes)}
    master = SimpleNamespace(_stage_routes=routes, _stage_configs=dict.fromkeys(routes),
                             _head_local_slots={(0, 0)}, _alloc_lock=threading.Lock())
    live_ids = [0, *range(n_routes - live, n_routes)]
    clients: list[Any] = [None] * n_routes
    for rid in live_ids:
        clients[rid] = SimpleNamespace(client_addresses={"input_address": routes[(0, rid)].input_bind_address})
    affinity = {f"req-{i}": routes[(0, live_ids[i % len(live_ids)])].input_bind_address for i in range(in_flight)}
    pool = SimpleNamespace(clients=clients, _affinity=affinity, _request_bindings={})
    hub_list = SimpleNamespace(replicas=[SimpleNamespace(input_addr=routes[(0, rid)].input_bind_address,
                                                         queue_length=0) for rid in live_ids])
    hub = SimpleNamespace(get_replica_list=lambda: hub_list)
    orch = SimpleNamespace(stage_pools=[pool], _membership=SimpleNamespace(_hub=hub), _stat_logger=None,
                           _stage_replica_to_engine_idx={})
    state = state_of(orch)
    live_set = set(live_ids)
    for rid in range(n_routes):
        if rid in live_set:
            continue
        if rid % 2:
            state.remember_left((0, rid), {"stage": 0, "replicaId": rid, "state": "left"})
        else:
            state.remember_detached((0, rid))
    return head_cls(orch=orch, loop=loop, master=master)


class OrchestratorLoop:
    """An event loop on its own thread with a 1 ms ticker recording when it got to run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ticks: list[float] = []
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="orchestrator-loop", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._ticker())

    async def _ticker(self) -> None:
        while not self._stop:
            self.ticks.append(time.perf_counter())
            if len(self.ticks) > 200_000:
                del self.ticks[:100_000]
            await asyncio.sleep(0.001)

    def __enter__(self) -> Self:
        self.thread.start()
        while not self.ticks:
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self.thread.join(5)
        self.loop.close()

    def wait_tick_after(self, moment: float, timeout: float = 5.0) -> None:
        deadline = time.perf_counter() + timeout
        while self.ticks[-1] <= moment and time.perf_counter() < deadline:
            time.sleep(0.0005)

    def idle_stall(self, windows: int = 20, seconds: float = 0.002) -> float:
        """The same measurement with no GET running: the ticker's own period plus scheduling."""
        worst = 0.0
        for _ in range(windows):
            start = time.perf_counter()
            time.sleep(seconds)
            end = time.perf_counter()
            self.wait_tick_after(end)
            worst = max(worst, self.stall_during(start, end))
        return worst

    def stall_during(self, start: float, end: float) -> float:
        """The largest gap between two ticks that overlaps [start, end], in seconds."""
        ticks = [t for t in list(self.ticks) if t >= start - 0.1]
        worst = 0.0
        for a, b in itertools.pairwise(ticks):
            if b >= start and a <= end:
                worst = max(worst, b - a)
        return worst


def measure(head: Any, orch_loop: OrchestratorLoop, caller: asyncio.AbstractEventLoop, repeat: int,
            **snapshot_kwargs: Any) -> dict[str, Any]:
    caller.run_until_complete(head.snapshot(**snapshot_kwargs))  # warm-up: lazy imports, caches
    times, stalls, listed = [], [], 0
    for _ in range(repeat):
        time.sleep(0.005)  # let the ticker run between GETs
        start = time.perf_counter()
        body = caller.run_until_complete(head.snapshot(**snapshot_kwargs))
        end = time.perf_counter()
        orch_loop.wait_tick_after(end)  # the tick after the GET closes its gap
        times.append(end - start)
        stalls.append(orch_loop.stall_during(start, end))
        listed = sum(len(v) for v in body["stages"].values())
    return {"min": min(times), "median": statistics.median(times), "max": max(times),
            "stall_median": statistics.median(stalls), "stall": max(stalls), "listed": listed}


def run(head_cls: type, state_of: Any, sizes: list[int], repeat: int, live: int, in_flight: int,
        pages: bool = True) -> list[dict[str, Any]]:
    rows = []
    caller = asyncio.new_event_loop()  # the HTTP server's loop, in the real head
    with OrchestratorLoop() as orch_loop:
        print("measuring the ticker's idle gap (no GET running) ...", flush=True)
        rows.append({"idle_stall": orch_loop.idle_stall()})
        for n in sizes:
            print(f"routes={n}: building the fake head ...", flush=True)
            head = fake_head(head_cls, n, live=live, in_flight=in_flight, loop=orch_loop.loop, state_of=state_of)
            print(f"routes={n}: default listing x{repeat} ...", flush=True)
            row = {"routes": n, "default": measure(head, orch_loop, caller, repeat)}
            if pages:
                print(f"routes={n}: ?all=true first page x{repeat} ...", flush=True)
                row["page"] = measure(head, orch_loop, caller, repeat, include_all=True)
            rows.append(row)
    caller.close()
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    """GET min/median/max, and the loop stall (largest ticker gap during a GET) median/max: on a
    shared machine the max columns include time the OS gave to other processes."""
    print()
    print(title)
    baseline = next((row["idle_stall"] for row in rows if "idle_stall" in row), None)
    rows = [row for row in rows if "routes" in row]
    cols = ["routes", "listed", "GET min/median/max ms", "stall median/max ms", "page", "page GET median ms",
            "page stall median/max ms"]
    table = []
    for row in rows:
        d, p = row["default"], row.get("page")
        table.append([str(row["routes"]), str(d["listed"]), f"{_ms(d['min'])} / {_ms(d['median'])} / {_ms(d['max'])}",
                      f"{_ms(d['stall_median'])} / {_ms(d['stall'])}",
                      str(p["listed"]) if p else "-", _ms(p["median"]) if p else "-",
                      f"{_ms(p['stall_median'])} / {_ms(p['stall'])}" if p else "-"])
    widths = [max(len(c), *(len(r[i]) for r in table)) for i, c in enumerate(cols)]
    print(" | ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in table:
        print(" | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)))
    if baseline is not None:
        print(f"(stall baseline with no GET running: {_ms(baseline)} ms, the ticker's 1 ms period plus scheduling)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,4000,16000", help="comma-separated route counts")
    ap.add_argument("--repeat", type=int, default=20, help="GETs per size (default 20)")
    ap.add_argument("--live", type=int, default=8, help="attached remote replicas (default 8)")
    ap.add_argument("--in-flight", type=int, default=512, help="requests in flight (default 512)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.repeat < 1 or any(n < args.live + 2 or n > 200_000 for n in sizes):
        ap.error("--repeat >= 1 and every size in [live + 2, 200000]")

    print("importing the plugin (vllm-omni's StagePool is imported with it) ...", flush=True)
    from omnistage_engine_patches.membership_ops import LiveHead
    from omnistage_engine_patches.patches.membership import state_of

    load_before = os.getloadavg()[0]
    rows = run(LiveHead, state_of, sizes, args.repeat, args.live, args.in_flight)
    print_table(rows, f"membership listing (membership_ops.LiveHead), {args.live} live remote replicas + the "
                      f"head-local one, {args.in_flight} requests in flight, the other routes departed; "
                      f"{args.repeat} GETs per size")
    largest = max((row for row in rows if "routes" in row), key=lambda row: row["routes"])
    print(f"\ntarget: default GET < {TARGET_MS:.0f} ms at 16k routes; at {largest['routes']} routes the median "
          f"GET took {_ms(largest['default']['median'])} ms (min {_ms(largest['default']['min'])} ms)")
    print(f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after, on {os.cpu_count()} "
          "CPUs: a loaded machine inflates the max columns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
