"""Both NIXL connectors a sending stage builds, in one process (run by test_nixl_chunks.py, not
collected).

    python -m tests.connector.nixl_chunks_probe HOST BASE_PORT

For stage 0 of qwen3_omni_moe with `transport: network`, from the deploy config the operator renders
(render_deploy_config, its NIXL host pinned to HOST: never `auto`, which probes a public address) in
two variants: `rendered` (as the operator renders it now: async_chunk false) and `streaming` (the same
with vllm-omni's shipped async_chunk true). For each it builds what a stage-0 engine builds:

  worker     the model runner's payload connector: `_OmniConnectorRuntimeMixin._create_connector`
             (omni_connector_runtime.py:555-588), always;
  scheduler  the chunk adapter's connector: `OmniChunkTransferAdapter.create_connector`
             (chunk_transfer_adapter.py:290-313), which the scheduler builds only when the stage's
             async_chunk is true (omni_scheduler_mixin.py:148, the gate copied here as `streams`).

Each outcome is one line `RESULT {json}`: the connector's bound endpoint, or the error it raised.
The process leaves with os._exit (NIXL's UCX teardown can segfault at interpreter exit).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def emit(**fields: Any) -> None:
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def rendered_config(host: str, base: int) -> dict[str, Any]:
    """The operator's deploy config of the speech sample with transport network (pure rendering)."""
    import yaml
    from omnistage.render import render_deploy_config, target_from

    docs = yaml.safe_load_all(Path("manifests/samples/qwen3-omni-speech.yaml").read_text())
    sample = next(d for d in docs if d and d["kind"] == "OmniStage")
    sample["spec"]["transport"] = {"mode": "network", "basePort": base}
    config = render_deploy_config(target_from(sample))
    for connector in config["connectors"].values():
        connector["extra"]["host"] = host
    return config


def main() -> None:
    host, base = sys.argv[1], int(sys.argv[2])
    from vllm_omni.distributed.omni_connectors.model_runner.omni_connector_runtime import (
        _OmniConnectorRuntimeMixin,
    )
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )
    from vllm_omni.distributed.omni_connectors.utils.initialization import load_omni_transfer_config
    from vllm_omni.engine.stage_init_utils import get_stage_connector_spec

    rendered = rendered_config(host, base)
    variants = {"rendered": rendered, "streaming": {**copy.deepcopy(rendered), "async_chunk": True}}
    kept = []  # connectors stay open until exit: a closed one would free its port
    for name, config in variants.items():
        streams = bool(config.get("async_chunk"))
        transfer = load_omni_transfer_config(config_dict=config)
        spec = get_stage_connector_spec(transfer, 0, async_chunk=streams)
        model_config = SimpleNamespace(stage_connector_config=spec, stage_id=0, async_chunk=streams)
        builders = {"worker": _OmniConnectorRuntimeMixin._create_connector}
        if streams:  # the scheduler's gate (omni_scheduler_mixin.py:148): a chunk adapter only when streaming
            builders["scheduler"] = OmniChunkTransferAdapter.create_connector
        for who, build in builders.items():
            try:
                connector = build(model_config)
                kept.append(connector)
                emit(variant=name, async_chunk=streams, who=who, bound=[connector.host, connector._zmq_port])
            except Exception as e:  # noqa: BLE001  (reported: the parent judges the lines)
                causes = []
                while e is not None:
                    causes.append(f"{type(e).__name__}: {e}")
                    e = e.__cause__ or e.__context__
                emit(variant=name, async_chunk=streams, who=who, error=" <- ".join(causes))
        for c in kept:  # the next variant binds the same port: free it
            c.close()
        kept.clear()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
