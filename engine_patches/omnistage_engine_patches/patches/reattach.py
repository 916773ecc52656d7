"""Patch ``reattach``: a headless stage-0 replica outlives its head and re-attaches to a new head
process without loading its model again (issue 39; the procedure: reattach_engine.py).

Three sides, one install:

* **launcher** (the headless ``vllm serve --headless`` process): ``register_stage_with_omni_master``
  is wrapped so a stage-0 registration that asks for an id carries an *instance* (a uuid) in its
  stage config, and leaves the master's address, the stage, the assigned replica id and the
  instance in ``os.environ`` for the engine-core child it spawns next;
* **engine core** (``StageEngineCoreProc``, a stage-0 LLM engine without a KV connector):
  ``process_input_sockets`` starts the watchdog (vLLM loads the plugin inside ``EngineCore.__init__``,
  so a wrapper of ``__init__`` would come too late) and, with vLLM's ``make_zmq_socket``, is wrapped
  so the input thread's ZMQ context is known and can be shut down (its sockets get linger 0:
  nothing is owed to a dead head); ``_handle_client_request`` runs the re-attach sentinel on the
  busy loop; ``create_stage_coord_client`` is wrapped to keep the heartbeat client it makes, and
  ``shutdown`` closes the current one (so the head a replica re-attached to hears its DOWN);
* **head**: ``OmniMasterServer._handle_registration`` answers a ping (``contract.REATTACH_PING_KEY``)
  with its boot id, whether it holds the registration with that instance, and whether its
  orchestrator runs; every other message goes to the original as it came.

The wrapped vLLM functions are relied on line by line (the input thread's context, the
handshake's order), so install compares a digest of their source (blank lines and trailing
whitespace left out) with the one read for vLLM 0.30.0 and 0.32.0 (``DIGESTS``): another vLLM
leaves the patch ``skipped`` and the operator rolls replicas on a head restart, as before. Pool
stages (a KV connector), diffusion stages and DP > 1 are not re-attached: their watchdog never
starts. Off (``OMNISTAGE_DISABLE_PATCHES=reattach``, the negative control), a replica never notices
its head is gone and the operator rolls it.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import threading
import uuid
from typing import Any

import msgspec
import zmq

from .. import contract, reattach_engine
from .._patching import BOOT_ID, Target, ours, shape_problem, wrap
from . import membership

NAME = contract.REATTACH
logger = logging.getLogger("omnistage_engine_patches.reattach")

#: sha256 (first 16 hex) of the `normalized` inspect.getsource of each vLLM function the re-attach
#: relies on, as vLLM 0.30.0 and 0.32.0 have them (the same code; docs/engine-versions.md): the input
#: thread's context is the one make_zmq_socket gets and it polls without end; ENGINE_CORE_DEAD ends the
#: output thread; the handshake is HELLO, then the addresses; __init__ starts the I/O threads with these
#: arguments and sends READY after the input thread's ready payload.
DIGESTS = {
    "process_input_sockets": "d1e8081eeb7f19e0",
    "process_output_sockets": "684926c43825282f",
    "startup_handshake": "00774377caada962",
    "__init__": "413076ac61b41edb",
}
_local = threading.local()  # .input_thread: this thread runs process_input_sockets (its sockets: linger 0)
_attachment: reattach_engine.Attachment | None = None
_stop = threading.Event()


def normalized(source: str) -> str:
    """Source without what cannot change what it does and moves between releases: blank lines and
    trailing whitespace (vLLM 0.32 only dropped the blank line after two docstrings). Comments and
    code count."""
    return "\n".join(line.rstrip() for line in source.splitlines() if line.strip())


def digest(fn: Any) -> str:
    return hashlib.sha256(normalized(inspect.getsource(inspect.unwrap(fn))).encode()).hexdigest()[:16]


def install() -> str | None:
    from vllm.v1.engine import core
    from vllm_omni.engine import stage_engine_core_proc as proc
    from vllm_omni.engine import stage_engine_startup as startup

    targets = (Target(core.EngineCoreProc, "process_input_sockets"),
               Target(core.EngineCoreProc, "_handle_client_request"), Target(core, "make_zmq_socket"),
               Target(core.EngineCoreProc, "__init__"),
               Target(core.EngineCoreProc, "shutdown"), Target(proc, "create_stage_coord_client"),
               Target(startup, "register_stage_with_omni_master"),
               Target(startup.OmniMasterServer, "_handle_registration", ("self", "reg_socket")))
    if (problem := shape_problem(*targets)) is not None:
        return problem
    if ours(NAME, *targets):
        return None
    for attr, want in DIGESTS.items():
        if (got := digest(getattr(core.EngineCoreProc, attr))) != want:
            return (f"vLLM's EngineCoreProc.{attr} is not 0.30.0's nor 0.32.0's "
                    f"(source digest {got}, want {want})")
    _install_launcher(startup)
    _install_engine_core(core, proc)
    _install_head(startup)
    return None


# ---- launcher -------------------------------------------------------------------------------------

def _install_launcher(startup: Any) -> None:
    @wrap(startup, "register_stage_with_omni_master", NAME)
    def register_stage_with_omni_master(original: Any, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("omni_stage_config")
        fresh = (not args and kwargs.get("replica_id", 0) is None and kwargs.get("omni_stage_id") == 0
                 and not (isinstance(config, dict) and contract.REATTACH_INSTANCE_KEY in config))
        if not fresh:  # not a headless stage-0 launcher's, or a re-attach's (its instance is set)
            return original(*args, **kwargs)
        if config is not None and not isinstance(config, dict):
            config = getattr(startup, "_serialize_stage_config", lambda c: c)(config)
        instance = uuid.uuid4().hex
        if isinstance(config, dict):
            kwargs["omni_stage_config"] = {**config, contract.REATTACH_INSTANCE_KEY: instance}
        response = original(*args, **kwargs)
        os.environ.update({
            reattach_engine.ENV_MASTER: f"{kwargs['omni_master_address']}:{kwargs['omni_master_port']}",
            reattach_engine.ENV_STAGE: "0", reattach_engine.ENV_REPLICA: str(response.replica_id),
            reattach_engine.ENV_INSTANCE: instance,
            reattach_engine.ENV_BIND: kwargs.get("replica_bind_address") or "",
        })
        return response


# ---- engine core ----------------------------------------------------------------------------------

def _install_engine_core(core: Any, proc: Any) -> None:
    @wrap(core.EngineCoreProc, "process_input_sockets", NAME)
    def process_input_sockets(original: Any, self: Any, *args: Any, **kwargs: Any) -> None:
        if _attachment is None:
            _start_watchdog(self)
        _local.input_thread = True
        try:
            original(self, *args, **kwargs)
        except zmq.ZMQError as err:
            att = _attachment
            if err.errno == zmq.ETERM and att is not None and getattr(_local, "ctx_id", None) in att.stopping:
                return  # shut down on purpose: the old head's input thread ends here
            raise

    @wrap(core, "make_zmq_socket", NAME)
    def make_zmq_socket(original: Any, ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "input_thread", False) and _attachment is not None:
            kwargs["linger"] = 0  # a dead head is owed nothing; a linger would hang the context's term
            _local.ctx_id = id(ctx)
            _attachment.input_ctx, _attachment.input_thread = ctx, threading.current_thread()
        return original(ctx, *args, **kwargs)

    @wrap(core.EngineCoreProc, "_handle_client_request", NAME)
    def _handle_client_request(original: Any, self: Any, request_type: Any, request: Any) -> None:
        if request is reattach_engine.SENTINEL:
            if _attachment is not None:
                reattach_engine.reattach(self, _attachment)
            return None
        return original(self, request_type, request)

    @wrap(proc, "create_stage_coord_client", NAME)
    def create_stage_coord_client(original: Any, *args: Any, **kwargs: Any) -> Any:
        client = original(*args, **kwargs)
        if _attachment is not None:
            _attachment.coord_client = client
        return client

    @wrap(core.EngineCoreProc, "shutdown", NAME)
    def shutdown(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        _stop.set()
        if _attachment is not None and _attachment.reattaches:
            reattach_engine._close_coord_client(_attachment)  # run_stage_core closes only its first one
        return original(self, *args, **kwargs)


def _start_watchdog(engine: Any) -> None:
    """At the engine core's first input thread: vLLM loads the plugin inside EngineCore.__init__
    (general plugins), so this is the first wrapper a running engine core reaches. Only a headless
    stage-0 LLM replica has an attachment (the launcher's registration left it in the environment);
    a KV connector (a multi-stage stage 0) or DP > 1 is not re-attached."""
    global _attachment
    config = getattr(engine, "vllm_config", None)
    att = reattach_engine.from_environment()
    if att is None or config is None or getattr(config, "kv_transfer_config", None) is not None \
            or config.parallel_config.data_parallel_size > 1:
        return
    _attachment = att
    threading.Thread(target=reattach_engine.watch, args=(engine, att, _stop), name="omnistage-reattach",
                     daemon=True).start()
    logger.warning("stage %d replica %d: re-attach watchdog pinging its head at %s:%d",
                   att.stage, att.replica, *att.master)


# ---- head -----------------------------------------------------------------------------------------

class _Replay:
    """The registration socket with the frames already read given back to the original."""

    def __init__(self, sock: Any, frames: list[bytes]) -> None:
        self._sock, self._frames = sock, frames

    def recv_multipart(self, *args: Any, **kwargs: Any) -> list[bytes]:
        return self._frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def ping_of(frames: list[bytes]) -> dict[str, Any] | None:
    """The ping a message is, or None (a registration, or anything else: the original's)."""
    if len(frames) != 2 or len(frames[-1]) > 512:
        return None
    try:
        msg = msgspec.msgpack.decode(frames[-1])
    except msgspec.DecodeError:
        return None
    body = msg.get(contract.REATTACH_PING_KEY) if isinstance(msg, dict) else None
    if not isinstance(body, dict) or not all(isinstance(body.get(k), t) for k, t in
                                             (("stage", int), ("replica", int), ("instance", str))):
        return None
    return body


def answer(server: Any, body: dict[str, Any]) -> dict[str, Any]:
    config = getattr(server, "_stage_configs", {}).get((body["stage"], body["replica"]))
    known = isinstance(config, dict) and config.get(contract.REATTACH_INSTANCE_KEY) == body["instance"]
    return {"bootId": BOOT_ID,
            "state": contract.REATTACH_REGISTERED if known else contract.REATTACH_UNKNOWN,
            # A registration before the orchestrator runs waits behind the head's own engine load; a
            # replica that waits for "ready" never runs into its handshake timeout.
            "ready": bool(membership.running_orchestrators())}


def _install_head(startup: Any) -> None:
    @wrap(startup.OmniMasterServer, "_handle_registration", NAME)
    def _handle_registration(original: Any, self: Any, reg_socket: Any) -> Any:
        frames = reg_socket.recv_multipart()
        body = ping_of(frames)
        if body is None:
            return original(self, _Replay(reg_socket, frames))
        reg_socket.send_multipart([frames[0], msgspec.msgpack.encode(answer(self, body))])
        return None
