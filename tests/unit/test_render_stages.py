"""The whole pipeline's deploy config (render/stages.py, from spec.stages and spec.transport): every
stage of qwen3_omni_moe from vllm-omni's shipped deploy YAML (the generated table in
known_pipelines.py), stage 0 as today's renderer makes it, each remote stage waited for once, NIXL or
the shipped SHM connector on every edge; and validation's multi-stage rules with their messages.
Goldens regenerate with `make golden`; tests/engine/test_stage_config.py feeds the same renders to
vllm-omni's parsers."""

import copy
import os

import pytest
import yaml
from omnistage.api import DEFAULT_ENGINE_IMAGE, TransportMode
from omnistage.api.validation import InvalidSpec
from omnistage.known_pipelines import SHIPPED_DEPLOY
from omnistage.render import render_deploy_config, target_from
from omnistage.render.stages import NIXL, transport_note

from tests.support.repo import ROOT, SAMPLE

GOLDEN = ROOT / "tests/unit/golden"
PIPELINE = "qwen3_omni_moe"
# Stage 1 (talker) with its own engine settings; stage 2 (code2wav) keeps the shipped ones.
STAGES = [{"id": 1, "engine": {"gpuMemoryUtilization": 0.8, "maxNumSeqs": 32}}, {"id": 2}]
BASE_PORT = 42000


def stage(i, **engine):
    return {"id": i, "engine": engine} if engine else {"id": i}


def target(**spec):
    obj = copy.deepcopy(SAMPLE)
    obj["spec"].update(spec)
    return target_from(obj, default_image=DEFAULT_ENGINE_IMAGE)


def render(mode=TransportMode.NETWORK, stages=STAGES, pipeline=PIPELINE, engine=None, **transport):
    spec = {
        "pipeline": pipeline,
        "stages": stages,
        "transport": {"mode": str(mode), "basePort": BASE_PORT, **transport},
    }
    if engine is not None:
        spec["engine"] = engine
    return render_deploy_config(target(**spec))


def by_id(config):
    return {s["stage_id"]: s for s in config["stages"]}


def problems(**kwargs):
    with pytest.raises(InvalidSpec) as err:
        render(**kwargs)
    return err.value.problems


@pytest.mark.parametrize("mode", list(TransportMode))
def test_golden(mode):
    path = GOLDEN / f"stages-{PIPELINE}-{mode}.yaml"
    got = f"# {PIPELINE}, transport {mode}, basePort {BASE_PORT}: render/stages.py\n" + yaml.safe_dump(
        render(mode), sort_keys=False)
    if os.environ.get("OMNISTAGE_UPDATE_GOLDEN") == "1":
        path.write_text(got)
    assert path.exists(), f"no golden file for {path.name}: run `make golden`"
    assert got == path.read_text(), f"rendering of {path.name} changed: review, then `make golden`"


@pytest.mark.parametrize("mode", list(TransportMode))
def test_every_stage_once_remote_ones_waited_for_once(mode):
    stages = by_id(render(mode))
    assert sorted(stages) == [0, 1, 2]
    assert {sid: s["num_replicas"] for sid, s in stages.items()} == {0: 1, 1: 1, 2: 1}
    # Each stage runs in its own pod(s): devices are the pod's GPUs, numbered from 0.
    assert {s["devices"] for s in stages.values()} == {"0"}


def test_stage0_is_todays_stage0_over_the_shipped_one():
    engine = {
        "gpuMemoryUtilization": 0.85,
        "maxNumSeqs": 16,
        "stageOverrides": {"max_num_batched_tokens": 8192},
    }
    today = render_deploy_config(target(engine=engine))["stages"][0]
    stage0 = by_id(render(engine=engine))[0]
    assert today.items() <= stage0.items()
    shipped = SHIPPED_DEPLOY[PIPELINE]["config"]["stages"][0]
    assert stage0["default_sampling_params"] == shipped["default_sampling_params"]
    assert stage0["moe_backend"] == shipped["moe_backend"]


