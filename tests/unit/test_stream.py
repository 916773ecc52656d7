"""The real-engine and kind tiers' one request stream (tests/support/stream.py) against a scripted chat
endpoint on loopback: what it counts as lost, and that it ends.

No wall-clock bound can be missed here: a request that must come back late is held by the endpoint for
LATE seconds (a loaded machine only makes it later), one that must hang is held until the test ends, and
the requests that must not be lost are judged against a bound of a minute.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support import stream as stream_module
from tests.support.stream import Stream, lost, requests, why

LATE = 1.0  # seconds the endpoint holds a "late" request: past the 0.2 s bound of the stream that sends it


class Endpoint:
    """A chat endpoint on 127.0.0.1 that answers each request as its body's "model" says: ok, incomplete
    (HTTP 200, no finish_reason), error (HTTP 500), late (ok after LATE s), hang (held until close())."""

    def __init__(self) -> None:
        self.release, self.seen = threading.Event(), []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                how = body["model"]
                endpoint.seen.append(how)
                if how == "hang":
                    endpoint.release.wait(60)
                    return
                if how == "late":
                    time.sleep(LATE)
                if how == "error":
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b'{"error": {"message": "Stage request failed"}}')
                    return
                finish = None if how == "incomplete" else "length"
                answer = json.dumps({"choices": [{"finish_reason": finish}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Endpoint]:
    e = Endpoint()
    yield e
    e.close()


def payloads(*hows: str) -> list[tuple[str, dict]]:
    return [(f"{how} #{i + 1}", {"model": how, "messages": []}) for i, how in enumerate(hows)]


def test_lost_is_no_complete_answer(endpoint):
    """An HTTP error and a 200 without a finished choice are lost; finished answers are not."""
    s = Stream(endpoint.base, payloads("ok", "incomplete", "error", "ok"), concurrency=2, bound=60).run()
    print("\n" + s.table())
    assert s.finished and len(s.results) == 4
    assert sorted(r.label for r in s.lost()) == ["error #3", "incomplete #2"]
    assert {r.label: why(r, s.bound) for r in s.lost()} == {"error #3": "HTTP 500",
                                                            "incomplete #2": "incomplete answer"}
    assert all(r.base == endpoint.base for r in s.results)
    assert s.summary().startswith("4 requests, 2 lost (1 HTTP 500, 1 incomplete answer)"), s.summary()


def test_an_answer_past_its_bound_is_lost(endpoint):
    """A complete answer that came later than the stream's bound is lost; against a bound it meets, not."""
    s = Stream(endpoint.base, payloads("late"), bound=0.2).run()
    print("\n" + s.table())
    assert s.finished and [why(r, s.bound) for r in s.results] == ["past its bound"], s.table()
    assert s.results[0].complete and lost(s.results, bound=60) == []


def test_a_hang_ends_and_is_lost(endpoint, monkeypatch):
    """A request that never gets an answer is cut by the client CLIENT_SLACK after the bound: the stream
    ends however the endpoint hangs, and the request is lost."""
    monkeypatch.setattr(stream_module, "CLIENT_SLACK", 0.5)
    s = Stream(endpoint.base, payloads("hang", "ok"), concurrency=2, bound=0.2).run()
    print("\n" + s.table())
    assert s.finished, "a hung request held the stream"
    assert {r.label: why(r, 60) for r in s.results} == {"hang #1": "no answer", "ok #2": ""}, s.table()


def test_stop_takes_no_new_request_and_waits_for_those_in_flight(endpoint):
    """An unbounded stream, stopped: every request it sent has its answer, and nothing is sent after."""
    forever = ((f"ok #{i}", {"model": "ok", "messages": []}) for i in range(10**9))
    with Stream(endpoint.base, forever, concurrency=2, bound=60) as s:
        while len(s.results) < 5:
            time.sleep(0.01)
    sent = len(endpoint.seen)
    assert s.finished and len(s.results) == sent and not s.lost(), s.summary()
    time.sleep(0.2)
    assert len(endpoint.seen) == sent, "a request was sent after stop()"


def test_per_replica_is_what_served_by_counted_during_the_stream(endpoint):
    counts = iter([{"0": 3, "1": 0}, {"0": 5, "1": 2, "2": 1}])
    s = Stream(endpoint.base, payloads("ok", "ok"), served_by=lambda: next(counts)).run()
    assert s.per_replica == {"0": 2, "1": 2, "2": 1}


def test_requests_take_kinds_and_seeds_in_turn():
    got = list(requests("m", kinds=("audio", "text"), seed0=70, seeds=4, max_tokens=4, limit=4, label="s"))
    assert [label for label, _ in got] == ["s #1", "s #2", "s #3", "s #4"]
    kinds = [[c["type"] for c in body["messages"][0]["content"]] for _, body in got]
    assert kinds == [["audio_url", "text"], ["text"], ["audio_url", "text"], ["text"]]
    assert got[0][1]["messages"][0]["content"][0] != got[2][1]["messages"][0]["content"][0]  # seeds 70, 72
    assert all(body["max_tokens"] == 4 and body["model"] == "m" for _, body in got)
