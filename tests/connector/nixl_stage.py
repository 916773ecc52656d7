"""One stage's data path, in its own process (run by test_nixl_chain.py, not collected).

    python -m tests.connector.nixl_stage --stage K --replica-id R --base PORT \
        --pod RUN=127.0.x.y [--pod RUN2=127.0.z.y ...]

The process stands for the stage worker of one pod, once per `--pod` (one per run of the test,
each on its own loopback address, so one process serves the chain with and without per-pod ports
and the tier pays for three vLLM imports, not six). It loads vLLM's general plugins (this
project's patches), then for each run: sets or clears `OMNISTAGE_CONNECTOR_PORTS` (`per-pod` when
RUN is `per-pod`; the patch reads it on every port computation, as in an engine pod), parses the
deploy config of a NIXL chain 0 -> 1 -> 2 with vllm-omni's `load_omni_transfer_config`, picks this
stage's connector with `get_stage_connector_spec` (what `vllm serve --stage-id K` does) and builds
it with the worker's own `_create_connector` (which resolves it with `resolve_connector_spec`, the
replica id from `VLLM_OMNI_REPLICA_ID`, and calls the connector factory). `host` is the run's
loopback address: never `auto`, which probes a public address.

Protocol: every result is one line `RESULT {json}` on stdout; the parent sends JSON lines on stdin,
each naming its run (`pod`).
  ready      per run, after the connector exists: role, bound endpoint, and the endpoint the head
             would advertise for this replica in payload_sender_info (`_build_payload_sender_info`)
  stage 0    on {"op": "put"}: puts PAYLOAD under the request's key
  stage 1/2  on {"op": "get", "source": {host, zmq_port}} (the upstream replica's advertised
             endpoint, which the head puts into the request): gets the upstream key the way a
             stage worker does (`source_host`/`source_port` metadata), retrying until a deadline;
             stage 1 then puts `relay(payload)` onward
  {"op": "exit"}: `os._exit(0)` (NIXL's UCX teardown can segfault at interpreter exit)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

REQUEST_ID = "req-0"
GET_DEADLINE_S = 30.0


def key(from_stage: int) -> str:
    """The connector key a stage worker uses for a request's full payload (chunk 0)."""
    return f"{REQUEST_ID}_{from_stage}_0"


def deploy_config(host: str, base: int) -> dict[str, Any]:
    """NIXL on both edges of thinker -> talker -> code2wav, with this pod's own host."""
    nixl = {"name": "NixlConnector", "extra": {"backends": ["UCX"], "host": host, "zmq_port": base}}
    return {
        "connectors": {"nixl": nixl},
        "stages": [
            {"stage_id": 0, "output_connectors": {"to_stage_1": "nixl"}},
            {"stage_id": 1, "input_connectors": {"from_stage_0": "nixl"},
             "output_connectors": {"to_stage_2": "nixl"}},
            {"stage_id": 2, "input_connectors": {"from_stage_1": "nixl"}},
        ],
    }


def payload() -> dict[str, Any]:
    import torch

    return {"hidden": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "meta": {"request_id": REQUEST_ID, "token_ids": [11, 12, 13], "stage": "thinker"}}


def relay(data: dict[str, Any]) -> dict[str, Any]:
    """What the talker sends on: a tensor derived from the one it received, and the dict extended."""
    import torch

    return {"codes": (data["hidden"] * 2 + 1).to(torch.int64),
            "meta": {**data["meta"], "stage": "talker", "from_thinker": data["meta"]["stage"]}}


def describe(data: Any) -> Any:
    """A JSON-able picture of a payload: tensors as dtype, shape and values."""
    import torch

    if isinstance(data, torch.Tensor):
        return {"dtype": str(data.dtype), "shape": list(data.shape), "values": data.flatten().tolist()}
    if isinstance(data, dict):
        return {k: describe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [describe(v) for v in data]
    return data


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write("RESULT " + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def head_advertises(stage: int, replica_id: int, stage_connector_config: dict[str, Any]) -> Any:
    """The endpoint the head puts into payload_sender_info for this replica: vllm-omni's own
    `StageEngineCoreClient._build_payload_sender_info` and `_resolve_sender_host_from_config`, on
    an object carrying only the attributes they read (no EngineCore behind it)."""
    from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient

    client = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(stage_connector_config=stage_connector_config)),
        stage_id=stage, replica_id=replica_id, _kv_sender_info=None, _get_kv_connector_config=lambda: None)
    client._resolve_sender_host_from_config = functools.partial(
        StageEngineCoreClient._resolve_sender_host_from_config, client)
    return StageEngineCoreClient._build_payload_sender_info(client)