def test_remote_stage_settings_override_the_shipped_ones_and_unset_ones_keep_them():
    shipped = {s["stage_id"]: s for s in SHIPPED_DEPLOY[PIPELINE]["config"]["stages"]}
    stages = by_id(render(stages=[stage(1, gpuMemoryUtilization=0.8, tensorParallelSize=2,
                                        stageOverrides={"enforce_eager": True}), stage(2)]))
    assert stages[1]["gpu_memory_utilization"] == 0.8 and stages[1]["tensor_parallel_size"] == 2
    assert stages[1]["devices"] == "0,1" and stages[1]["enforce_eager"] is True
    assert stages[1]["max_num_seqs"] == shipped[1]["max_num_seqs"]
    assert stages[2]["gpu_memory_utilization"] == shipped[2]["gpu_memory_utilization"]
    assert "tensor_parallel_size" not in stages[2]


def test_the_pipeline_is_named_so_every_pod_resolves_the_same_one():
    config = render(TransportMode.SAME_NODE)
    assert config["pipeline"] == PIPELINE
    assert config["distributed_executor_backend"] == "mp" and config["async_chunk"] is True


def test_network_puts_one_nixl_spec_on_every_edge():
    config = render()
    assert list(config["connectors"]) == ["omnistage_nixl"]
    spec = config["connectors"]["omnistage_nixl"]
    assert spec["name"] == NIXL
    assert spec["extra"] == {
        # The shipped connector's model tuning (read by the talker -> code2wav chunker), kept.
        "initial_codec_chunk_frames": 4, "codec_chunk_frames": 25, "codec_left_context_frames": 25,
        "backends": ["UCX"], "host": "auto", "zmq_port": BASE_PORT}
    stages = by_id(config)
    assert "input_connectors" not in stages[0]
    assert stages[1]["input_connectors"] == {"from_stage_0": "omnistage_nixl"}
    assert stages[2]["input_connectors"] == {"from_stage_1": "omnistage_nixl"}
    assert not any(s.get("output_connectors") for s in stages.values())


def test_same_node_keeps_the_shipped_shared_memory_connector():
    config = render(TransportMode.SAME_NODE)
    shipped = SHIPPED_DEPLOY[PIPELINE]["config"]
    assert config["connectors"] == shipped["connectors"]
    assert config["connectors"]["connector_of_shared_memory"]["name"] == "SharedMemoryConnector"
    stages = by_id(config)
    assert stages[1]["input_connectors"] == {"from_stage_0": "connector_of_shared_memory"}
    assert stages[2]["input_connectors"] == {"from_stage_1": "connector_of_shared_memory"}


def test_network_turns_chunk_streaming_off_and_status_says_why():
    """vllm-omni 0.30.0 binds one NIXL handshake port twice per sending stage when it streams chunks
    (tests/connector/test_nixl_chunks.py): network renders async_chunk false; sameNode keeps the shipped
    streaming. The ConfigRendered condition says it (transport_note)."""
    assert SHIPPED_DEPLOY[PIPELINE]["config"]["async_chunk"] is True
    assert render(TransportMode.NETWORK)["async_chunk"] is False
    assert render(TransportMode.SAME_NODE)["async_chunk"] is True
    network = target(pipeline=PIPELINE, stages=STAGES, transport={"mode": "network"})
    same_node = target(pipeline=PIPELINE, stages=STAGES, transport={"mode": "sameNode"})
    assert "async_chunk: false" in transport_note(network) and transport_note(same_node) is None
    assert transport_note(target()) is None  # a single-stage OmniStage


def test_protocol_does_not_change_the_deploy_config():
    # UCX picks TCP or RDMA from the pods' environment; the connector spec is the same.
    assert render(protocol="rdma") == render(protocol="tcp")


def test_the_table_is_not_modified_by_a_render():
    before = copy.deepcopy(SHIPPED_DEPLOY)
    render()
    render(TransportMode.SAME_NODE)
    assert SHIPPED_DEPLOY == before


def test_an_unknown_pipeline_is_refused():
    [(field, message)] = problems(pipeline="qwen9_omni")
    assert field == "spec.pipeline" and "'qwen9_omni' is not a vllm-omni pipeline" in message
    assert "qwen3_omni_moe" in message


