"""A headless stage-0 replica re-attaches to a new head process without loading its model again.

The replica side of patch ``reattach`` (patches/reattach.py installs it). When the head dies, a
headless replica of vllm-omni 0.30.0 does not notice: its input thread blocks in ``poller.poll()``
for ever, its outputs queue towards the dead peer, its weights stay loaded
(``shared/reference/review-2026-12-06/head-failure.md`` §2). Only the engine core's I/O threads,
its coordinator heartbeat client and the scheduler's requests belong to the head; the executor
(weights, KV cache) does not. So, in the engine-core process:

1. a watchdog thread pings the master it registered with, once a second (``ping``). The head
   answers from its registration thread (patches/reattach.py, head side): its boot id, whether the
   registration with this replica's *instance* (a uuid sent with each registration) is one it
   holds, and whether its orchestrator runs. Only "a new head process (another boot id) that does
   not know this instance and is ready" starts a re-attach; silence (the head restarting, a blip)
   changes nothing;
2. the re-attach runs on the engine's busy-loop thread (a sentinel on its input queue: only that
   thread may touch the scheduler): the old input thread is stopped for good (its ZMQ context
   shut down, so it can never redial a port the new head gave to another replica), the queued
   inputs dropped and every request the old head sent aborted (its HTTP callers were the dead
   head's: nothing could deliver their answers);
3. once the engine is idle, the old output thread is ended (vLLM's own ENGINE_CORE_DEAD), the old
   coordinator client closed, the receiver-side multimodal cache cleared (a new head's frontend
   starts empty), and the replica registers again, handshakes (HELLO, addresses, READY) and starts
   new I/O threads and a new heartbeat client, exactly as at its first start but without the
   executor. To the new head it is a new headless replica, which the membership patch holds
   unroutable until the operator joins it.

A re-attach that fails is retried on the next ping; after ``MAX_FAILURES`` in a row the process
exits, so the pod fails and the operator replaces it (the behaviour without this patch).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from . import contract

logger = logging.getLogger("omnistage_engine_patches.reattach")

#: What the launcher's registration leaves in the environment for the engine-core child it spawns
#: (multiprocessing's spawn copies os.environ): where the master is and who this replica is there.
ENV_MASTER, ENV_STAGE = "OMNISTAGE_REATTACH_MASTER", "OMNISTAGE_REATTACH_STAGE"
ENV_REPLICA = "OMNISTAGE_REATTACH_REPLICA"
ENV_BIND, ENV_INSTANCE = "OMNISTAGE_REATTACH_BIND", "OMNISTAGE_REATTACH_INSTANCE"
#: The pod's own variable (the operator renders it): the master Service's DNS name, where a replica
#: looks for its head once the address it registered with stopped answering (the head pod replaced).
ENV_SERVICE = contract.MASTER_SERVICE_ENV
MAX_CANDIDATES = 4  # addresses pinged per look (the Service lists one serving head; a surge, two)
PING_PERIOD_S = 1.0
PING_TIMEOUT_MS = 1000
MAX_FAILURES = 10
IO_JOIN_S = 6.0  # bound on an old I/O thread's stop (its own loop ends within milliseconds)
#: The sentinel's request object: the busy loop's dispatch (patches/reattach.py) runs `reattach` for it.
SENTINEL = object()


@dataclass
class Attachment:
    """This engine core's link to its head: everything a re-attach replaces."""

    master: tuple[str, int]
    stage: int
    replica: int
    instance: str
    bind: str | None
    service: str | None = None         # ENV_SERVICE: where to look when the head pod was replaced
    head_boot: str | None = None        # the boot id of the head that knows `instance`
    coord_client: Any = None            # the OmniCoordClientForStage heartbeating to that head
    input_ctx: Any = None               # the current input thread's ZMQ context (its stop handle)
    input_thread: threading.Thread | None = None
    stopping: set[int] = field(default_factory=set)  # ids of input contexts shut down on purpose
    pending: bool = False
    failures: int = 0
    reattaches: int = 0