def get_until(connector: Any, from_stage: int, to_stage: int, source: dict[str, Any]) -> tuple[Any, int, int]:
    """Poll like a stage worker: one bounded query per call, retried until the payload arrives."""
    metadata = {"source_host": source["host"], "source_port": source["zmq_port"]}
    deadline = time.monotonic() + GET_DEADLINE_S
    attempts = 0
    while time.monotonic() < deadline:
        attempts += 1
        result = connector.get(str(from_stage), str(to_stage), key(from_stage), dict(metadata))
        if result is not None:
            data, size = result
            return data, size, attempts
        time.sleep(0.05)
    raise TimeoutError(f"stage {to_stage}: nothing under {key(from_stage)} at {source} in {GET_DEADLINE_S}s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--replica-id", type=int, required=True)
    parser.add_argument("--base", type=int, required=True)
    parser.add_argument("--pod", action="append", required=True, help="RUN=HOST, one per run")
    args = parser.parse_args()
    # The master-assigned replica id, as a headless replica's worker sees it.
    os.environ["VLLM_OMNI_REPLICA_ID"] = str(args.replica_id)

    import vllm.plugins
    from omnistage_engine_patches import _patching, contract
    from vllm_omni.distributed.omni_connectors.model_runner.omni_connector_runtime import (
        _OmniConnectorRuntimeMixin,
    )
    from vllm_omni.distributed.omni_connectors.utils.initialization import load_omni_transfer_config
    from vllm_omni.engine.stage_init_utils import get_stage_connector_spec

    vllm.plugins.load_general_plugins()  # VLLM_PLUGINS names this project's plugin
    patch = _patching.outcomes().get(contract.CONNECTOR_PORTS)

    connectors = {}
    for pod in args.pod:
        run, host = pod.split("=", 1)
        os.environ.pop(contract.CONNECTOR_PORTS_ENV, None)
        if run == contract.PORTS_PER_POD:
            os.environ[contract.CONNECTOR_PORTS_ENV] = contract.PORTS_PER_POD
        transfer = load_omni_transfer_config(config_dict=deploy_config(host, args.base))
        spec = get_stage_connector_spec(transfer, args.stage, async_chunk=False)
        connector = connectors[run] = _OmniConnectorRuntimeMixin._create_connector(
            SimpleNamespace(stage_connector_config=spec, stage_id=args.stage))
        emit("ready", pod=run, stage=args.stage, replica_id=args.replica_id, pid=os.getpid(),
             connector=type(connector).__name__, role=spec["extra"].get("role"),
             connector_ports=os.environ.get(contract.CONNECTOR_PORTS_ENV),
             patch=getattr(patch, "outcome", None),
             bound={"host": connector.host, "zmq_port": connector._zmq_port},
             upstream={"host": connector._sender_host, "zmq_port": connector._sender_zmq_port},
             advertised=head_advertises(args.stage, args.replica_id, spec))

    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        run, connector = command["pod"], connectors[command["pod"]]
        try:
            if command["op"] == "put":
                data = payload()
                ok, size, _ = connector.put(str(args.stage), str(args.stage + 1), key(args.stage), data)
                emit("put", pod=run, stage=args.stage, key=key(args.stage), ok=ok, size=size,
                     payload=describe(data))
            elif command["op"] == "get":
                data, size, attempts = get_until(connector, args.stage - 1, args.stage, command["source"])
                emit("got", pod=run, stage=args.stage, key=key(args.stage - 1), size=size, attempts=attempts,
                     source=command["source"], payload=describe(data))
                if args.stage == 1:
                    sent = relay(data)
                    ok, size, _ = connector.put(str(args.stage), str(args.stage + 1), key(args.stage), sent)
                    emit("put", pod=run, stage=args.stage, key=key(args.stage), ok=ok, size=size,
                         payload=describe(sent))
        except Exception as e:  # noqa: BLE001  (reported as a line: the parent judges output)
            emit("error", pod=run, stage=args.stage, op=command["op"], error=f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
