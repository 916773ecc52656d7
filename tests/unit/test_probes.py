"""The operator's probes (runtime/probes.py): readiness is "leading and synced" or "standing by",
liveness is the process working, and the two answer apart."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from omnistage.runtime import probes

from tests.support.ports import free_port


@pytest.mark.parametrize(("leading", "synced", "expected"), [
    (True, True, (True, probes.LEADING_AND_SYNCED)),
    (True, False, (False, probes.LEADING_SYNCING)),  # a new leader still listing: not Ready yet
    (False, False, (True, probes.STANDING_BY)),  # a follower watches nothing, and is Ready
])
def test_readiness(leading, synced, expected):
    assert probes.readiness(leading, synced) == expected


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def checks(**kw):
    return probes.Checks(**{"leading": lambda: True, "synced": lambda: True, "omnistages": lambda: 3, **kw})


def test_liveness_needs_kopfs_loop_running_and_the_threads_alive(loop):
    assert probes.liveness(checks()) == (False, "starting: kopf's startup handlers have not run")
    assert probes.liveness(checks(loop=loop)) == (True, "alive")
    dead = threading.Thread(target=lambda: None, name="omnistage-resync")
    dead.start()
    dead.join()
    assert probes.liveness(checks(loop=loop, threads=(dead,))) == (False, "thread omnistage-resync died")


def test_a_stuck_loop_is_not_alive(loop, monkeypatch):
    monkeypatch.setattr(probes, "LOOP_TIMEOUT", 0.2)
    release = threading.Event()
    loop.call_soon_threadsafe(release.wait, 5)  # blocks the loop, as a synchronous call inside kopf would
    try:
        ok, state = probes.liveness(checks(loop=loop))
    finally:
        release.set()
    assert not ok and "did not answer" in state


def _get(port: int, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_liveness_and_readiness_answer_apart(loop, monkeypatch):
    """A leader still listing is live and not Ready; once synced it is Ready; as a follower it is
    Ready standing by. Liveness stays 200 throughout: nothing about the Lease or the API server."""
    state = {"leading": True, "synced": False}
    monkeypatch.setattr(probes, "CHECKS", None)
    port = free_port()
    server = probes.serve(port, "127.0.0.1", checks(leading=lambda: state["leading"],
                                                     synced=lambda: state["synced"]))
    try:
        assert _get(port, "/healthz") == (503, {"state": "starting: kopf's startup handlers have not run"})
        probes.watch_loop(loop)
        assert _get(port, "/healthz") == (200, {"state": "alive"})
        assert _get(port, "/readyz") == (
            503,
            {"state": probes.LEADING_SYNCING, "leading": True, "omnistages": 3},
        )
        state["synced"] = True
        assert _get(port, "/readyz") == (
            200,
            {"state": probes.LEADING_AND_SYNCED, "leading": True, "omnistages": 3},
        )
        state["leading"] = False
        assert _get(port, "/readyz") == (
            200,
            {"state": probes.STANDING_BY, "leading": False, "omnistages": 3},
        )
        assert _get(port, "/healthz")[0] == 200
        assert _get(port, "/metrics")[0] == 404
    finally:
        server.shutdown()
        server.server_close()
