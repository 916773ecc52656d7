"""head_client's failure messages end up in conditions and Events: they must not change per call."""

from __future__ import annotations

import pytest
from omnistage.runtime import head_client, headview, memory
from omnistage.runtime.head_client import HeadClient, HeadUnreachable
from omnistage_engine_patches import contract

from tests.support.ports import free_port


def test_unreachable_head_message_is_stable():
    head = HeadClient("127.0.0.1", free_port(), "token")
    messages = set()
    for _ in range(2):
        with pytest.raises(HeadUnreachable) as err:
            head_client.report_if_changed(head, None, attempts=1)
        messages.add(str(err.value))
    assert len(messages) == 1, messages
    (message,) = messages
    assert "no answer" in message and " at 0x" not in message


# ---- the operator's probe: conditional GETs (the head side: tests/engine/test_membership_api.py) ----

class _Head:
    """A head on loopback that answers like the membership endpoint: ETag, 304 on If-None-Match.
    Only the HTTP exchange is simulated here; the real endpoint is tested in the engine tier."""

    def __init__(self) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.boot, self.epoch, self.distributed_known = "boot-1", 1, True
        self.requests: list[tuple[str, str | None]] = []
        head = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                head.requests.append((self.path, self.headers.get("If-None-Match")))
                if self.path == contract.MEMBERSHIP_PATH:
                    body = {"bootId": head.boot, "epoch": head.epoch, "stages": {"0": []}}
                    etag = f'"{head.boot}.{head.epoch}"'
                else:
                    body = {"bootId": head.boot, "distributed": True if head.distributed_known else None,
                            "frontendCache": {"mode": "processor-only"} if head.distributed_known else None}
                    etag = f'"{json.dumps(body, sort_keys=True)}"'.replace(" ", "")
                if self.headers.get("If-None-Match") == etag:
                    self.send_response(304)
                    self.send_header("ETag", etag)
                    self.end_headers()
                    return
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("ETag", etag)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.client = HeadClient("127.0.0.1", self.server.server_address[1], "token")

    def paths(self) -> list[str]:
        out = [p for p, _ in self.requests]
        self.requests.clear()
        return out


@pytest.fixture
def fake_head():
    head = _Head()
    yield head
    head.server.shutdown()


def test_conditional_get_returns_none_while_unchanged(fake_head):
    body, etag = head_client.listing_if_changed(fake_head.client, None)
    assert body["epoch"] == 1 and etag == '"boot-1.1"'
    assert head_client.listing_if_changed(fake_head.client, etag) == (None, etag)
    fake_head.epoch = 2
    body, etag2 = head_client.listing_if_changed(fake_head.client, etag)
    assert body["epoch"] == 2 and etag2 != etag


def test_a_pass_at_rest_probes_once_and_a_new_boot_refetches_the_report(fake_head):
    view = headview.HeadView("head-uid")
    report, listing, rp, lp = headview.ask_head(fake_head.client, view, distributed=True)
    assert (rp, lp) == (None, None) and report["bootId"] == listing["bootId"] == "boot-1"
    assert fake_head.paths() == [contract.MEMBERSHIP_PATH, contract.ENGINE_PATH]
    for _ in range(3):  # at rest: the listing probe only, answered 304; the copies are handed on
        assert headview.ask_head(fake_head.client, view, distributed=True)[:2] == (report, listing)
        assert fake_head.paths() == [contract.MEMBERSHIP_PATH]
    fake_head.epoch = 2  # a join/leave elsewhere: the listing again, not the report
    _, listing, _, _ = headview.ask_head(fake_head.client, view, distributed=True)
    assert listing["epoch"] == 2 and fake_head.paths() == [contract.MEMBERSHIP_PATH]
    fake_head.boot = "boot-2"  # the head engine restarted in place: both
    report, listing, _, _ = headview.ask_head(fake_head.client, view, distributed=True)
    assert report["bootId"] == listing["bootId"] == "boot-2"
    assert fake_head.paths() == [contract.MEMBERSHIP_PATH, contract.ENGINE_PATH]


def test_an_unsettled_report_is_asked_again_and_a_static_head_probes_its_report(fake_head):
    fake_head.distributed_known = False  # the engine is not built yet
    view = headview.HeadView("head-uid")
    headview.ask_head(fake_head.client, view, distributed=True)
    fake_head.paths()
    headview.ask_head(fake_head.client, view, distributed=True)
    assert fake_head.paths() == [contract.MEMBERSHIP_PATH, contract.ENGINE_PATH]
    static = headview.HeadView("other")
    report, listing, _, _ = headview.ask_head(fake_head.client, static, distributed=False)
    assert listing is None and report is not None
    headview.ask_head(fake_head.client, static, distributed=False)
    assert [inm is not None for _, inm in fake_head.requests] == [False, True]  # the second is conditional


def test_an_unreachable_head_is_asked_once_per_pass():
    head = HeadClient("127.0.0.1", free_port(), "token")
    report, listing, rp, lp = headview.ask_head(head, headview.HeadView("u"), distributed=True)
    assert report is None and listing is None and rp.startswith("head unreachable") and lp


def test_a_dead_head_is_not_dialled_again_before_its_backoff(monkeypatch):
    head = HeadClient("127.0.0.1", free_port(), "token")
    view = headview.HeadView("u")
    first = headview.ask_head(head, view, distributed=True)
    dials = []

    def dial(*args, **kwargs):
        dials.append(args)
        raise HeadUnreachable("still dead")

    monkeypatch.setattr(head_client, "_conditional_call", dial)
    assert headview.ask_head(head, view, distributed=True) == first and dials == []  # same answer, no dial
    view.retry_at = 0.0  # the backoff is over (or the head pod changed): dialled, once, without a retry
    assert headview.ask_head(head, view, distributed=True)[2] == "head unreachable: still dead"
    assert len(dials) == 1 and dials[0][-2] == 1  # attempts=1
    assert view.failures == 2 and view.retry_at > 0


def test_only_a_head_that_answered_before_gets_a_retry(monkeypatch, fake_head):
    """After an operator start every head is new to it: a hanging one must hold a reconcile worker
    for one read timeout, not two (bench_fleet: 1,000 OmniStages, 10% hanging, restart 90 s)."""
    attempts = []
    real = head_client._conditional_call

    def counting(*args, **kwargs):
        attempts.append(args[-2])
        return real(*args, **kwargs)

    monkeypatch.setattr(head_client, "_conditional_call", counting)
    view = headview.HeadView("u")
    headview.ask_head(fake_head.client, view, distributed=True)
    assert attempts and set(attempts) == {1} and view.answered  # never heard from: one attempt
    attempts.clear()
    headview.ask_head(fake_head.client, view, distributed=True)
    assert attempts and set(attempts) == {2}  # it answered before: a blip is worth a retry


def test_the_resync_probe_queues_a_pass_only_when_the_head_said_something_new(fake_head):
    key = ("ns", "probe-test")
    view = headview.HEADS[key] = headview.HeadView("head-uid")
    answers = headview.ask_head(fake_head.client, view, distributed=True)
    memory.RESTING[key] = memory.Resting(("...", headview.said(view, *answers)), fake_head.client, True)
    try:
        fake_head.paths()
        assert headview.probe(*key) is False and fake_head.paths() == [contract.MEMBERSHIP_PATH]
        fake_head.epoch = 7
        assert headview.probe(*key) is True
        memory.RESTING.pop(key)
        assert headview.probe(*key) is True and fake_head.paths() == [contract.MEMBERSHIP_PATH]  # not at rest
    finally:
        memory.forget(*key)
