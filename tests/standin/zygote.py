"""A fork server for the stand-in engine processes (test tooling only; real-mode engines never use it).

Every stand-in head and replica is `python -m tests.standin.{head,replica}`, and each spends most of
its start-up importing torch, transformers and vLLM (10 s on an idle 2-core machine, 35 s or more
while the cluster tier runs several at once): the cluster tier starts a hundred of them. This server
imports those once and forks a child per process, which then runs the stand-in module as `python -m`
would (its own session, argv, environment, working directory and log file) and imports the rest
itself: vllm-omni and this project's plugin (loaded by vLLM's plugin loader in the child, as in a
fresh process, so the patches see the environment the pod sets).

What the child inherits that a fresh process would not have: the imported modules (torch, vLLM and
the vllm-omni modules the stand-ins and the plugin's patches import: PRELOAD) and the environment
variables those imports set (vllm.env_override's), unless the pod sets them. Two guards keep a forked
child what a fresh one would be:
* the server records every environment variable the imports read (module-level constants such as
  vllm-omni's timeouts) and refuses a child whose environment differs on one of them: the runtime
  starts that one as a plain process, which reads its own;
* it refuses to serve at all when the imports started a Python thread: a forked child would lack it.
The plugin is not among the imports: vLLM's plugin loader runs in the child, as in a fresh process,
so the patches see the environment the pod sets.

Protocol (JSON lines on the server's stdin/stdout, which it moves off fds 0 and 1):
  -> {"id": N, "module": M, "args": [...], "env": {...}, "cwd": D, "log": PATH}
  <- {"id": N, "pid": P}  or  {"id": N, "error": "..."}  or  {"id": N, "refused": "..."} (environment)
  <- {"exit": P, "code": C}       (C as subprocess.Popen.returncode: -signal when killed)
The server reaps its children; it exits when its stdin closes (its children keep running, as a
runtime's Popen children would: the runtime's pid files find them).

  python -m tests.standin.zygote   (started by StandinRuntime; OMNISTAGE_STANDIN_ZYGOTE=0 turns it off)
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from typing import Any

# torch and vLLM, then what tests/standin and the plugin's patches import from vllm-omni (about 5 s of
# each stand-in's start on an idle machine: diffusers and vLLM's rotary embeddings come with them).
PRELOAD = ("torch", "transformers", "vllm", "vllm.config", "vllm.engine.arg_utils",
           "vllm.multimodal.cache", "vllm.v1.engine", "vllm_omni", "vllm_omni.engine.async_omni_engine",
           "vllm_omni.engine.orchestrator", "vllm_omni.engine.omni_engine_base", "vllm_omni.engine.stage_pool",
           "vllm_omni.engine.stage_runtime", "vllm_omni.engine.stage_engine_startup",
           "vllm_omni.engine.membership_controller", "vllm_omni.entrypoints.omni_base",
           "vllm_omni.distributed.omni_coordinator")
READY = "zygote-ready"
ENABLED_ENV = "OMNISTAGE_STANDIN_ZYGOTE"


def enabled() -> bool:
    return os.environ.get(ENABLED_ENV, "1") != "0"


# ----- the server ---------------------------------------------------------------------------------

def serve() -> int:
    proto_in, proto_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # what the imports print goes to the server's log, never into the protocol
    base = dict(os.environ)
    started = time.monotonic()
    with _reads_recorded() as reads:
        for name in PRELOAD:
            importlib.import_module(name)
    if threading.active_count() != 1:
        print(f"zygote: the preloaded imports started {threading.active_count() - 1} Python thread(s); "
              "a forked child would lack them: not serving", file=sys.stderr, flush=True)
        return 3
    added = {k: v for k, v in os.environ.items() if base.get(k) != v}
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # What the imports saw: the server's environment before them (a variable they set themselves, as
    # torch does LD_LIBRARY_PATH, is in `added`, which a child gets too unless the pod sets it).
    read_by_imports = {k: base.get(k) for k in reads}
    _send(proto_out, {"ready": READY, "seconds": round(time.monotonic() - started, 1), "preload": list(PRELOAD),
                      "reads": sorted(reads)})
    sel = selectors.DefaultSelector()
    sel.register(proto_in, selectors.EVENT_READ, "proto")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.data == "wake":
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(proto_out)
                continue
            chunk = os.read(proto_in, 65536)
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                child_env = {**added, **req["env"]}
                differ = sorted(k for k, v in read_by_imports.items()
                                if child_env.get(k) not in (v, added.get(k, v)))
                if differ:
                    why = f"its environment differs on variables the preloaded imports read: {', '.join(differ)}"
                    print(f"zygote: refused {req['module']} {req['log']}: {why}", file=sys.stderr, flush=True)
                    _send(proto_out, {"id": req["id"], "refused": why})
                    continue
                try:
                    pid = os.fork()
                except OSError as err:
                    _send(proto_out, {"id": req["id"], "error": str(err)})
                    continue
                if pid == 0:
                    sel.close()
                    for fd in (proto_in, proto_out, wake_r, wake_w, devnull):
                        os.close(fd)
                    return _child(req, added)
                _send(proto_out, {"id": req["id"], "pid": pid})
        _reap(proto_out)  # also after requests: a SIGCHLD whose wake-up byte was dropped (pipe full)


@contextlib.contextmanager
def _reads_recorded():
    """The names of the environment variables read by name inside (os.environ[...], .get, os.getenv,
    `in`). A scan of the whole environment is not a read of each name: os.environ.copy(), dict(...)
    and .items() (platform's, wsgiref's snapshots; tqdm's and networkx's prefixes, which no pod sets)
    read each key right after iterating it, and those reads are left out."""
    reads: set[str] = set()
    scanned: set[str] = set()  # keys the latest iteration yielded and nobody has read since
    getitem, iterate = os._Environ.__getitem__, os._Environ.__iter__

    def recorded(self, key):
        if isinstance(key, str):  # os.environb shares the class
            if key in scanned:
                scanned.discard(key)
            else:
                reads.add(key)
        return getitem(self, key)

    def iterated(self):
        scanned.clear()
        for key in iterate(self):
            if isinstance(key, str):
                scanned.add(key)
            yield key

    os._Environ.__getitem__, os._Environ.__iter__ = recorded, iterated
    try:
        yield reads
    finally:
        os._Environ.__getitem__, os._Environ.__iter__ = getitem, iterate


def _reap(proto_out: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(proto_out, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _send(fd: int, msg: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(msg) + "\n").encode())


def _child(req: dict[str, Any], added: dict[str, str]) -> int:
    """In the forked child: become `python -m MODULE ARGS` and return its exit code (main() exits with
    it, so atexit handlers run as in a fresh process)."""
    import runpy
    import traceback

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update({**added, **req["env"]})
    sys.argv = [req["module"], *req["args"]]
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - a process reports its crash in its log, then exits 1
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


# ----- the client (StandinRuntime) ----------------------------------------------------------------

class Refused(Exception):
    """The server will not fork this child (its environment differs on what the imports read): start it
    as a plain process; the server serves the others."""


class ZygoteChild:
    """What the runtime needs of a subprocess.Popen: pid, returncode, poll(), wait(timeout)."""

    def __init__(self, pid: int, server: Zygote):
        self.pid, self.returncode, self._server = pid, None, server
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        if self.returncode is None and not self._server.alive():
            # The server is gone, and with it the exit codes of its children: ask the kernel.
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._exited(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.2):
            if self.poll() is not None:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.returncode  # type: ignore[return-value]


class Zygote:
    """Starts the server (in the background: it imports for a while) and spawns through it once ready;
    `spawn` returns None while it is not, and the runtime starts a plain process instead."""

    def __init__(self, python: str, env: dict[str, str], cwd: str, log_path: str | os.PathLike):
        self._lock = threading.Lock()
        self._children: dict[int, ZygoteChild] = {}
        self._replies: dict[int, dict[str, Any]] = {}
        self._cv = threading.Condition(self._lock)
        self._next_id = 0
        self.ready = False
        self.failure: str | None = None
        self.startup_seconds: float | None = None
        self.reads_at_import: list[str] = []  # the environment variables the server's imports read
        with open(log_path, "ab") as log:
            self._proc = subprocess.Popen([python, "-m", "tests.standin.zygote"], cwd=cwd, env=env,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                          start_new_session=True)
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cv:
                if msg.get("ready") == READY:
                    self.ready, self.startup_seconds = True, msg.get("seconds")
                    self.reads_at_import = msg.get("reads", [])
                elif "exit" in msg:
                    child = self._children.pop(msg["exit"], None)
                    if child is not None:
                        child._exited(msg["code"])
                else:
                    if "pid" in msg:  # registered here: its exit may be the very next line
                        msg["child"] = self._children[msg["pid"]] = ZygoteChild(msg["pid"], self)
                    self._replies[msg["id"]] = msg
                self._cv.notify_all()
        with self._cv:
            self.ready = False
            self.failure = f"the fork server exited (code {self._proc.wait()})"
            self._cv.notify_all()

    def spawn(self, module: str, args: list[str], env: dict[str, str], cwd: str,
              log: str | os.PathLike, timeout: float = 30.0) -> ZygoteChild | None:
        with self._cv:
            if not self.ready:
                return None
            self._next_id += 1
            rid = self._next_id
            req = {"id": rid, "module": module, "args": list(args), "env": env, "cwd": cwd, "log": str(log)}
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(req) + "\n").encode())
            self._proc.stdin.flush()
            if not self._cv.wait_for(lambda: rid in self._replies or not self.ready, timeout):
                raise RuntimeError(f"the fork server did not answer within {timeout:.0f}s")
            reply = self._replies.pop(rid, None)
            if reply is None:
                raise RuntimeError(self.failure or "the fork server went away")
            if "error" in reply:
                raise OSError(reply["error"])
            if "refused" in reply:
                raise Refused(reply["refused"])
            return reply["child"]

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self._proc.stdin:
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)


_SHARED: dict[tuple[str, str, tuple[tuple[str, str], ...]], Zygote] = {}
_SHARED_LOCK = threading.Lock()


def shared(python: str, env: dict[str, str], cwd: str, log_path: str | os.PathLike) -> Zygote:
    """The fork server every runtime of this process uses (one per interpreter and working directory; a
    new one if the last exited), closed at exit. The cluster tier starts a runtime per test module: each
    with its own server would import for 10-35 s again while its first OmniStage's processes start
    plain, on the same two cores. The environment is not part of the key: it changes under pytest
    (PYTEST_CURRENT_TEST names the running test), and what of it the imports read is checked for each
    child anyway (a child that differs there is refused and starts plain)."""
    key = (python, cwd)
    with _SHARED_LOCK:
        server = _SHARED.get(key)
        if server is None or not server.alive():
            if not _SHARED:
                atexit.register(_close_shared)
            server = _SHARED[key] = Zygote(python, env, cwd, log_path)
        return server


def _close_shared() -> None:
    with _SHARED_LOCK:
        servers = list(_SHARED.values())
        _SHARED.clear()
    for server in servers:
        server.close()


if __name__ == "__main__":
    sys.exit(serve())
