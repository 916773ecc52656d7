"""One request stream for the tiers that send requests to real engines (tests/cluster/real, tests/cluster/kind),
and the one definition of a lost request (issue 41 item 6).

A request is LOST when it got no complete answer, or when its answer came later than the stream's bound:
  - no complete answer: no HTTP answer at all (refused, reset, the client's timeout), an HTTP error, a 200
    whose choice did not finish; or, for a stream that asks for more, what its `complete` asks (the speech
    tier's: a 24 kHz WAV in the answer);
  - past its bound: more than `bound` seconds from the send to the answer. A hang is a loss however it ends:
    the client's own timeout is `bound` + 30 s, so a request that hangs comes back late with no answer.

    from tests.support.stream import Stream, requests

    with Stream(stage.base, requests(model, kinds=("audio", "text")), concurrency=2, bound=120) as s:
        ...                                   # disrupt; s.results fills as the answers come
    assert s.finished and s.results, s.summary()   # every worker returned: nothing still hangs
    assert not s.lost(), s.table(s.lost())

  Stream(base, payloads, ...)   base: a URL, or a function asked again for every request (a Service's
                                endpoints, as a proxy picks one per connection); payloads: (label, body)
                                pairs, any iterable (lazy and unbounded is fine: `seconds` bounds it)
  .start() / .stop()            what `with` does: stop() takes no new request and waits for those in
                                flight (each ends by its client timeout)
  .wait() / .run()              wait until the payloads ran out and every answer came / start, then wait
  .results                      every answer so far (client.Result: label, status, finish_reason,
                                seconds, started (wall time of the send), error, body, base: where it went)
  .lost() .summary() .table()   the lost ones; "N requests, M lost (by why)"; one line per request
  lost(results, bound), why(r, bound)   the same definition for answers got another way

Which replica served a request is not in its answer (vllm-omni says nothing of it): sequential requests are
attributed by the head's per-replica counters (realstage.send_attributed), a stream's by their sums
(`served_by`: a function returning the head's finished requests per replica, read at start and stop, the
difference in .per_replica); which head a request went to is its result's `base`.

Imports the CPU engine's client only (tests/cpu_engine/client.py, standard library): any tier may import it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Self

from tests.cpu_engine import client
from tests.cpu_engine.client import Result

BOUND = client.REQUEST_TIMEOUT  # seconds from a send to its answer, unless a stream says otherwise
CLIENT_SLACK = 30.0             # the client gives up this long after the bound: a hang ends, counted lost
Complete = Callable[[Result], bool]


def finished(r: Result) -> bool:
    """A complete answer: HTTP 200 with a finished choice (client.Result.complete)."""
    return r.complete


def why(r: Result, bound: float = BOUND, complete: Complete = finished) -> str:
    """Why a request is lost ('' when it is not): the first of no answer, an HTTP error, an incomplete
    answer, past its bound."""
    if r.status is None:
        return "no answer"
    if r.status != 200:
        return f"HTTP {r.status}"
    if not complete(r):
        return "incomplete answer"
    if r.seconds > bound:
        return "past its bound"
    return ""


def lost(results: Iterable[Result], bound: float = BOUND, complete: Complete = finished) -> list[Result]:
    """The lost requests: no complete answer, or an answer more than `bound` seconds after the send."""
    return [r for r in results if why(r, bound, complete)]


def requests(model: str, kinds: Sequence[str] = ("audio",), seed0: int = 60, seeds: int = 4, max_tokens: int = 16,
             limit: int | None = None, label: str = "stream") -> Iterator[tuple[str, dict]]:
    """A stream's payloads: chat requests with `kinds` in turn (("audio", "text") alternates; client.body),
    media seeds seed0 .. seed0+seeds-1 in turn (repeated media: the frontend cache hits), at most `limit`
    (None: as many as the stream takes)."""
    for i in itertools.count() if limit is None else range(limit):
        kind = kinds[i % len(kinds)]
        yield f"{label} #{i + 1}", client.body(model, kind, seed0 + i % seeds, max_tokens=max_tokens)


class Stream:
    """Requests at `concurrency` through `base` in the background, each worker taking the next payload
    when its last answer came; bounded by the payloads, by `seconds` (no new request after them) and by
    stop(). `pace`: seconds between two sends, over all workers (with one worker: between an answer and
    the next request). `complete`: what a complete answer is (default: finished); `on_result(r)`: called
    as each answer comes (printing it, say)."""

    def __init__(self, base: str | Callable[[], str], payloads: Iterable[tuple[str, dict]], concurrency: int = 2,
                 bound: float = BOUND, seconds: float = 600.0, pace: float = 0.0, complete: Complete = finished,
                 on_result: Callable[[Result], None] | None = None,
                 served_by: Callable[[], dict[str, int]] | None = None) -> None:
        self.base, self.payloads, self.concurrency = base, payloads, concurrency
        self.bound, self.seconds, self.pace, self.complete = bound, seconds, pace, complete
        self.on_result, self.served_by = on_result, served_by
        self.results: list[Result] = []  # appended as the answers come (list.append: one step, any thread)
        self.per_replica: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._before: dict[str, int] = {}

    def _taken(self) -> Iterator[tuple[str, dict]]:
        for i, item in enumerate(self.payloads):
            if self._stop.is_set() or (i and self.pace and self._stop.wait(self.pace)):
                return
            yield item

    def _kept(self, r: Result) -> None:
        self.results.append(r)
        if self.on_result is not None:
            self.on_result(r)

    def start(self) -> Self:
        self._before = self.served_by() if self.served_by else {}
        deadline = time.monotonic() + self.seconds
        self._thread = threading.Thread(
            target=client.run_many, args=(self.base, self._taken(), self.concurrency), name="stream", daemon=True,
            kwargs={"deadline": deadline, "on_result": self._kept, "timeout": self.bound + CLIENT_SLACK})
        self._thread.start()
        return self

    def _join(self, timeout: float) -> Self:
        assert self._thread is not None, "the stream was never started"
        self._thread.join(timeout)
        if self.served_by and self.finished:
            after = self.served_by()
            self.per_replica = {r: n - self._before.get(r, 0) for r, n in after.items()}
        return self

    def stop(self) -> Self:
        """No new request; wait for those in flight (each ends by its client timeout, bound + 30 s)."""
        self._stop.set()
        return self._join(self.bound + CLIENT_SLACK + 30)

    def wait(self) -> Self:
        """Wait until the payloads ran out (or `seconds` passed) and every answer came."""
        return self._join(self.seconds + self.bound + CLIENT_SLACK + 30)

    def run(self) -> Self:
        """start(), then wait(): a fixed batch."""
        return self.start().wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def finished(self) -> bool:
        """Every worker returned: no request still hangs."""
        return self._thread is not None and not self._thread.is_alive()

    def lost(self) -> list[Result]:
        return lost(list(self.results), self.bound, self.complete)

    def summary(self) -> str:
        gone = self.lost()
        kinds: dict[str, int] = {}
        for r in gone:
            reason = why(r, self.bound, self.complete)
            kinds[reason] = kinds.get(reason, 0) + 1
        by = f" ({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})" if kinds else ""
        slowest = max((r.seconds for r in self.results), default=0.0)
        return (f"{len(self.results)} requests, {len(gone)} lost{by}; slowest answer {slowest:.1f}s "
                f"(bound {self.bound:.0f}s)" + ("" if self.finished else "; STILL RUNNING"))

    def table(self, results: Iterable[Result] | None = None) -> str:
        return "\n".join(f"{r.line()}  {why(r, self.bound, self.complete) or 'ok'}"
                         for r in (self.results if results is None else results))
