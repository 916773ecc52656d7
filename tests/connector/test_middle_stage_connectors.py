"""Issue 12, connector tier: in vllm-omni 0.30.0 a middle stage (the talker, 0 -> 1 -> 2) can send
over the network only through NixlConnector; with Mooncake TE or Mori it is receive-only.

This test starts failing when upstream's dual connector (RFC #5431 / PR #5138: one inbound and one
outbound connector per stage, hybrid transports) lands: that is the signal to offer Mooncake TE (and
Mori) for middle stages in the operator, and to widen section 2 of the issue.

Real: vllm-omni 0.30.0's real connector resolution, as a `vllm serve --stage-id 1` worker runs it:
`load_omni_transfer_config` on the deploy config, `get_stage_connector_spec` (the worker's one
connector, its role and, for NIXL only, the `outgoing` block), and the worker's `_create_connector`
(`resolve_connector_spec`, then the real connector factory) constructing the real
`MooncakeTransferEngineConnector` / `MoriTransferEngineConnector` class, whose `__init__` turns the
role into `can_put` and whose `put` refuses. Not real: the transfer engines themselves (Mooncake's
`TransferEngine`, Mori's `mori.io` classes: `MagicMock`s here, so neither package nor RDMA nor a
GPU is needed) and pinned memory (`Tensor.pin_memory` is the identity: CPU-only torch cannot pin);
nothing moves, no socket listens (a receiver binds none), no model, no GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest

pytest.importorskip(
    "vllm_omni", reason="connector tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

import torch
from vllm_omni.distributed.omni_connectors.connectors import (
    mooncake_transfer_engine_connector as mooncake_te,
)
from vllm_omni.distributed.omni_connectors.connectors import mori_transfer_engine_connector as mori_te
from vllm_omni.distributed.omni_connectors.model_runner.omni_connector_runtime import (
    _OmniConnectorRuntimeMixin,
)
from vllm_omni.distributed.omni_connectors.utils.initialization import load_omni_transfer_config
from vllm_omni.engine.stage_init_utils import get_stage_connector_spec

BASE = 43100
TALKER_HOST = "127.0.44.3"  # never `auto`: it probes a public address
TALKER_REPLICA_ID = 5
# The engines each connector imports at module level (None when its package is absent).
ENGINE_NAMES = {
    "MooncakeTransferEngineConnector": (mooncake_te, ["TransferEngine"]),
    "MoriTransferEngineConnector": (mori_te, ["IOEngine", "IOEngineConfig", "BackendType", "RdmaBackendConfig",
                                              "XgmiBackendConfig", "PollCqMode", "EngineDesc", "MemoryDesc"]),
}


def talker_spec(connector: str) -> dict:
    """The talker's connector as `vllm serve --stage-id 1` picks it: `connector` on both edges."""
    extra = {"host": TALKER_HOST, "zmq_port": BASE, "memory_pool_size": 1 << 16, "protocol": "tcp"}
    if connector == "NixlConnector":
        extra = {"host": TALKER_HOST, "zmq_port": BASE, "backends": ["UCX"]}
    config = {
        "connectors": {"edge": {"name": connector, "extra": extra}},
        "stages": [
            {"stage_id": 0, "output_connectors": {"to_stage_1": "edge"}},
            {"stage_id": 1, "input_connectors": {"from_stage_0": "edge"}, "output_connectors": {"to_stage_2": "edge"}},
            {"stage_id": 2, "input_connectors": {"from_stage_1": "edge"}},
        ],
    }
    return get_stage_connector_spec(load_omni_transfer_config(config_dict=config), 1, async_chunk=False)


@pytest.mark.parametrize("connector", ["MooncakeTransferEngineConnector", "MoriTransferEngineConnector"])
def test_a_transfer_engine_talker_resolves_to_receive_only(connector):
    spec = talker_spec(connector)
    print(f"talker ({connector} on 0->1 and 1->2): {spec}")
    assert spec["name"] == connector
    assert spec["extra"]["role"] == "receiver"
    assert (spec["extra"]["from_stage"], spec["extra"]["to_stage"]) == (0, 1)  # the incoming edge only
    assert "outgoing" not in spec["extra"]  # nothing describes the 1 -> 2 edge


def test_control_a_nixl_talker_also_sends():
    """What the two tests above are measured against: NIXL's talker carries its outgoing edge."""
    spec = talker_spec("NixlConnector")
    assert spec["extra"]["role"] == "receiver"
    assert spec["extra"]["outgoing"] == {"host": TALKER_HOST, "zmq_port": BASE, "backends": ["UCX"],
                                         "from_stage": 1, "to_stage": 2}


@pytest.mark.parametrize("connector", list(ENGINE_NAMES))
def test_a_transfer_engine_talker_refuses_put(connector, monkeypatch):
    module, names = ENGINE_NAMES[connector]
    for name in names:  # the transfer engine, faked (an absent package leaves only the first name, None)
        fake = MagicMock(name=name)
        # Mooncake's engine calls return 0 for success (initialize, register_memory, get_rpc_port).
        for call in ("initialize", "register_memory", "get_rpc_port"):
            getattr(fake.return_value, call).return_value = 0
        monkeypatch.setattr(module, name, fake, raising=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    monkeypatch.setenv("VLLM_OMNI_REPLICA_ID", str(TALKER_REPLICA_ID))

    spec = talker_spec(connector)
    talker = _OmniConnectorRuntimeMixin._create_connector(SimpleNamespace(stage_connector_config=spec, stage_id=1))
    try:
        result = talker.put("1", "2", "req-0_1_0", {"codes": torch.arange(4)})
        print(f"talker {type(talker).__name__}: can_put={talker.can_put}, put(1 -> 2) = {result}, "
              f"upstream {talker.sender_host}:{talker.sender_zmq_port}")
        assert type(talker).__name__ == connector
        assert talker.can_put is False
        assert result == (False, 0, None)
        assert talker._listener_thread is None  # a receiver listens for nobody downstream
    finally:
        talker.close()
