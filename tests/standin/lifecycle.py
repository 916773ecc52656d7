"""Starting, restarting and stopping a pod's process as a kubelet does: forked from the fork server
(zygote.py) or started plain, in its own session, niced in real mode; the restart policy with the
kubelet's growing back-off; a deleted pod's preStop hook, then SIGTERM, then SIGKILL after the grace;
pid files, so a runtime that was killed leaves nothing running behind it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from typing import Any

from tests.standin import zygote
from tests.standin.commands import ROOT, _child_env, _NotYet, _Refused
from tests.standin.podstatus import _gates
from tests.standin.processes import (
    BACKOFF_BASE,
    BACKOFF_CAP,
    BACKOFF_FIRST,
    CONTAINER_MARKER,
    PRE_STOP_CAP,
    REAL_NICE,
    Proc,
    _exit_code,
    _is_standin,
    _killpg,
    _now,
    _pid_alive,
    container_marker,
    kill_container,
)


class Lifecycle:
    """The StandinRuntime's part that starts and stops processes (kubelet.py mixes it in)."""

    def _spawn(self, p: Proc, pod: dict[str, Any], restart: bool) -> None:
        p.starts += 1
        with open(p.log_path, "ab") as logf:
            logf.write(f"\n===== [runtime {_now()}] start #{p.starts}: {' '.join(p.argv)}\n".encode())
            logf.flush()
            # Own session: SIGTERM/SIGKILL reach every process the stand-in forks, and a Ctrl-C in the
            # runtime's terminal does not hit the engines before the runtime stops them in order.
            real = p.env is not None
            p.popen = None if real else self._fork(p, pod)
            if p.popen is None:
                env = {**(p.env if real else _child_env(p.ip, pod)), CONTAINER_MARKER: container_marker(p)}
                p.popen = subprocess.Popen(p.argv, cwd=p.env["HOME"] if real else ROOT,
                                           env=env, stdin=subprocess.DEVNULL,
                                           stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        if p.env is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, p.popen.pid, REAL_NICE)  # before it spawns its engine core
        p.started_at = time.monotonic()
        p.ready, p.probe_failures, p.next_probe = None, 0, time.monotonic() + 0.5
        p.started, p.live_failures, p.next_live = False, 0, p.next_probe
        self._write_pid(p)
        self._event("restart" if restart else "start", p, start=p.starts, log=str(p.log_path))
        if restart:
            self._patch_restarted(p, pod)
        elif self.probes and _gates(pod):
            # kwok wrote True into the readiness gates; the kubelet never writes them (their owner,
            # the operator, does): take kwok's word back, the pod is Ready once the operator says so.
            self._patch_ready(p, p.probe is None, "waiting for the readiness gates", reset_gates=True)
        elif p.probe and self.probes:
            # The kubelet reports Ready only after the first successful readiness probe; kwok already
            # said Ready, so take it back until the stand-in answers.
            self._patch_ready(p, False, "waiting for the first readiness probe")

    def _fork(self, p: Proc, pod: dict[str, Any]) -> zygote.ZygoteChild | None:
        """The stand-in forked from the fork server, or None (not ready yet, gone, or not a
        `python -m` command): the caller starts a plain process, which behaves the same, slower."""
        z = self._zygote
        if z is None or p.argv[:2] != [self.python, "-m"]:
            return None
        if z.ready and not self._zygote_said:
            self._zygote_said = True
            self.log(f"fork server ready after {z.startup_seconds}s: stand-ins start from its imports")
        try:
            return z.spawn(p.argv[2], p.argv[3:], _child_env(p.ip, pod), str(ROOT), p.log_path)
        except zygote.Refused as why:
            self.log(f"plain    {p.role:<7} {p.namespace}/{p.pod}: the fork server refused it ({why})")
            return None
        except (OSError, RuntimeError) as err:
            self.log(f"fork server failed ({err}): plain processes from now on")
            self._zygote = None
            return None

    def _on_exit(self, p: Proc, pod: dict[str, Any] | None, code: int | None) -> None:
        p.last_exit = _exit_code(code)
        if p.restart_policy == "Always" or (p.restart_policy == "OnFailure" and code != 0):
            ran = time.monotonic() - p.started_at
            if ran > 2 * BACKOFF_CAP:
                p.backoff = BACKOFF_FIRST  # the kubelet resets the back-off after a long healthy run
            delay = p.backoff
            p.backoff = BACKOFF_BASE if p.backoff < BACKOFF_BASE else min(p.backoff * 2, BACKOFF_CAP)
            p.restart_at = time.monotonic() + delay
            self.log(f"backoff  {p.role:<7} {p.namespace}/{p.pod}: restart in {delay:.0f}s (restartPolicy {p.restart_policy})")
            if pod is not None:
                self._patch_ready(p, False, f"container exited with code {p.last_exit}")
        else:
            p.failed = True
            if pod is not None:
                self._patch_failed(p, pod, code)

    def _terminate(self, p: Proc, reason: str) -> None:
        p.stopping = True
        p.restart_at = None
        with p.lock:  # the pod's deletion and the runtime's own stop may both ask
            if not p.terminated:
                self._terminate_locked(p, reason)
                p.terminated = True

    def _prepare_pre_stop(self, p: Proc, pod: dict[str, Any], container: dict[str, Any]) -> None:
        """A kubelet runs the container's preStop exec hook before SIGTERM when the pod is deleted
        (the engine pods' drains the replica: omnistage_engine_patches.prestop). Real mode: the hook
        as written, in the container's environment (python3 is the image's). Stand-in mode: with
        this runtime's Python, the pod's OMNISTAGE_* variables and its membership token."""
        command = (((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")
        if not command:
            return
        grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        if p.env is not None:
            p.pre_stop, p.pre_stop_env, p.pre_stop_grace = list(command), p.env, min(grace, self.grace_cap)
            return
        try:
            env = {**_child_env(p.ip, pod), "OMNISTAGE_MEMBERSHIP_TOKEN_FILE": str(self._token_file(pod))}
        except (_NotYet, _Refused) as err:
            self.log(f"no preStop hook for {p.namespace}/{p.pod}: {err}")
            return
        p.pre_stop = [self.python if command[0] == "python3" else command[0], *command[1:]]
        p.pre_stop_env, p.pre_stop_grace = env, min(grace, PRE_STOP_CAP)

    def _run_pre_stop(self, p: Proc) -> None:
        self._event("prestop", p, command=" ".join(p.pre_stop))
        with open(p.log_path, "ab") as logf:
            try:
                code: int | str = subprocess.run(
                    p.pre_stop, check=False, env=p.pre_stop_env, cwd=p.pre_stop_env.get("HOME") if p.env is not None else ROOT,
                    stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                    timeout=p.pre_stop_grace).returncode
            except (OSError, subprocess.TimeoutExpired) as err:
                code = type(err).__name__
        self._event("prestopped", p, code=code)

    def _terminate_locked(self, p: Proc, reason: str) -> None:
        if p.alive() and p.pre_stop and not self._stop.is_set():
            # The kubelet's order: the hook, then SIGTERM. Also for a pod already gone or replaced
            # under its name: kwok removes a deleted pod's object at once, without its grace.
            self._run_pre_stop(p)
        if p.alive():
            self._sigterm(p, reason)
        elif p.popen is not None:
            kill_container(p.pid, container_marker(p))  # stragglers of an exited leader
        with self._lock:
            if self._procs.get(p.key) is p:
                del self._procs[p.key]
        for path in (self.state_dir / "pids" / f"{p.namespace}_{p.pod}.json",
                     self.state_dir / "tokens" / f"{p.namespace}_{p.pod}_{p.uid[:8]}"):
            path.unlink(missing_ok=True)

    def _sigterm(self, p: Proc, reason: str) -> None:
        """Stop the process as a kubelet stops a container: SIGTERM to its group, SIGKILL after the
        grace (the pod's in real mode, else stop_timeout)."""
        self._event("stop", p, reason=reason.replace(" ", "_"), signal="SIGTERM")
        _killpg(p.pid, signal.SIGTERM)
        grace = self.stop_timeout if p.grace is None or self._stop.is_set() else p.grace
        try:
            p.popen.wait(grace)
        except subprocess.TimeoutExpired:
            self._event("kill", p, reason=f"no_exit_within_{grace:.0f}s", signal="SIGKILL")
            _killpg(p.pid, signal.SIGKILL)
            p.popen.wait(5)
        # A container's stop ends every process in it: a child that outlived its leader's SIGTERM
        # (or left its process group) would hold the pod's ports and IP for the next pod.
        if stragglers := kill_container(p.pid, container_marker(p)):
            self._event("kill", p, reason="processes_left_after_the_leader", signal="SIGKILL", count=stragglers)
        self._event("stopped", p, code=p.popen.returncode)

    def _write_pid(self, p: Proc) -> None:
        info = {"namespace": p.namespace, "pod": p.pod, "uid": p.uid, "role": p.role, "ip": p.ip, "pid": p.pid,
                "log": str(p.log_path), "starts": p.starts, "runtimePid": os.getpid(), "argv": p.argv}
        path = self.state_dir / "pids" / f"{p.namespace}_{p.pod}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)

    def _reap_stale(self) -> None:
        """Stop stand-ins left behind by a runtime that was killed (pid files of a dead runtime)."""
        for f in (self.state_dir / "pids").glob("*.json"):
            try:
                info = json.loads(f.read_text())
            except (OSError, ValueError):
                f.unlink(missing_ok=True)
                continue
            if _pid_alive(info.get("runtimePid")) and info.get("runtimePid") != os.getpid():
                continue  # another live runtime owns it
            pid = info.get("pid")
            if pid and _is_standin(pid, info.get("argv")):
                self.log(f"stopping stale stand-in pid {pid} of {info.get('namespace')}/{info.get('pod')}")
                _killpg(pid, signal.SIGKILL)
            f.unlink(missing_ok=True)
