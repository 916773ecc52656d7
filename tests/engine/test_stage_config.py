"""The whole pipeline's rendered deploy config (render/stages.py) fed to vllm-omni 0.30.0's own parsers.

Real: vllm-omni 0.30.0's real deploy-config and connector resolution; no connector is built, nothing
is dialled. The rendered YAML is written to a file and read by
* `resolve_omni_config` + `stage_by_id` (config/resolver.py), the path `run_headless` takes
  (entrypoints/cli/serve.py:1370-1390) and the head's planning reads, with the pipeline registry's
  real qwen3_omni_moe entry, and `get_headless_replica_devices` (what a stage pod launches on);
* `load_omni_transfer_config` (initialization.py:266-437) and `load_omni_transfer_config_for_model`
  (stage_init_utils.py:1902-1920), the transfer-config loaders of the head and of `run_headless`;
* `get_stage_connector_spec` (stage_init_utils.py:1923-1966), each stage worker's one connector, and
  `resolve_connector_spec` (initialization.py:83-125), what that worker binds and dials, with an
  explicit loopback host per stage (127.0.x.y: `host: auto` would probe a public route).

Not real: the model is a directory holding only a Qwen3-Omni `config.json` (no weights, no tokenizer:
nothing here loads or runs a model); no NixlConnector or SharedMemoryConnector is constructed (the
nixl package is not installed here), so UCX/TCP/RDMA, the ZMQ handshake and `/dev/shm` are not
exercised; the head's advertisement of a replica's endpoint (payload_sender_info) is not involved
(tests/engine/test_connector_ports.py covers it); replica ids are 0 (one replica per pod).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

import yaml
from omnistage.api import DEFAULT_ENGINE_IMAGE, TransportMode
from omnistage.render import render_deploy_config, target_from
from omnistage.render.stages import NIXL
from pydantic import ValidationError
from vllm_omni.config.resolver import resolve_omni_config
from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
from vllm_omni.distributed.omni_connectors.utils.initialization import (
    load_omni_transfer_config,
    resolve_connector_spec,
)
from vllm_omni.engine.stage_engine_startup import get_headless_replica_devices
from vllm_omni.engine.stage_init_utils import get_stage_connector_spec, load_omni_transfer_config_for_model

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = "qwen3_omni_moe"
MODEL_STAGES = {0: "thinker", 1: "talker", 2: "code2wav"}
STAGES = [{"id": 1, "engine": {"gpuMemoryUtilization": 0.8, "maxNumSeqs": 32}}, {"id": 2}]
# One loopback "pod IP" per stage; never dialled.
POD_IP = {0: "127.0.31.10", 1: "127.0.31.11", 2: "127.0.31.12"}


def render(mode: str, base_port: int = 42000) -> dict:
    sample = yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())
    sample["spec"].update(pipeline=PIPELINE, stages=STAGES, transport={"mode": str(mode), "basePort": base_port})
    return render_deploy_config(target_from(sample, default_image=DEFAULT_ENGINE_IMAGE))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A Qwen3-Omni config without weights: enough for vllm-omni's resolver to pick the registry entry."""
    model = tmp_path_factory.mktemp("qwen3-omni-config")
    (model / "config.json").write_text(json.dumps({
        "model_type": "qwen3_omni_moe", "architectures": ["Qwen3OmniMoeForConditionalGeneration"],
        "enable_audio_output": True}))
    return str(model)


@pytest.fixture
def write(tmp_path):
    def write(config: dict) -> str:
        path = tmp_path / "deploy.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return str(path)
    return write


def resolve(model_dir: str, path: str):
    return resolve_omni_config(model_dir, trust_remote_code=False, deploy_config_path=path, cli_overrides={},
                               stage_overrides=None, strategy_config_path=None)


def worker_spec(path: str, stage: int) -> dict:
    """The one connector spec `run_headless` gives stage `stage`'s worker (serve.py:1411-1421)."""
    return get_stage_connector_spec(load_omni_transfer_config_for_model(PIPELINE, path), stage, async_chunk=True)


def bind(spec: dict, stage: int) -> dict:
    """What the worker resolves (initialization.py:83-125), its pod IP set where `host: auto` is."""
    extra = copy.deepcopy(spec["extra"])
    for block in (extra, extra.get("outgoing") or {}):
        if block.get("host") == "auto":
            block["host"] = POD_IP[stage]
    return resolve_connector_spec(ConnectorSpec(name=spec["name"], extra=extra), stage_id=stage,
                                  role=extra.get("role"), replica_id=0).extra


