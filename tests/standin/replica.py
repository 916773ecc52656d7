"""A simulated headless stage replica: registers and heartbeats through vllm-omni's own client code.

  python -m tests.standin.replica --master-ip 127.77.0.5 --master-port 26000 --bind-ip 127.77.0.9 \\
      [--stage-id K ...]

What ``vllm serve ... --headless --stage-id 0`` does, minus the model (see the package
docstring): ``register_stage_with_omni_master(replica_id=None)`` (auto-assign; the head allocates
the id and the sockets), then what the replica's EngineCore does after its handshake:
``create_stage_coord_client`` (UP, then a heartbeat every 5 s). SIGTERM/SIGINT sends DOWN (the
client's ``close``) and exits 0. The process listens on nothing.

``--stage-id`` is repeatable: a pool pod (issue 12) runs one headless ``vllm serve --stage-id K``
per stage it hosts; its stand-in is this one process (vLLM's import cost once, not per stage),
which registers one replica per stage id (stage >= 1 with a stage config, as
``launch_headless_llm_replica`` sends it), each with its own UP, heartbeats and, on SIGTERM, DOWN.
When one registration fails the process exits 1 (after DOWN for the stages already UP), as the
pod's supervisor does when one of its stage processes exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Any

from . import require_loopback

logger = logging.getLogger("tests.standin.replica")


class SimulatedReplica:
    """One stage replica as the head sees it on the wire (in-process form, for tests)."""

    def __init__(self, master_ip: str, master_port: int, bind_ip: str, stage_id: int = 0) -> None:
        self.master_ip = require_loopback(master_ip, "master address")
        self.master_port = int(master_port)
        self.bind_ip = require_loopback(bind_ip, "bind address")
        self.stage_id = stage_id
        self.response: Any = None
        self.coord: Any = None

    @property
    def replica_id(self) -> int | None:
        return None if self.response is None else self.response.replica_id

    def register(self) -> SimulatedReplica:
        from vllm_omni.engine.stage_engine_startup import register_stage_with_omni_master

        # replica_id=None: auto-assign, as launch_headless_llm_replica does. The bind address is
        # explicit, so vllm-omni's UDP route probe (_detect_local_bind_address) never runs.
        self.response = register_stage_with_omni_master(
            omni_master_address=self.master_ip,
            omni_master_port=self.master_port,
            omni_stage_id=self.stage_id,
            omni_stage_config=None,
            replica_id=None,
            replica_bind_address=self.bind_ip,
        )
        return self

    def up(self, queue_length_getter=None) -> SimulatedReplica:
        from vllm_omni.distributed.omni_coordinator import create_stage_coord_client

        resp = self.response
        self.coord = create_stage_coord_client(
            coord_zmq_addr=resp.coordinator_router_address,
            input_addr=resp.input_address,
            output_addr=resp.output_address,
            stage_id=self.stage_id,
            queue_length_getter=queue_length_getter or (lambda: 0),
        )
        return self

    def start(self) -> SimulatedReplica:
        return self.register().up()

    def down(self) -> None:
        """Graceful exit: the client's close() sends DOWN (what SIGTERM leads to in a replica)."""
        if self.coord is not None:
            try:
                self.coord.close()
            except RuntimeError:
                pass
            self.coord = None

    def kill(self) -> None:
        """Hard kill: heartbeats stop, no DOWN is sent (the coordinator times the replica out)."""
        coord, self.coord = self.coord, None
        if coord is not None:
            coord._stop_event.set()
            coord._heartbeat_thread.join(timeout=2)
            with coord._send_lock:
                coord._closed = True
                coord._socket.close(0)
                coord._ctx.term()


LOAD_KNOB = "OMNISTAGE_STANDIN_LOAD_SECONDS"


class _Stop(BaseException):
    """SIGTERM/SIGINT while a registration waits for the head's reply (up to 300 s)."""


