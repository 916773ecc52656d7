"""Connector ports per pod: a stage replica's connector port does not grow with its replica id.

vllm-omni 0.30.0 gives every transfer-engine connector (NIXL, Mooncake TE, ...) the port
`base + purpose offset + 1024 * replica_id + 16 * tp_rank + from_stage`
(`compute_connector_zmq_port`, distributed/omni_connectors/utils/initialization.py:48-80), so
that several replicas launched by one process on one host (`--omni-dp-size-local > 1`) do not
collide. The head assigns replica ids and never reuses them, so on an elastic stage the port
passes 65535 at replica id 16 for base 50051 (id 35 for base 30000) and that replica's connector
cannot be created ("Resolved connector port must be in [1, 65535]").

In Kubernetes each pod has its own network namespace and the operator runs one replica per pod,
so the replica term only breaks things. With `contract.CONNECTOR_PORTS_ENV` set to
`contract.PORTS_PER_POD` (the operator sets it in every engine pod), the wrapper drops that term.
Both sides go through the same function, so they stay in agreement: the worker's bind and the
receiver's `sender_zmq_port` (`resolve_connector_spec`, initialization.py:83-125), the KV ports
(`kv_utils.kv_zmq_port`) and the head's advertisement of a replica's endpoint in
`payload_sender_info` (`StageEngineCoreClient._build_payload_sender_info`). Without the variable
(vllm-omni run by hand, several replicas per host) the function is untouched.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

from .. import contract
from .._patching import Target, UpstreamFixed, ours, shape_problem, wrap

NAME = contract.CONNECTOR_PORTS
TARGET = "vllm_omni.distributed.omni_connectors.utils.initialization"
# Modules that bound the function by name at import time: each needs the wrapper too.
IMPORTERS = ("vllm_omni.distributed.omni_connectors.utils.kv_utils",)
FUNCTION = "compute_connector_zmq_port"


def per_pod() -> bool:
    return os.environ.get(contract.CONNECTOR_PORTS_ENV) == contract.PORTS_PER_POD


def install() -> str | None:
    module = importlib.import_module(TARGET)
    target = Target(module, FUNCTION)
    problem = shape_problem(target)
    if problem:
        return problem
    if ours(NAME, target):
        return None
    original = target.get()
    params = inspect.signature(original).parameters
    if "replica_id" not in params:
        return UpstreamFixed(f"{FUNCTION} no longer takes a replica id")
    if params["replica_id"].kind is not inspect.Parameter.KEYWORD_ONLY:
        return f"{FUNCTION} changed shape (replica_id is not keyword-only)"
    importers = [importlib.import_module(name) for name in IMPORTERS]
    for m in importers:  # check every target before changing any
        if getattr(m, FUNCTION, None) is not original:
            return f"{m.__name__}.{FUNCTION} is not the function it imported from {TARGET}"

    @wrap(module, FUNCTION, NAME)
    def compute_connector_zmq_port(original: Any, *args: Any, **kwargs: Any) -> int:
        if per_pod():
            kwargs["replica_id"] = 0  # one replica per pod: its own network namespace
        return original(*args, **kwargs)

    for m in importers:
        setattr(m, FUNCTION, getattr(module, FUNCTION))
    return None

