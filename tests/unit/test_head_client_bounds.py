"""What a head answers is untrusted (issue 27 item 3): a hostile "head" on loopback cannot make the
operator hold a huge body in memory, nor hold a worker with a body dripped a byte at a time.

On the code before this change: the 150 MB body added 454 MiB of RSS (the operator's limit is
512 Mi), and the drip held the call for more than 40 s (the timeout applied to each read).

Measured in bytes and reads, never in seconds: the unit tier runs beside the CPU-heavy cluster tier
on a 2-core machine, where any time bound can be missed.
"""

from __future__ import annotations

import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from omnistage.runtime import head_client
from omnistage.runtime.head_client import HeadClient, HeadUnreachable

DRIPPED_BYTES = 1000  # the drip's length: the code before read all of it, a read each


class HostileHead:
    """A raw TCP server on 127.0.0.1 answering every request the way `mode` says, or running
    `mode(conn, head)` when it is a script (test_hostile_head.ScriptedHead)."""

    def __init__(self, mode: str | Callable[[socket.socket, HostileHead], None]) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.requests = 0  # connections accepted: the calls (attempts included) the operator made
        self.hung = threading.Event()  # a request reached a "hang" head
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.requests += 1  # one accepting thread: no lock needed
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                if callable(self.mode):
                    self.mode(conn, self)
                elif self.mode == "huge":  # 150 MB of JSON-ish bytes, no Content-Length
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                    )
                    block = b"[" + b"1," * 32767 + b"1"
                    for _ in range(150 * 1024 * 1024 // len(block)):
                        if self.stop.is_set():
                            return
                        conn.sendall(block)
                elif self.mode == "declared":  # a Content-Length past the bound
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 157286400\r\n\r\n{")
                    time.sleep(5)
                elif self.mode == "drip":  # a body to the end of the connection, a byte every 10 ms
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                    )
                    for _ in range(DRIPPED_BYTES):
                        if self.stop.is_set():
                            return
                        conn.sendall(b" ")
                        time.sleep(0.01)
                elif self.mode == "hang":  # takes the request and never answers
                    self.hung.set()
                    self.stop.wait()
                elif self.mode == "ok":  # a head that answers at once (a leave that drained)
                    body = b'{"drained": true}'
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def hostile() -> Iterator:
    heads = []

    def make(mode: str) -> HeadClient:
        h = HostileHead(mode)
        heads.append(h)
        return HeadClient("127.0.0.1", h.port, "token")
    yield make
    for h in heads:
        h.close()


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("mode", ["huge", "declared"])
def test_an_answer_over_the_bound_is_no_answer_and_is_not_held(hostile, mode):
    head = hostile(mode)
    before = _max_rss_mib()
    t0 = time.monotonic()
    with pytest.raises(HeadUnreachable, match="answer"):
        head_client.listing_if_changed(head, None, attempts=1)
    grew = _max_rss_mib() - before
    print(f"\n[bounds] {mode}: refused after {time.monotonic() - t0:.2f}s, peak RSS grew {grew:.0f} MiB")
    assert grew < 64, f"RSS grew {grew:.0f} MiB reading a hostile answer"


class ReadClock:
    """head_client's clock for the calling thread: it moves STEP seconds each time the call looks at it,
    once as the call starts and then once per read of the head's socket. The call's deadline then falls
    after a number of reads, the same on any machine however loaded; other threads keep the real clock."""

    STEP = 0.5

    def __init__(self) -> None:
        self.thread, self.looks = threading.current_thread(), 0

    def monotonic(self) -> float:
        if threading.current_thread() is not self.thread:
            return time.monotonic()
        self.looks += 1
        return self.looks * self.STEP


def test_a_dripped_answer_is_cut_at_the_call_s_timeout(hostile, monkeypatch):
    """Counted in reads: a head that drips a byte into every read never lets a per-read timeout expire,
    so only the call's one deadline (CONNECT_SECONDS + READ_SECONDS after it began) can end it."""
    head = hostile("drip")
    clock = ReadClock()
    monkeypatch.setattr(head_client, "time", SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep))
    with pytest.raises(HeadUnreachable, match="not complete within"):
        head_client.listing_if_changed(head, None, attempts=1)
    reads = clock.looks - 1  # the first look starts the call
    allowed = (head_client.CONNECT_SECONDS + head_client.READ_SECONDS) / ReadClock.STEP
    print(f"\n[bounds] drip: cut after {reads} reads (its deadline allows {allowed:.0f}; the head drips "
          f"up to {DRIPPED_BYTES} bytes, a read each)")
    assert reads <= allowed, f"the call read {reads} times, past its deadline"
