"""The pool pod's supervisor (omnistage_engine_patches.stages): one process per stage, and the pod is
one unit: when any stage's process ends the others are stopped and the supervisor fails. Runs real
subprocesses (a tiny Python program stands in for `vllm serve`; no vLLM is imported)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from omnistage_engine_patches import stages

# Stands in for `vllm serve ... --stage-id K`: prints its stage, then sleeps, or exits with status
# EXIT when its stage id is in DIE (after a moment, so the supervisor has started every stage).
# It says it started only once its SIGTERM handler is in place.
STAGE = ("import os, sys, time, signal; k = sys.argv[-1]; "
         # one os.write per line: the two stages share the supervisor's stdout and must not interleave
         "say = lambda *w: os.write(1, (' '.join(w) + chr(10)).encode()); "
         "signal.signal(signal.SIGTERM, lambda *a: (say('stage', k, 'term'), sys.exit(0))); "
         "say('stage', k); "
         "time.sleep(0.5) if k in os.environ.get('DIE', '').split(',') else time.sleep(60); "
         "sys.exit(int(os.environ.get('EXIT', '3')))")


def supervise(*ids, env=None):
    args = [a for k in ids for a in ("--stage-id", str(k))]
    return subprocess.Popen([sys.executable, "-m", "omnistage_engine_patches.stages", *args, "--",
                             sys.executable, "-c", STAGE, "--stage-id-is-appended"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_parse_and_the_command_per_stage():
    ids, command = stages.parse(["--stage-id", "1", "--stage-id", "2", "--", "vllm", "serve", "M", "--omni"])
    assert ids == [1, 2] and command == ["vllm", "serve", "M", "--omni"]
    assert stages.stage_command(command, 2) == ["vllm", "serve", "M", "--omni", "--stage-id", "2"]


@pytest.mark.parametrize("argv, fragment", [
    (["--stage-id", "1", "vllm"], "usage"),
    (["--stage-id", "1", "--"], "no command"),
    (["--stage-id", "1", "--stage-id", "1", "--", "vllm"], "repeat"),
])
def test_bad_arguments_are_refused(argv, fragment):
    with pytest.raises(SystemExit, match=fragment):
        stages.parse(argv)


def test_one_stage_ending_stops_the_others_and_fails_the_pod(monkeypatch):
    import os

    env = {**os.environ, "DIE": "2", "EXIT": "0"}
    proc = supervise(1, 2, env=env)
    out, _ = proc.communicate(timeout=40)
    assert "stage 1" in out and "stage 2" in out
    assert "stage 2 exited with status 0; stopping the others" in out
    assert "stage 1 term" in out  # the survivor got SIGTERM
    assert proc.returncode == 1  # a stage that ended on its own fails the pod, even with status 0


def test_sigterm_reaches_every_stage_and_exits_cleanly():
    proc = supervise(1, 2)
    deadline = time.monotonic() + 60  # a loaded 2-core machine starts two interpreters slowly
    lines = []
    while time.monotonic() < deadline and sum("stage" in line and "term" not in line for line in lines) < 3:
        lines.append(proc.stdout.readline())
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=40)
    out = "".join(lines) + out
    assert "stage 1 term" in out and "stage 2 term" in out
    assert proc.returncode == 0
