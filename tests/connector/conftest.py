"""Connector tier: the network data path between stage pods, on the CPU, over loopback.

Real here: vllm-omni 0.30.0's connector resolution (`load_omni_transfer_config`,
`get_stage_connector_spec`, `resolve_connector_spec`, the connector factory) and, where the
`nixl` packages are installed (the project's `engine` extra), NixlConnector moving payloads over
UCX (`UCX_TLS=tcp,self,sm`) between processes bound to their own 127.x addresses. No GPU, no
model, no Kubernetes. Every test in this directory gets the `connector` marker.

Each test module skips itself, with the reason, when what it needs is absent (vllm_omni; nixl).
Processes are given their `host` explicitly: a connector's `host: auto` probes a public address.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.loopback import LOOPBACK_ENV

# Loopback only, no hub, no usage stats: for this process and the stage processes it starts.
os.environ.update(LOOPBACK_ENV)

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # the whole session's items: mark only this directory's
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.connector)
