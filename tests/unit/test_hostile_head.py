"""A hostile head on loopback (issue 40 items 1 and 2): it cannot hold a call past its deadline by
dripping, in any part of its answer, nor make the operator read more than a bounded answer.

Each "head" is a raw TCP listener on 127.0.0.1 running a script of what it sends.

Before this change: a byte every 2 s into the status line, a header or a chunk-size line held the
call for as long as the head dripped (the per-read timeout, 3 s, never expired), and 6 MiB of
headers were read before the body's bound applied.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from omnistage.runtime import head_client
from omnistage.runtime.head_client import HeadClient, HeadUnreachable

DRIP_SECONDS = 2.0
# The call's deadline is CONNECT_SECONDS + READ_SECONDS = 4 s: the dripper has sent 3 bytes by then
# (at 0, 2 and 4 s). 8 bytes is 16 s: room for a loaded 2-core machine, far under what the code
# before took (it read until the head stopped).
MOST_DRIPPED = 8
GIVE_UP_SECONDS = 40.0  # the call is still running: it would read for as long as the head drips

OK_STATUS = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"


class ScriptedHead:
    """A TCP listener on 127.0.0.1 that reads a request and runs `script(conn, head)` on it."""

    def __init__(self, script: Callable[[socket.socket, ScriptedHead], None]) -> None:
        self.script, self.sent, self.stop = script, 0, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.client = HeadClient("127.0.0.1", self.sock.getsockname()[1], "token")
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                self.script(conn, self)
            except OSError:
                return

    def drip(self, conn: socket.socket, data: bytes) -> None:
        """`data` a byte every DRIP_SECONDS, counted in self.sent, until the head is closed."""
        for i in range(len(data)):
            if self.stop.is_set():
                return
            conn.sendall(data[i:i + 1])
            self.sent += 1
            self.stop.wait(DRIP_SECONDS)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def hostile() -> Iterator[Callable[..., ScriptedHead]]:
    made: list[ScriptedHead] = []

    def make(script: Callable[[socket.socket, ScriptedHead], None]) -> ScriptedHead:
        made.append(ScriptedHead(script))
        return made[-1]
    yield make
    for h in made:
        h.close()


Script = Callable[[socket.socket, ScriptedHead], None]


def answer(body: bytes, *headers: bytes, length: bool = True) -> Script:
    """A script that sends `body` at once, with `headers` and a Content-Length (`length` False: the
    end of the connection ends it)."""
    def script(conn: socket.socket, _: ScriptedHead) -> None:
        conn.sendall(OK_STATUS + b"".join(h + b"\r\n" for h in headers)
                     + (b"Content-Length: %d\r\n" % len(body) if length else b"") + b"\r\n" + body)
    return script


# ---- item 1: one deadline for the whole exchange ----------------------------------------------------

ENDLESS = 1 << 20
DRIPS = {
    "status line": (b"", b"HTTP/1.1 200 " + b"K" * ENDLESS),
    "header": (OK_STATUS, b"X-Drip: " + b"a" * ENDLESS),
    "chunk-size line": (OK_STATUS + b"Transfer-Encoding: chunked\r\n\r\n", b"1;" + b"x" * ENDLESS),
    "body": (OK_STATUS + b"Content-Length: 1000\r\n\r\n", b" " * 1000),
}


def test_a_dripping_head_is_cut_at_the_call_s_deadline_whatever_it_drips(hostile):
    """The four forms side by side (each call waits on its own head: 4 s in all, not 16)."""
    heads, ended = {}, {form: {} for form in DRIPS}

    def script(form: str) -> Callable[[socket.socket, ScriptedHead], None]:
        def run(conn: socket.socket, head: ScriptedHead) -> None:
            conn.sendall(DRIPS[form][0])
            head.drip(conn, DRIPS[form][1])
        return run

    def call(form: str) -> None:
        try:
            head_client.listing_if_changed(heads[form].client, None, attempts=1)
        except HeadUnreachable as err:
            ended[form]["error"] = err
        ended[form]["sent"] = heads[form].sent
    for form in DRIPS:
        heads[form] = hostile(script(form))
    callers = [threading.Thread(target=call, args=(form,), daemon=True) for form in DRIPS]
    t0 = time.monotonic()
    for c in callers:
        c.start()
    for c in callers:
        c.join(max(0.0, GIVE_UP_SECONDS - (time.monotonic() - t0)))
    took = time.monotonic() - t0
    for form, end in ended.items():
        print(f"\n[drip] {form}: {end.get('sent', heads[form].sent)} bytes dripped when the call ended "
              f"({'ended' if 'sent' in end else 'still reading'} after {took:.1f}s for all four)")
    for form, end in ended.items():
        assert "sent" in end, f"the call still reads after {took:.0f}s ({heads[form].sent} bytes dripped " \
                              f"into the {form})"
        assert end["sent"] <= MOST_DRIPPED, f"the call read {end['sent']} bytes dripped into the {form}"
        assert "not complete within" in str(end.get("error")), (form, end)
        assert getattr(end["error"], "answer", None) == "membership listing"  # a HeadAnswerRefused


def test_a_head_that_sends_nothing_is_still_a_read_timeout_not_a_refusal(hostile):
    """The deadline only cuts what a head sends too slowly; silence stays 'no answer' (retried)."""
    head = hostile(lambda conn, head: head.stop.wait(10))
    with pytest.raises(HeadUnreachable) as err:
        head_client.report_if_changed(head.client, None, attempts=1)
    assert not hasattr(err.value, "why") and "ReadTimeoutError" in str(err.value)


# ---- item 2: what an answer may cost before it is parsed --------------------------------------

def test_headers_count_against_the_answer_s_bytes(hostile):
    """http.client reads up to 100 header lines of 64 KiB each: 6 MiB before the body."""
    headers = [b"X-Pad-%d: %s" % (i, b"a" * 60_000) for i in range(90)]
    head = hostile(answer(b"{}", *headers))
    with pytest.raises(HeadUnreachable) as err:
        head_client.report_if_changed(head.client, None, attempts=1)
    assert err.value.why == "over its size with its headers"


def test_a_compressed_answer_is_never_inflated(hostile):
    head = hostile(answer(gzip.compress(b" " * 50_000_000 + b"{}"), b"Content-Encoding: gzip"))
    with pytest.raises(HeadUnreachable) as err:
        head_client.report_if_changed(head.client, None, attempts=1)
    assert err.value.why == "a compressed answer"
