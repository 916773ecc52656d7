"""Benchmark on real engines (printed, nothing asserted): the price of the processor-only cache, and
the time from `kubectl scale` to the first request a new replica serves. `make bench-real`.

  A. processor-only on 2 replicas (dynamic membership: what the operator renders when replicas can
     join), against
  B. vLLM's LRU sender cache on 1 static replica (the only shape where that cache is safe),
each with repeated audio (8 clips over and over: the frontend cache hits) and all-new audio (every
clip unseen), at concurrency 4, in alternating rounds: requests/s and p50/p95 latency side by side in
one table. Then A is
scaled to 3 and the new replica's path is split into pod created, process started, registered,
attached, joined, first request served.

Same machine, same tiny model with random weights on the CPU, same run: ratios, not absolute
figures, carry over (a GPU's engine time is far smaller, so the cache's share is larger there; the
engine tier's bench_cache.py measures the frontend alone).
Not in `make test` (a file not named test_*): it starts three engines more than the tier.
"""

from __future__ import annotations

import statistics
import time

import pytest

from tests.cluster.real.realstage import HEAD_READY_TIMEOUT, RealOmniStage, tiny_omnistage, watch_join
from tests.cpu_engine import client
from tests.support.stream import Stream

REQUESTS = 48
ROUNDS = 3
CONCURRENCY = 4
pytestmark = pytest.mark.timeout(3 * HEAD_READY_TIMEOUT)


def _run(stage: RealOmniStage, new_media: bool, seed0: int, n: int) -> list[float]:
    model = client.served_model(stage.base())
    payloads = [(f"#{i}", client.body(model, "audio", seed0 + (i if new_media else i % 8))) for i in range(n)]
    t0 = time.monotonic()
    load = Stream(stage.base(), payloads, CONCURRENCY).run()
    results, errors = load.results, len(load.lost())
    return [time.monotonic() - t0, errors, *(r.seconds for r in results)]


def test_cache_price_and_scale_to_first_request(kubectl, operator, standin, real_namespace, wait_for):
    # Both shapes up at once and measured in alternating rounds (A, B, A, B...): a machine shared with
    # other work slows both alike, so the ratio holds where absolute figures drift.
    static = RealOmniStage(kubectl, standin, real_namespace, "lru-static", wait_for)
    manifest = tiny_omnistage("lru-static", replicas=1)
    manifest["spec"]["membership"] = "static"
    static.apply(manifest)
    dynamic = RealOmniStage(kubectl, standin, real_namespace, "po-dynamic", wait_for)
    dynamic.apply(tiny_omnistage("po-dynamic", replicas=2))
    for s, n in ((static, 1), (dynamic, 2)):
        s.wait_serving(n, f"{s.name} serving with {n} replica(s)", timeout=HEAD_READY_TIMEOUT)
    mode = {s.name: s.get()["status"].get("effectiveCacheMode") for s in (static, dynamic)}
    rows: dict[tuple[str, str], dict[str, list[float]]] = {}
    for new_media, seed0 in ((False, 200), (True, 1000)):
        media = "all-new" if new_media else "repeated"
        for r in range(ROUNDS):
            for s in (static, dynamic):
                print(f"[bench] round {r + 1}/{ROUNDS} {s.name} ({mode[s.name]}): {REQUESTS // ROUNDS} requests, "
                      f"{media} audio", flush=True)
                wall, errors, *lat = _run(s, new_media, seed0 + r * 100, REQUESTS // ROUNDS)
                row = rows.setdefault((s.name, media), {"wall": [], "errors": [], "lat": []})
                row["wall"].append(wall)
                row["errors"].append(errors)
                row["lat"].extend(lat)

    def figures(row: dict[str, list[float]]) -> dict[str, float]:
        lat = sorted(row["lat"])
        return {"req/s": len(lat) / sum(row["wall"]), "p50": statistics.median(lat),
                "p95": lat[int(0.95 * len(lat)) - 1], "errors": sum(row["errors"])}
    print(f"\n[bench] real engines, tiny model on the CPU, {REQUESTS} requests per cell in {ROUNDS} alternating "
          f"rounds, concurrency {CONCURRENCY}: processor-only on 2 replicas vs LRU on 1 static replica")
    print(f"  {'OmniStage (cache mode)':<34} {'audio':<9} {'req/s':>6} {'p50 s':>6} {'p95 s':>6} {'errors':>6}")
    for (who, media), row in rows.items():
        f = figures(row)
        print(f"  {who + ' (' + mode[who] + ')':<34} {media:<9} {f['req/s']:6.2f} {f['p50']:6.2f} {f['p95']:6.2f} "
              f"{f['errors']:6.0f}")
    for media in ("repeated", "all-new"):
        a, b = figures(rows[("po-dynamic", media)]), figures(rows[("lru-static", media)])
        print(f"  ratio {media} (2 processor-only / 1 LRU): req/s {a['req/s'] / b['req/s']:.2f}x, "
              f"p50 {a['p50'] / b['p50']:.2f}x")

    t0 = dynamic.scale(3)
    phases = watch_join(dynamic, "po-dynamic-replica-2", t0)
    model = client.served_model(dynamic.base())
    deadline = time.monotonic() + 180  # round-robin reaches the new replica within a few requests
    while time.monotonic() < deadline:
        before = dynamic.served_by()
        client.chat(dynamic.base(), client.body(model, "audio", 7), "probe")
        after = dynamic.served_by()
        if any(after[r] > before.get(r, 0) for r in after if r not in ("0", "1")):
            phases["first request served"] = time.monotonic() - t0
            break
    print("\n[bench] kubectl scale 2 -> 3 until the new replica serves (seconds from kubectl scale)")
    prev = 0.0
    for phase, at in phases.items():
        print(f"  {phase:<28} +{at:7.1f}s  (step {at - prev:6.1f}s)")
        prev = at
