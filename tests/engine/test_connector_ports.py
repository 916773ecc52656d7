"""Connector ports per pod (connector_ports.py): a stage replica's connector port does not grow with
its replica id when the operator runs one replica per pod.

What runs: vllm-omni 0.30.0's real transfer config parsing (`load_omni_transfer_config`), the real
per-stage connector choice (`get_stage_connector_spec`), the real port resolution of a stage worker
(`resolve_connector_spec`, what a headless replica binds) and the head's real advertisement of a
replica's endpoint (`StageEngineCoreClient._build_payload_sender_info`, called on a stand-in client
object that carries only the attributes that method reads: no engine, no sockets, no NIXL).

Tests marked "regression" fail with the patch off:
    OMNISTAGE_DISABLE_PATCHES=connector_ports pytest tests/engine/test_connector_ports.py
(replica id 16 at base 50051 then resolves to port 66435 and the connector cannot be created).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

from omnistage_engine_patches import _patching, contract
from omnistage_engine_patches.patches import connector_ports
from vllm_omni.distributed.omni_connectors.utils import initialization, kv_utils
from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient
from vllm_omni.engine.stage_init_utils import get_stage_connector_spec

BASE = 50051
# NIXL on both edges of thinker -> talker -> code2wav: the only connector a middle stage can send
# through over the network in 0.30.0. Hosts are loopback; nothing here binds or dials.
PIPELINE = {
    "connectors": {"nixl": {"name": "NixlConnector",
                            "extra": {"backends": ["UCX"], "host": "127.0.0.3", "zmq_port": BASE}}},
    "stages": [
        {"stage_id": 0, "output_connectors": {"to_stage_1": "nixl"}},
        {"stage_id": 1, "input_connectors": {"from_stage_0": "nixl"}, "output_connectors": {"to_stage_2": "nixl"}},
        {"stage_id": 2, "input_connectors": {"from_stage_1": "nixl"}},
    ],
}


@pytest.fixture
def per_pod(monkeypatch):
    monkeypatch.setenv(contract.CONNECTOR_PORTS_ENV, contract.PORTS_PER_POD)


def stage_spec(stage: int) -> dict:
    transfer = initialization.load_omni_transfer_config(config_dict=PIPELINE)
    return get_stage_connector_spec(transfer, stage, async_chunk=False)


def worker_bind(stage: int, replica_id: int) -> dict:
    """What a headless replica of `stage` with the master-assigned `replica_id` resolves and binds."""
    spec = stage_spec(stage)
    return initialization.resolve_connector_spec(
        ConnectorSpec(name=spec["name"], extra=spec["extra"]), stage_id=stage,
        role=spec["extra"].get("role"), replica_id=replica_id).extra


def head_advertises(stage: int, replica_id: int) -> dict:
    """The endpoint the head puts into a downstream request's payload_sender_info for that replica."""
    client = SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(stage_connector_config=stage_spec(stage))),
        stage_id=stage, replica_id=replica_id, _kv_sender_info=None,
        _get_kv_connector_config=lambda: None,
        _resolve_sender_host_from_config=lambda extra: extra["host"],
    )
    return StageEngineCoreClient._build_payload_sender_info(client)


def test_the_patch_is_applied(engine_patches):
    assert engine_patches[contract.CONNECTOR_PORTS].outcome == contract.APPLIED
    assert _patching.is_ours(kv_utils.compute_connector_zmq_port, contract.CONNECTOR_PORTS)


@pytest.mark.parametrize("replica_id", [0, 1, 16, 35, 4000])
def test_regression_a_churned_talker_replica_binds_what_the_head_advertises(per_pod, replica_id):
    """regression: replica ids are never reused, so an elastic stage reaches id 16 (and 35 at base
    30000); each pod has its own network namespace, so every replica binds the same port."""
    bind = worker_bind(1, replica_id)  # the talker: receives from stage 0, sends to stage 2
    assert bind["zmq_port"] == BASE + 1  # base + request-forwarding offset 0 + from_stage 1
    assert head_advertises(1, replica_id) == {"host": "127.0.0.3", "zmq_port": bind["zmq_port"]}


def test_regression_kv_ports_leave_out_the_replica_too(per_pod):
    assert kv_utils.kv_zmq_port(BASE, from_stage=0, replica_id=16) == kv_utils.kv_zmq_port(BASE, from_stage=0)


def test_without_the_operator_the_arithmetic_is_upstreams(monkeypatch):
    """vllm-omni run by hand (several replicas per host): ports still grow with the replica id."""
    monkeypatch.delenv(contract.CONNECTOR_PORTS_ENV, raising=False)
    assert worker_bind(1, 5)["zmq_port"] == BASE + 5 * 1024 + 1
    with pytest.raises(ValueError, match="must be in"):
        worker_bind(1, 16)


def test_upstream_without_the_replica_term_makes_it_upstream_fixed(monkeypatch):
    def compute_connector_zmq_port(base_port, *, purpose, from_stage, local_rank=0):
        return base_port + from_stage

    monkeypatch.setattr(initialization, "compute_connector_zmq_port", compute_connector_zmq_port)
    reason = connector_ports.install()
    assert isinstance(reason, _patching.UpstreamFixed)
    assert initialization.compute_connector_zmq_port is compute_connector_zmq_port


def test_an_importer_bound_to_another_function_leaves_everything_untouched(monkeypatch):
    original = inspect.unwrap(initialization.compute_connector_zmq_port)
    monkeypatch.setattr(initialization, "compute_connector_zmq_port", original)
    monkeypatch.setattr(kv_utils, "compute_connector_zmq_port", lambda *a, **k: 0)
    reason = connector_ports.install()
    assert reason and "kv_utils" in reason
    assert initialization.compute_connector_zmq_port is original  # checked everything before changing
