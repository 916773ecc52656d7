"""The stand-ins' fork server (tests/standin/zygote.py) behaves as `python -m` would: the child's
argv, environment, working directory, log, session and exit code are its own. Real processes, no
cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.standin import zygote

PROBE = textwrap.dedent("""
    import json, os, sys, time
    print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("PROBE_VALUE"), "base": os.environ.get("ONLY_IN_BASE"),
                      "cwd": os.getcwd(), "sid": os.getsid(0) == os.getpid(), "vllm_loaded": "vllm" in sys.modules}),
          flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else 0)
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("zygote")
    (d / "zygote_probe.py").write_text(PROBE)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(d), root]), "ONLY_IN_BASE": "base",
           "PYTHONUNBUFFERED": "1"}
    z = zygote.Zygote(sys.executable, env, root, d / "zygote.log")
    deadline = time.monotonic() + 300
    while not z.ready:
        assert z.alive(), (d / "zygote.log").read_text()[-2000:]
        assert time.monotonic() < deadline, "the fork server was not ready in 300s"
        time.sleep(0.2)
    # A child's environment agrees with the server's on what the imports read (zygote.py's guard).
    yield z, d, {k: v for k, v in env.items() if k != "ONLY_IN_BASE"}
    z.close()
    assert not z.alive()


def _record(log):
    import json
    return json.loads(log.read_text().strip().splitlines()[-1])


def test_a_child_runs_the_module_with_its_own_argv_env_cwd_log_and_exit_code(server, tmp_path):
    z, _, env = server
    log = tmp_path / "child.log"
    child = z.spawn("zygote_probe", ["7", "x"], {**env, "PROBE_VALUE": "mine"}, str(tmp_path), log)
    assert child.wait(60) == 7
    rec = _record(log)
    assert rec["argv"] == ["7", "x"] and rec["env"] == "mine" and rec["cwd"] == str(tmp_path)
    assert rec["base"] is None, "the child's environment is the one it was given, not the server's"
    assert rec["sid"], "a session of its own, as start_new_session gives"
    assert rec["vllm_loaded"], "vLLM came imported from the server (the point of it)"


def test_a_signal_to_the_child_s_group_is_its_exit_code(server, tmp_path):
    z, _, env = server
    log = tmp_path / "child.log"
    child = z.spawn("zygote_probe", ["sleep"], env, str(tmp_path), log)
    deadline = time.monotonic() + 60
    while not log.exists() or not log.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM


def test_a_child_whose_environment_differs_on_what_the_imports_read_is_refused(server, tmp_path):
    """vllm-omni reads some variables once, at import (e.g. its abort timeout): a child forked with
    another value would run with the server's. It is refused (the runtime starts it plain), and the
    server goes on serving the others."""
    z, _, env = server
    assert "VLLM_OMNI_INPUT_WAIT_TIMEOUT_S" in z.reads_at_import, z.reads_at_import
    with pytest.raises(zygote.Refused, match="VLLM_OMNI_INPUT_WAIT_TIMEOUT_S"):
        z.spawn("zygote_probe", ["0"], {**env, "VLLM_OMNI_INPUT_WAIT_TIMEOUT_S": "9"}, str(tmp_path), tmp_path / "no.log")
    assert not (tmp_path / "no.log").exists()
    child = z.spawn("zygote_probe", ["0"], {**env, "NOT_READ_AT_IMPORT": "1"}, str(tmp_path), tmp_path / "yes.log")
    assert child.wait(60) == 0


def test_one_server_per_process_whatever_the_environment(monkeypatch):
    """The cluster tier's runtimes (one per test module) share one server. Keyed on the environment
    too, each module got its own, as pytest's PYTEST_CURRENT_TEST names the running test: 20 s of
    imports per module, and its first OmniStage's processes started plain."""
    made = []

    class Server:
        def __init__(self, *args):
            made.append(args)

        def alive(self) -> bool:
            return True

        def close(self) -> None:
            pass

    monkeypatch.setattr(zygote, "Zygote", Server)
    monkeypatch.setattr(zygote, "_SHARED", {})
    first = zygote.shared("python", {"PYTEST_CURRENT_TEST": "tests/cluster/test_a.py::t (setup)"}, "/tree", "a.log")
    second = zygote.shared("python", {"PYTEST_CURRENT_TEST": "tests/cluster/test_b.py::t (setup)"}, "/tree", "b.log")
    assert first is second and len(made) == 1
