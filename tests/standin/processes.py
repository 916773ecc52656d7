"""One pod's container process (`Proc`: what the runtime knows of it) and the signals it gets: its
process group killed, a pid checked against the command line it was started with (pids are reused),
an exit status read as a container's exit code. The bounds of a stop and of the restart back-off."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.standin import zygote

# Bounds. The kubelet honours terminationGracePeriodSeconds (60 s and more for these pods); the
# stand-ins exit on SIGTERM in well under a second, so a tighter bound keeps test teardown short.
STOP_TIMEOUT = 10.0
PRE_STOP_CAP = 60.0          # a stand-in's preStop hook (its replica serves nothing: the leave is quick)
BACKOFF_FIRST, BACKOFF_BASE, BACKOFF_CAP = 1.0, 10.0, 60.0  # kubelet-like crash back-off
# Real mode: a deleted pod's engine gets its terminationGracePeriodSeconds after SIGTERM, as from a
# kubelet, up to this bound (the operator drains before it deletes; vLLM's own shutdown is seconds).
REAL_GRACE_CAP = 120.0
# A force-deleted pod (`kubectl delete --grace-period=0 --force`): a kubelet raises the deletion's 0 to
# its minimum grace (minimumGracePeriodInSeconds), which the preStop hook and SIGTERM share.
FORCED_GRACE = 2.0
# Real engines run below the operator, the API server and the tests on a 2-core machine.
REAL_NICE = 10


@dataclass
class Proc:
    """One pod's stand-in container process."""

    namespace: str
    pod: str
    uid: str
    role: str
    ip: str
    argv: list[str]
    log_path: Path
    restart_policy: str
    popen: subprocess.Popen | zygote.ZygoteChild | None = None
    started_at: float = 0.0
    starts: int = 0            # 1 + restarts; each start is a new head boot id
    restart_at: float | None = None
    backoff: float = BACKOFF_FIRST
    failed: bool = False       # restartPolicy Never and the process exited: never started again
    last_exit: int | None = None  # container exit code of the previous run (128+signal if killed)
    stopping: bool = False
    probe: dict[str, Any] | None = None  # readiness: {"url", "period", "failure_threshold", "timeout"}
    ready: bool | None = None
    probe_failures: int = 0
    next_probe: float = 0.0
    liveness: dict[str, Any] | None = None  # the livenessProbe, as `probe`
    started: bool = False      # this run passed its start-up (a first probe success): liveness counts
    live_failures: int = 0
    next_live: float = 0.0     # inf while a liveness probe is under way, and after its kill
    history: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one terminator at a time
    terminated: bool = False
    env: dict[str, str] | None = None    # real mode: the container's environment (realpod.pod_process)
    grace: float | None = None           # real mode: the pod's terminationGracePeriodSeconds (capped)
    gate_patched_at: float = 0.0         # last time Ready was rewritten for a readiness gate change
    pre_stop: list[str] | None = None    # the container's preStop exec hook, as this machine runs it
    pre_stop_env: dict[str, str] | None = None
    pre_stop_grace: float = 0.0          # what the pod's grace period leaves the hook

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.pod)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def _now() -> str:
    return dt.datetime.now().strftime("%H:%M:%S.%f")[:-3]


def _exit_code(returncode: int | None) -> int:
    """Popen's returncode as a container exit code: a signal N becomes 128+N (SIGKILL -> 137)."""
    if returncode is None:
        return 0
    return 128 - returncode if returncode < 0 else returncode


def _killpg(pid: int | None, sig: int) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, sig)  # the child leads its own session, so its pgid is its pid
    except ProcessLookupError:
        pass
    except PermissionError:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# Every process a container started carries this variable (real mode: the engine cores vLLM spawns
# inherit it), so the runtime finds them after their leader died even when one left its process group.
CONTAINER_MARKER = "OMNISTAGE_STANDIN_CONTAINER"


def container_marker(p: Proc) -> str:
    return f"{p.namespace}/{p.pod}/{p.uid}/{p.starts}"


def container_pids(leader: int | None, marker: str | None = None) -> set[int]:
    """Every live process of one container run, as a container runtime's cgroup holds them: the
    leader's process group and session (its children, reparented to init once it died), and any
    process whose environment carries the run's marker (one that called setsid). The leader's pid
    stays the group's id after it exited, so a dead leader's children are still found."""
    if not leader:
        return set()
    needle = f"{CONTAINER_MARKER}={marker}".encode() if marker else None
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            # pid (comm) state ppid pgrp session ...: comm may hold spaces, so split after its ")".
            fields = stat[stat.rindex(b")") + 2:].split()
            state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
            if state == b"Z":
                continue  # already dead, waiting for its parent to reap it: holds no port
            if pgrp == leader or session == leader or needle and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def kill_container(leader: int | None, marker: str | None = None) -> int:
    """SIGKILL every process of the container run (container_pids); how many were signalled."""
    pids = container_pids(leader, marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(pids)


def _is_standin(pid: int, argv: list[str] | None) -> bool:
    """Guard against pid reuse: only signal a process whose command line is the one we started."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and [c.decode(errors="replace") for c in cmdline if c] == argv