def replica_for(stage_id: int, master_ip: str, master_port: int, bind_ip: str) -> SimulatedReplica:
    """The replica a headless ``--stage-id K`` process registers: for K >= 1 with a stage config
    (``multistage.StageReplica``, as ``launch_headless_llm_replica`` sends it), for stage 0 as today."""
    if stage_id == 0:
        return SimulatedReplica(master_ip, master_port, bind_ip, 0)
    from .multistage import StageReplica  # imports this module: not at the top

    return StageReplica(master_ip, master_port, bind_ip, stage_id)


def _load_engine_plugin() -> None:
    """vLLM's own plugin loader, as a real headless replica runs it before registering: the engine
    plugin's patches apply here too, and registration_report sends their outcomes with the
    registration, which the head lists per member (what the operator shows for stage pods)."""
    listed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*listed, "vllm_omni_register_models",
                                                         "omnistage_engine_patches"]))
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    from omnistage_engine_patches import _patching

    for outcome in _patching.outcomes().values():
        logger.info("patch %s: %s", outcome.name, outcome.reason)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.standin.replica", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--master-ip", required=True, help="the head's --omni-master-address (loopback)")
    ap.add_argument("--master-port", required=True, type=int)
    ap.add_argument("--bind-ip", required=True, help="this replica's pod IP (loopback)")
    ap.add_argument("--stage-id", type=int, action="append", dest="stage_ids", metavar="K",
                    help="a stage this process registers a replica of; repeatable (a pool pod's stages); "
                         "default: 0")
    args = ap.parse_args(argv)
    stage_ids = args.stage_ids or [0]
    if len(set(stage_ids)) != len(stage_ids) or min(stage_ids) < 0:
        ap.error(f"--stage-id values must be distinct and >= 0: {stage_ids}")
    require_loopback(args.master_ip, "master address")
    require_loopback(args.bind_ip, "bind address")
    os.environ["VLLM_HOST_IP"] = args.bind_ip  # never a UDP route probe
    logging.basicConfig(level=logging.INFO, format="%(asctime)s replica %(levelname)s %(message)s")
    _load_engine_plugin()

    stop = threading.Event()
    registering = threading.Event()  # a signal now interrupts the wait for the head's reply

    def on_signal(*_: Any) -> None:
        stop.set()
        if registering.is_set():
            raise _Stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # A model load: a real replica registers minutes after its container started (the pod env knob
    # LOAD_KNOB; tests use it to see that a loading replica is neither Ready nor counted).
    if stop.wait(float(os.environ.get(LOAD_KNOB) or 0)):
        return 0

    # One replica per stage, registered and UP in turn, as the pod's per-stage processes would be.
    # A signal between two of them ends the loop; the ones already UP send DOWN below.
    up: list[SimulatedReplica] = []
    code = 0
    for stage_id in stage_ids:
        if stop.is_set():
            break
        replica = replica_for(stage_id, args.master_ip, args.master_port, args.bind_ip)
        logger.info("registering with %s:%d as a stage-%d replica from %s", args.master_ip, args.master_port,
                    stage_id, args.bind_ip)
        try:
            registering.set()
            try:
                if stop.is_set():  # the signal came before the flag was up
                    raise _Stop()
                replica.register()
            finally:
                registering.clear()
        except _Stop:
            break  # still waiting for the head's reply: nothing to send DOWN for this stage
        except Exception:  # one stage failing fails the pod, as its process would
            logger.exception("stage %d: registration failed", stage_id)
            code = 1
            break
        replica.up()
        up.append(replica)
        # The log line a real headless replica prints; the operator's tooling greps neither.
        logger.info("[Headless] Stage %d replica id=%d up (coord=%s)", stage_id, replica.replica_id,
                    replica.response.coordinator_router_address)
    if code == 0:
        stop.wait()
    for replica in up:
        replica.down()
        logger.info("stage %d replica %d sent DOWN", replica.stage_id, replica.replica_id)
    logger.info("exiting with %d", code)
    return code


if __name__ == "__main__":
    sys.exit(main())