def from_environment() -> Attachment | None:
    """The attachment the launcher's registration described, or None (not a headless stage-0 replica)."""
    master, instance = os.environ.get(ENV_MASTER, ""), os.environ.get(ENV_INSTANCE, "")
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not instance:
        return None
    try:
        stage, replica = int(os.environ.get(ENV_STAGE, "")), int(os.environ.get(ENV_REPLICA, ""))
    except ValueError:
        return None
    return Attachment((host, int(port)), stage, replica, instance, os.environ.get(ENV_BIND) or None,
                      os.environ.get(ENV_SERVICE) or None)


# ---- the ping (watchdog thread) -----------------------------------------------------------------

def ping(ctx: zmq.Context, att: Attachment) -> dict[str, Any] | None:
    """The master's answer about this replica's registration, or None (no answer within a second)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{att.master[0]}:{att.master[1]}")
        sock.send(msgspec.msgpack.encode(
            {contract.REATTACH_PING_KEY: {"stage": att.stage, "replica": att.replica,
                                          "instance": att.instance}}))
        if not sock.poll(PING_TIMEOUT_MS):
            return None
        answer = msgspec.msgpack.decode(sock.recv())
    except (zmq.ZMQError, msgspec.DecodeError):
        return None
    finally:
        sock.close(0)
    return answer if isinstance(answer, dict) else None


def should_reattach(att: Attachment, answer: dict[str, Any] | None) -> bool:
    """Pure: whether this answer means "your head is gone, a new one is ready and does not know you"."""
    if answer is None:
        return False  # the head is restarting, or a blip: engine_liveness keeps a silent replica
    boot = answer.get("bootId")
    if answer.get("state") == contract.REATTACH_REGISTERED:
        att.head_boot = boot
        return False
    return (answer.get("state") == contract.REATTACH_UNKNOWN and bool(answer.get("ready"))
            and boot != att.head_boot)


def lost(answer: dict[str, Any] | None) -> bool:
    """Pure: no head at this replica's address serves it: silence (a dead or replaced pod), or a new
    process there that does not know it and is still loading its engine (a restart in place). Either
    way the master Service may list another head that is ready now (a spare that took over)."""
    return answer is None or (answer.get("state") == contract.REATTACH_UNKNOWN and not answer.get("ready"))


def moved_head(ctx: zmq.Context, att: Attachment) -> tuple[tuple[str, int], dict[str, Any]] | None:
    """Where the head went: the master Service's name (ENV_SERVICE, NAME-master.NAMESPACE.svc, a
    headless Service that lists the serving head pod whether Ready or not) resolved, and the first
    address whose head answers "ready, and this replica is unknown to me".

    Only when the Service no longer lists the address this replica is attached to: the operator
    moved the Services (a spare took over, or the head pod was replaced with a new IP). While it
    still lists it, the head there is the serving one (restarting in place, or slow): a blip never
    moves a replica, and neither does a head change's surge (both heads are listed)."""
    if not att.service:
        return None
    try:
        infos = socket.getaddrinfo(att.service, att.master[1], type=socket.SOCK_STREAM)
    except OSError:
        return None  # no name service, or the Service lists no head yet
    listed = {info[4][0] for info in infos}
    if att.master[0] in listed:
        return None
    for ip in sorted(listed)[:MAX_CANDIDATES]:
        candidate = dataclasses.replace(att, master=(ip, att.master[1]))
        answer = ping(ctx, candidate)
        if answer is not None and answer.get("state") == contract.REATTACH_UNKNOWN and answer.get("ready"):
            return candidate.master, answer
    return None