@pytest.mark.parametrize("mode", list(TransportMode))
def test_every_stage_resolves_on_the_headless_path(model_dir, write, mode):
    resolved = resolve(model_dir, write(render(mode)))
    assert [s.stage_id for s in resolved.stage_configs] == [0, 1, 2]
    for stage_id, model_stage in MODEL_STAGES.items():
        stage = resolved.stage_by_id(stage_id)
        assert stage.model_stage == model_stage
        # The head waits for exactly one replica of each remote stage; each pod launches on its GPU 0.
        assert stage.runtime_config.num_replicas == 1
        assert get_headless_replica_devices(stage, stage_id, 1) == ["0"]
    talker, code2wav = resolved.stage_by_id(1), resolved.stage_by_id(2)
    assert talker.cache_config.gpu_memory_utilization == 0.8 and talker.scheduler_config.max_num_seqs == 32
    assert code2wav.cache_config.gpu_memory_utilization == 0.1   # the shipped value, kept
    # Chunk streaming binds one NIXL handshake port twice per sending stage (render/stages.py), so the
    # network transport renders it off; shared memory keeps vllm-omni's streaming.
    assert resolved.stage_by_id(1).connector_config.async_chunk is (mode is not TransportMode.NETWORK)
    with pytest.raises(KeyError, match="no stage 3"):
        resolved.stage_by_id(3)


def test_network_puts_nixl_on_both_edges_for_head_and_stage_pods(write):
    path = write(render(TransportMode.NETWORK))
    for transfer in (load_omni_transfer_config(path), load_omni_transfer_config_for_model(PIPELINE, path)):
        assert sorted(transfer.connectors) == [("0", "1"), ("1", "2")]
        for spec in transfer.connectors.values():
            assert spec.name == NIXL and spec.extra["backends"] == ["UCX"]
            assert spec.extra["codec_chunk_frames"] == 25   # the shipped chunking, still read by code2wav's feeder


@pytest.mark.parametrize("base_port", [42000, 50051])
def test_each_stage_binds_and_dials_ports_from_base_port(write, base_port):
    path = write(render(TransportMode.NETWORK, base_port))
    thinker, talker, code2wav = (bind(worker_spec(path, s), s) for s in (0, 1, 2))
    # Stage 0 sends 0 -> 1: it listens on basePort + from_stage 0, on its pod IP.
    assert thinker["role"] == "sender"
    assert (thinker["host"], thinker["zmq_port"]) == (POD_IP[0], base_port)
    # Stage 1, the middle stage: receives 0 -> 1 (dials basePort + 0) and, through the `outgoing`
    # block only NIXL gets, listens for 1 -> 2 on basePort + 1.
    assert talker["role"] == "receiver"
    assert talker["outgoing"]["from_stage"] == 1 and talker["outgoing"]["to_stage"] == 2
    assert talker["sender_zmq_port"] == base_port
    assert (talker["host"], talker["zmq_port"]) == (POD_IP[1], base_port + 1)
    # Stage 2 only receives 1 -> 2: it dials basePort + 1 and binds nothing.
    assert code2wav["role"] == "receiver" and "outgoing" not in code2wav
    assert code2wav["sender_zmq_port"] == base_port + 1 and "zmq_port" not in code2wav


def test_same_node_gives_every_stage_the_shipped_shared_memory_connector(write):
    path = write(render(TransportMode.SAME_NODE))
    for stage in (0, 1, 2):
        spec = worker_spec(path, stage)
        assert spec["name"] == "SharedMemoryConnector"
        assert spec["extra"]["codec_chunk_frames"] == 25
        # Not a transfer-engine connector: no ports, no hosts.
        resolved = bind(spec, stage)
        assert not {"zmq_port", "sender_zmq_port", "host", "outgoing"} & set(resolved)


def test_vllm_omni_refuses_a_middle_stage_with_nixl_in_and_shm_out(write):
    """Negative control: a transport mix the renderer never produces is one vllm-omni refuses."""
    config = render(TransportMode.NETWORK)
    config["stages"][2]["input_connectors"] = {"from_stage_1": {"name": "SharedMemoryConnector"}}
    with pytest.raises(ValueError, match="NIXL middle stage requires NIXL on its outgoing edge"):
        worker_spec(write(config), 1)


def test_a_broken_connector_block_fails_the_loader_but_headless_swallows_it(write):
    """Negative control: an undefined connector name is refused by the transfer-config parser, while
    the loader `run_headless` calls logs it and returns None (the stage would start with no
    connector): what the operator renders must be right before it reaches a pod."""
    config = render(TransportMode.NETWORK)
    config["connectors"] = {"renamed": config["connectors"]["omnistage_nixl"]}
    path = write(config)
    with pytest.raises(ValueError, match="Undefined connector reference: omnistage_nixl"):
        load_omni_transfer_config(path)
    assert load_omni_transfer_config_for_model(PIPELINE, path) is None
    assert worker_spec(path, 1) == {}


def test_vllm_omni_refuses_a_remote_stage_with_no_replica(model_dir, write):
    """Negative control: num_replicas is validated (>= 1) by the real config types."""
    config = render(TransportMode.NETWORK)
    config["stages"][1]["num_replicas"] = 0
    with pytest.raises(ValidationError, match="num_replicas"):
        resolve(model_dir, write(config))
