"""The operator's /metrics and probes bind an address of the installer's choosing, not 0.0.0.0 (issue 27,
item 8): its metrics name every tenant's OmniStages. `omnistage run` binds loopback unless told (the flag,
else OMNISTAGE_BIND_ADDRESS); the install manifests set the pod's IP (tests/unit/test_chart.py)."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from omnistage import operator_main
from omnistage.runtime import probes

from tests.support.ports import free_port


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(operator_main.BIND_ADDRESS_ENV, raising=False)


def test_loopback_unless_told(no_env, monkeypatch):
    assert operator_main.bind_address(None) == "127.0.0.1"
    monkeypatch.setenv(operator_main.BIND_ADDRESS_ENV, "10.1.2.3")
    assert operator_main.bind_address(None) == "10.1.2.3"
    assert operator_main.bind_address("0.0.0.0") == "0.0.0.0"  # the flag beats the variable


def test_the_run_command_sets_no_address_of_its_own(no_env):
    from omnistage.cli import build_parser

    args = build_parser().parse_args(["run"])
    assert operator_main.bind_address(args.bind_address) == "127.0.0.1"


def test_the_probes_answer_on_the_bound_address_only(no_env):
    port = free_port()
    checks = probes.Checks(leading=lambda: False, synced=lambda: True, omnistages=lambda: 0)
    server = probes.serve(port, operator_main.bind_address(None), checks)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            assert resp.status == 200
        # Another address of this host (all of 127/8 is loopback on Linux): bound to 0.0.0.0 it answered.
        with pytest.raises(OSError), socket.create_connection(("127.0.0.2", port), timeout=2):
            pass
    finally:
        server.shutdown()
        server.server_close()