def watch(engine: Any, att: Attachment, stop: threading.Event) -> None:
    ctx = zmq.Context()
    try:
        while not stop.wait(PING_PERIOD_S):
            if att.pending:
                continue
            answer = ping(ctx, att)
            if lost(answer) and (moved := moved_head(ctx, att)):
                logger.warning("stage %d replica %d: no head serving at %s:%d, and the master Service %s "
                               "lists a ready head at %s:%d instead", att.stage, att.replica, *att.master,
                               att.service, *moved[0])
                att.master, answer = moved
            if should_reattach(att, answer):
                logger.warning("stage %d replica %d: the head at %s:%d is a new process (boot %s) that does "
                               "not know this replica: re-attaching without reloading the model",
                               att.stage, att.replica, *att.master, answer.get("bootId"))
                att.pending = True
                from vllm.v1.engine import EngineCoreRequestType
                engine.input_queue.put_nowait((EngineCoreRequestType.WAKEUP, SENTINEL))
    finally:
        ctx.term()


# ---- stopping the old head's I/O threads ----------------------------------------------------------

def _libzmq() -> Any:
    """The libzmq pyzmq loaded (pyzmq exposes no zmq_ctx_shutdown): found in this process's maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libzmq" in line and "/" in line:
                lib = ctypes.CDLL(line.split()[-1])
                lib.zmq_ctx_shutdown.argtypes = [ctypes.c_void_p]
                return lib
    raise RuntimeError("libzmq is not loaded in this process")


def stop_input_thread(att: Attachment) -> None:
    """End the input thread for good: zmq_ctx_shutdown makes its blocked poll raise ETERM (the
    patched thread function returns quietly for a context in `stopping`), its sockets close with
    linger 0, and nothing of it can reconnect to the old address."""
    ctx, thread = att.input_ctx, att.input_thread
    if ctx is None:
        return
    att.stopping.add(id(ctx))
    if not ctx.closed:
        _libzmq().zmq_ctx_shutdown(ctypes.c_void_p(ctx.underlying))
    if thread is not None:
        thread.join(IO_JOIN_S)
        if thread.is_alive():
            raise RuntimeError("the old input thread did not stop")
    att.input_ctx = att.input_thread = None


def _drain(q: queue.Queue) -> int:
    n = 0
    while True:
        try:
            q.get_nowait()
            n += 1
        except queue.Empty:
            return n


# ---- the re-attach (busy-loop thread) ---------------------------------------------------------------

def reattach(engine: Any, att: Attachment) -> None:
    """Step 2 of the module docstring, then step 3 once the engine is idle."""
    from vllm.v1.request import RequestStatus

    try:
        stop_input_thread(att)
        dropped = _drain(engine.input_queue)
        aborted = engine.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        logger.warning("stage %d replica %d: old head's requests aborted (%d), queued inputs dropped (%d)",
                       att.stage, att.replica, len(aborted or ()), dropped)
    except Exception:  # noqa: BLE001 -- retried on the next ping; never take the engine loop down
        _failed(att, "stopping the old head's input")
        return
    engine._idle_state_callbacks.append(lambda eng: _attach(eng, att))


def _attach(engine: Any, att: Attachment) -> None:
    started = time.monotonic()
    try:
        _end_output_thread(engine)
        _close_coord_client(att)
        engine.reset_mm_cache()
        response, instance = _register(att)
        addresses = _handshake(engine, att, response.handshake_address)
        engine.addresses = addresses
        att.replica, att.instance, att.head_boot = response.replica_id, instance, None
        att.coord_client = _coord_client(engine, att, response.coordinator_router_address, addresses)
        os.environ["VLLM_OMNI_REPLICA_ID"] = str(max(att.replica, 0))
        os.environ[ENV_REPLICA], os.environ[ENV_INSTANCE] = str(att.replica), instance
    except Exception:  # noqa: BLE001
        _failed(att, "registering with the new head")
        return
    att.pending, att.failures, att.reattaches = False, 0, att.reattaches + 1
    logger.warning("stage %d: re-attached as replica %d in %.2f s (re-attach #%d; no model reload)",
                   att.stage, att.replica, time.monotonic() - started, att.reattaches)


def _failed(att: Attachment, what: str) -> None:
    att.failures += 1
    logger.exception("re-attach failed while %s (%d of %d)", what, att.failures, MAX_FAILURES)
    att.pending = False  # the next ping tries again
    if att.failures >= MAX_FAILURES:
        logger.error("re-attach failed %d times: exiting so the pod is replaced", att.failures)
        os._exit(1)


def _end_output_thread(engine: Any) -> None:
    """vLLM's own end of the output thread (ENGINE_CORE_DEAD), waited for only until the thread has
    taken it: from then on it reads no output, and its context's term waits out the PUSH sockets'
    4 s linger towards the dead head's address (vLLM's setting) on that old thread, not here. The
    engine is idle, so the sentinel is the only item left."""
    thread = getattr(engine, "output_thread", None)
    _drain(engine.output_queue)
    if thread is None or not thread.is_alive():
        return
    engine.output_queue.put_nowait(type(engine).ENGINE_CORE_DEAD)
    deadline = time.monotonic() + IO_JOIN_S
    while not engine.output_queue.empty() and thread.is_alive():
        if time.monotonic() > deadline:
            raise RuntimeError("the old output thread did not take ENGINE_CORE_DEAD")
        time.sleep(0.005)


def _close_coord_client(att: Attachment) -> None:
    client, att.coord_client = att.coord_client, None
    if client is not None:
        try:
            client.close()
        except (RuntimeError, zmq.ZMQError):
            pass  # closed already, or its socket broke with the head


def _register(att: Attachment) -> tuple[Any, str]:
    from vllm_omni.engine import stage_engine_startup as startup

    instance = uuid.uuid4().hex
    response = startup.register_stage_with_omni_master(
        omni_master_address=att.master[0], omni_master_port=att.master[1], omni_stage_id=att.stage,
        omni_stage_config={contract.REATTACH_INSTANCE_KEY: instance,
                           contract.REATTACH_COUNT_KEY: att.reattaches + 1},
        replica_id=None, replica_bind_address=att.bind)
    return response, instance


def _handshake(engine: Any, att: Attachment, handshake_address: str) -> Any:
    """vLLM's own order (EngineCoreProc.__init__): HELLO and the addresses, the I/O threads (the
    input thread sends the ready payload), then READY on the handshake socket."""
    from vllm.utils.network_utils import make_zmq_socket

    identity = engine.engine_index.to_bytes(length=2, byteorder="little")
    ctx = zmq.Context()
    try:
        with make_zmq_socket(ctx, handshake_address, zmq.DEALER, identity=identity, linger=5000,
                             bind=False) as sock:
            addresses = engine.startup_handshake(sock, False, True, None)
            ready = threading.Event()
            att.input_thread = threading.Thread(
                target=engine.process_input_sockets,
                args=(addresses.inputs, addresses.coordinator_input, identity, ready), daemon=True)
            att.input_thread.start()
            engine.output_thread = threading.Thread(
                target=engine.process_output_sockets,
                args=(addresses.outputs, addresses.coordinator_output, engine.engine_index), daemon=True)
            engine.output_thread.start()
            if not ready.wait(30):
                raise RuntimeError("the new input thread did not start")
            sock.send(msgspec.msgpack.encode({"status": "READY", "local": False, "headless": True}))
    finally:
        ctx.term()
    return addresses


def _coord_client(engine: Any, att: Attachment, coordinator: str | None, addresses: Any) -> Any:
    if coordinator is None:
        return None
    from vllm_omni.engine import stage_engine_core_proc

    return stage_engine_core_proc.create_stage_coord_client(
        coord_zmq_addr=coordinator, input_addr=addresses.inputs[0], output_addr=addresses.outputs[0],
        stage_id=att.stage, queue_length_getter=engine.scheduler.get_num_unfinished_requests)