def test_a_single_stage_pipeline_is_refused():
    [(field, message)] = problems(pipeline="qwen3_omni_moe_thinker_only")
    assert field == "spec.pipeline" and "has only stage 0; remove spec.stages" in message


def test_stages_need_a_pipeline():
    [(field, message)] = problems(pipeline=None)
    assert field == "spec.pipeline" and "spec.stages needs a multi-stage pipeline" in message


def test_a_multi_stage_pipeline_needs_its_stages():
    with pytest.raises(InvalidSpec) as err:
        target(pipeline=PIPELINE)
    [(field, message)] = err.value.problems
    assert (
        field == "spec.pipeline"
        and "list stages 1..n-1 in spec.stages and run them with OmniStagePools" in message
    )


def test_a_multi_stage_pipeline_without_a_shipped_table_entry_is_refused():
    [(field, message)] = problems(pipeline="qwen2_5_omni")
    assert field == "spec.pipeline" and "does not run 'qwen2_5_omni' across pods yet" in message
    assert "qwen3_omni_moe" in message


def test_an_unknown_stage_id_is_refused():
    [(field, message)] = problems(stages=[stage(1), stage(3)])
    assert field == "spec.stages[1].id"
    assert "qwen3_omni_moe has no stage 3" in message and "list stages 1..2 (talker, code2wav)" in message


def test_stage_0_belongs_to_spec_engine():
    [(field, message)] = problems(stages=[stage(0), stage(1), stage(2)])
    assert field == "spec.stages.0.id" and "greater than or equal to 1" in message


@pytest.mark.parametrize("ids", [[2], [1], [2, 1], [1, 2, 2]])
def test_missing_or_unordered_stage_ids_are_refused(ids):
    [(field, message)] = problems(stages=[stage(i) for i in ids])
    assert field == "spec.stages"
    assert f"got stage ids {', '.join(map(str, ids))}; list stages 1..2" in message
    assert "once each, in order" in message


def test_a_stage_name_must_be_the_pipelines():
    [(field, message)] = problems(stages=[{"id": 1, "name": "speaker"}, {"id": 2, "name": "code2wav"}])
    assert field == "spec.stages[0].name" and "qwen3_omni_moe calls stage 1 'talker'" in message


def test_a_stage_override_may_not_set_the_operators_keys():
    [(field, message)] = problems(
        stages=[stage(1, stageOverrides={"runtime": {"num_replicas": 4}}), stage(2)]
    )
    assert field == "spec.stages[0].engine.stageOverrides.runtime.num_replicas" and "num_replicas" in message


@pytest.mark.parametrize(
    "transport, field, fragment",
    [
        ({"mode": "cluster"}, "spec.transport.mode", "Input should be 'network' or 'sameNode'"),
        ({"protocol": "udp"}, "spec.transport.protocol", "Input should be 'tcp' or 'rdma'"),
        (
            {"mode": "sameNode", "protocol": "rdma"},
            "spec.transport.protocol",
            "set mode network or protocol tcp",
        ),
        ({"basePort": 80}, "spec.transport.basePort", "greater than or equal to 1024"),
        ({"basePort": 65000}, "spec.transport.basePort", "less than or equal to 64512"),
        ({"basePort": 7000}, "spec.transport.basePort", "7000..8023 hold spec.engine.httpPort 8000"),
        ({"basePort": 8050}, "spec.transport.basePort", "8050..9073 hold spec.engine.membershipPort 8090"),
        ({"basePort": 24500}, "spec.transport.basePort", "hold spec.engine.masterPort 25000"),
        (
            {"env": [{"name": "OMNISTAGE_CONNECTOR_PORTS", "value": "x"}]},
            "spec.transport.env[0].name",
            "is the operator's",
        ),
    ],
)
def test_an_invalid_transport_is_refused(transport, field, fragment):
    [(got_field, message)] = problems(**transport)
    assert got_field == field and fragment in message


def test_every_problem_is_reported_at_once():
    fields = [f for f, _ in problems(stages=[stage(5)], basePort=7000)]
    assert fields == ["spec.stages[0].id", "spec.transport.basePort"]
