"""A stand-in head for a whole pipeline: stages 0..n-1, stage 0 in the head, stages >= 1 remote.

Issue 12 (stages 1..n in their own pods), engine tier. Shaped like Qwen3-Omni
(``deploy/qwen3_omni_moe.yaml``): thinker (0, head-local) -> talker (1) -> code2wav (2), the talker
a middle stage with a NIXL connector that receives from stage 0 and sends to stage 2.

REAL (vllm-omni 0.30.0, unmodified, plus this project's patches as loaded in the process):

* the head's startup: ``StageRuntime.initialize`` → ``DistStageRuntime._before_initialize_stage_replicas``
  (``_start_omni_master_server``: the ``OmniMasterServer`` with one pre-allocated route per planned
  replica of every stage, the forked ``OmniCoordinatorRuntime``; ``_capture_stage_factory_contexts``)
  → ``_initialize_stage_replicas`` (init groups, one thread per remote replica) →
  ``DistStageRuntime._initialize_remote_replica`` for every stage >= 1 (waits in
  ``OmniMasterServer.get_stage_config`` up to the stage-init timeout, then builds the replica's
  metadata from the head's plan) → ``_assemble_stage_pools`` (one ``StagePool`` and output processor
  per stage); ``AsyncOmniEngine`` / ``OmniEngineBase._bootstrap_orchestrator`` and
  ``_wait_for_orchestrator_init``; the real ``Orchestrator`` and ``MembershipController``;
* dynamic replicas of any stage: ``_dispatch_master_register`` → ``MembershipController`` →
  ``DistStageRuntime._build_remote_replica`` (the stage's captured template context);
* the replicas' wire: ``register_stage_with_omni_master`` (auto-assign, with a stage config, as
  ``launch_headless_llm_replica`` sends) and ``create_stage_coord_client`` (UP, heartbeats, DOWN),
  each replica from its own loopback "pod IP";
* the head-side client class: :class:`RoutingStageClient` is vllm-omni's
  ``StageEngineCoreClientBase`` (its ``__init__``, ``add_request_async``, ``process_engine_inputs``,
  ``_resolve_contact_host``, ``_build_payload_sender_info`` with ``compute_connector_zmq_port``, the
  function the ``connector_ports`` patch wraps) over a stand-in transport.

STOOD IN (no GPU, no weights):

* stage planning from a model's pipeline/deploy YAML (``_prepare_stage_plans``): the plans are
  built here from :class:`StageSpec` (typed-config-shaped objects read by the real
  ``extract_stage_metadata_from_omni_stage_config``), with a real weightless ``VllmConfig`` per
  stage carrying the connector spec ``get_stage_connector_spec`` gives a NIXL 0→1→2 chain;
* the EngineCore processes: the head-local stage-0 replica registers its slot and heartbeats like
  the head's own EngineCore (``_initialize_local_llm_replica``); for remote replicas
  ``_create_remote_replica_client`` skips the engine handshake (``connect_remote_engine_cores``)
  and ``make_async_mp_client``'s ZMQ transport. :class:`StandinTransport` (vLLM's
  ``AsyncMPClient`` stand-in) records every request it is sent and, when ``auto_finish`` is on,
  answers it with a finished ``EngineCoreOutputs`` (tests can also finish requests by hand).

Network: 127.0.0.0/8 only, nothing listens on a connector port. Every replica registers with an
explicit bind address; the connector specs say ``host: auto``, which the head-side client resolves
to the replica's registered address (``replica_host``, the head's bind address for its local
replica) without vllm-omni's UDP route probe, which runs only when no ``replica_host`` is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm.v1.engine import FinishReason
from vllm.v1.engine.exceptions import EngineDeadError
from vllm_omni.config.stage_config import StageType
from vllm_omni.distributed.omni_coordinator import create_stage_coord_client
from vllm_omni.engine import OmniEngineCoreOutput, OmniEngineCoreOutputs
from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClientBase
from vllm_omni.engine.stage_engine_startup import register_stage_with_omni_master
from vllm_omni.engine.stage_init_utils import (
    LogicalStageInitPlan,
    ReplicaInitPlan,
    extract_stage_metadata_from_omni_stage_config,
)
from vllm_omni.engine.stage_runtime import DistStageRuntime, StageRuntime

from tests.support.ports import free_port

from . import require_loopback
from .engine import StandinDistStageRuntime, StandinEngine, build_vllm_config
from .replica import SimulatedReplica

#: Base port of the NIXL connector in the chain (vllm-omni's default ``zmq_port``).
CONNECTOR_BASE_PORT = 50051


@dataclass
class StageSpec:
    """One stage of the stood-in pipeline, in the shape of a typed ``BaseVllmOmniStageConfig``
    (the fields ``extract_stage_metadata_from_omni_stage_config`` reads)."""

    stage_id: int
    model_stage: str
    final_output: bool = False
    final_output_type: str | None = None
    input_sources: list[int] = field(default_factory=list)
    num_replicas: int = 1  # planned replicas (the head waits for each)
    stage_type: StageType = StageType.LLM
    engine_output_type: str | None = None
    is_comprehension: bool = False
    requires_multimodal_data: bool = False
    custom_process_input_func: str | None = None
    prompt_transform_func: str | None = None
    prompt_expand_func: str | None = None
    runtime_config: Any = None
    pooling_config: Any = field(default_factory=lambda: SimpleNamespace(runner=None, default_pooling_params=None))
    model_config: Any = field(default_factory=lambda: SimpleNamespace(default_sampling_params={"max_tokens": 4}))


def qwen3_omni_like(num_replicas: Sequence[int] = (1, 1, 1)) -> list[StageSpec]:
    """thinker (0) -> talker (1) -> code2wav (2), final output from code2wav."""
    return [
        StageSpec(0, "thinker", is_comprehension=True, num_replicas=num_replicas[0]),
        StageSpec(1, "talker", input_sources=[0], num_replicas=num_replicas[1]),
        StageSpec(2, "code2wav", final_output=True, final_output_type="text", input_sources=[1],
                  num_replicas=num_replicas[2]),
    ]


def chain_specs(num_stages: int) -> list[StageSpec]:
    """A linear pipeline of ``num_stages`` stages, one planned replica each (what the operator's
    deploy config says: stage 0 in the head, ``num_replicas: 1`` for every remote stage). Three
    stages are :func:`qwen3_omni_like`; another count is 0 -> 1 -> ... -> n-1, output from the last."""
    if num_stages == 3:
        return qwen3_omni_like()
    if num_stages < 2:
        raise ValueError(f"a pipeline has at least two stages, not {num_stages}")
    last = num_stages - 1
    return [StageSpec(0, "stage0", is_comprehension=True),
            *(StageSpec(k, f"stage{k}", input_sources=[k - 1]) for k in range(1, last)),
            StageSpec(last, f"stage{last}", final_output=True, final_output_type="text", input_sources=[last - 1])]


def connector_spec(stage_id: int, num_stages: int) -> dict[str, Any]:
    """The stage's ``stage_connector_config`` as ``get_stage_connector_spec`` builds it for a NIXL
    chain 0 -> 1 -> ... (``host: auto``, base port 50051): the first stage a sender, a middle stage
    the receiver of its incoming edge with an ``outgoing`` block, the last stage a receiver."""
    nixl = {"host": "auto", "zmq_port": CONNECTOR_BASE_PORT, "backends": ["UCX"]}
    if stage_id == 0:
        return {"name": "NixlConnector", "extra": {**nixl, "role": "sender", "from_stage": 0, "to_stage": 1}}
    extra = {**nixl, "role": "receiver", "from_stage": stage_id - 1, "to_stage": stage_id}
    if stage_id < num_stages - 1:
        extra["outgoing"] = {**nixl, "from_stage": stage_id, "to_stage": stage_id + 1}
    return {"name": "NixlConnector", "extra": extra}


def stage_vllm_config(model_dir: Any, spec: StageSpec, num_stages: int, *, async_chunk: bool) -> Any:
    """A real weightless ``VllmConfig`` for one stage, with the ``OmniModelConfig`` fields the
    orchestrator and the client read (``model_stage``, ``stage_connector_config``, ``async_chunk``)."""
    config = build_vllm_config(model_dir, f"standin-{spec.model_stage}")
    config.model_config.model_stage = spec.model_stage
    config.model_config.stage_id = spec.stage_id
    config.model_config.async_chunk = async_chunk
    config.model_config.stage_connector_config = connector_spec(spec.stage_id, num_stages)
    return config


class StandinTransport:
    """Stands in for vLLM's ``AsyncMPClient`` under ``StageEngineCoreClientBase`` (the ZMQ sockets
    to an EngineCore process, which cannot run here). Records requests and aborts; outputs are
    real ``OmniEngineCoreOutputs``."""

    def __init__(self, vllm_config: Any, executor_class: Any, log_stats: bool = False,
                 client_addresses: dict[str, str] | None = None, client_count: int = 1,
                 client_index: int = 0) -> None:
        self.resources = SimpleNamespace(engine_dead=False, engine_manager=None, coordinator=None)
        self.received: list[Any] = []  # the requests this replica was sent, in order
        self.aborted: list[str] = []
        self.auto_finish = True
        self.shut_down = threading.Event()
        self._outputs: asyncio.Queue | None = None

    def _queue(self) -> asyncio.Queue:
        if self._outputs is None:
            self._outputs = asyncio.Queue()
        return self._outputs

    async def add_request_async(self, request: Any) -> None:
        if self.resources.engine_dead:
            raise EngineDeadError()
        self.received.append(request)
        if self.auto_finish:
            self.finish(request.request_id)

    def finish(self, request_id: str, token_ids: Sequence[int] = (7, 8)) -> None:
        """Emit a finished output for ``request_id`` (call on the orchestrator's loop)."""
        self._queue().put_nowait(OmniEngineCoreOutputs(
            engine_index=0,
            outputs=[OmniEngineCoreOutput(request_id=request_id, new_token_ids=list(token_ids),
                                          finish_reason=FinishReason.LENGTH)],
            finished_requests={request_id},
        ))

    async def get_output_async(self) -> Any:
        if self.resources.engine_dead:
            raise EngineDeadError()
        return await self._queue().get()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args=(), kwargs=None) -> Any:
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        self.shut_down.set()

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.received]


class RoutingStageClient(StageEngineCoreClientBase, StandinTransport):
    """vllm-omni's head-side stage client (``StageEngineCoreClientBase``: metadata, endpoint and
    ``payload_sender_info`` arithmetic, ``process_engine_inputs``) over :class:`StandinTransport`."""


@dataclass
class MultiStageOptions:
    stages: list[StageSpec]
    stage_vllm_configs: list[Any]
    stage_init_timeout: int = 60
    async_chunk: bool = False
    #: Builds stage 0's input processor from the engine (``engine.standin_frontend`` in the head
    #: process, for the engine report); None: a text-only frontend without a multimodal cache.
    frontend: Callable[[Any], Any] | None = None
    #: Every runtime built with these options (tests inspect one whose head failed to start).
    runtimes: list[Any] = field(default_factory=list)


class MultiStageRuntime(StandinDistStageRuntime):
    """``DistStageRuntime`` for N stages; only stage planning and the engine cores stood in.

    ``initialize`` and ``_build_remote_replica`` are the real ones again (the single-stage stand-in
    replaces both); see the module docstring for the full list.
    """

    initialize = StageRuntime.initialize
    _build_remote_replica = DistStageRuntime._build_remote_replica

    def __init__(self, *, options: MultiStageOptions, **kwargs: Any) -> None:
        super().__init__(vllm_config=options.stage_vllm_configs[0], **kwargs)
        self.options = options
        self._stage_configs = list(options.stages)
        self._num_stages = len(options.stages)
        self._stage_init_timeout = options.stage_init_timeout
        self._async_chunk = options.async_chunk
        self.clients_created: list[RoutingStageClient] = []
        options.runtimes.append(self)

    # ---- stood in: planning and engine cores ----

    def _prepare_stage_plans(self) -> list[LogicalStageInitPlan]:
        plans = []
        for spec, vllm_config in zip(self.options.stages, self.options.stage_vllm_configs, strict=True):
            replicas = []
            for replica_id in range(spec.num_replicas):
                metadata = extract_stage_metadata_from_omni_stage_config(spec)
                metadata.replica_id = replica_id
                replicas.append(ReplicaInitPlan(
                    replica_id=replica_id, num_replicas=spec.num_replicas,
                    launch_mode=self._get_launch_mode(spec.stage_id), stage_cfg=spec, metadata=metadata,
                    stage_connector_spec=vllm_config.model_config.stage_connector_config,
                    omni_kv_connector=(None, None, None), stage_vllm_config=vllm_config,
                    executor_class=StandinTransport,  # never instantiated by vLLM here
                ))
            plans.append(LogicalStageInitPlan(stage_idx=spec.stage_id, stage_id=spec.stage_id, replicas=replicas))
        return plans

    def _cleanup_after_initialize_failure(self) -> None:
        self._close_local_coord_client()  # the head-local replica's heartbeats stop with the head
        super()._cleanup_after_initialize_failure()

    def _init_group_key_override(self, replica: ReplicaInitPlan) -> str | None:
        # Local replicas would be grouped by their GPUs; there are none.
        return super()._init_group_key_override(replica) or f"local:{replica.metadata.stage_id}"

    def _client(self, metadata: Any, vllm_config: Any, addresses: dict[str, str]) -> RoutingStageClient:
        client = RoutingStageClient(vllm_config, StandinTransport, log_stats=self._log_stats,
                                    client_addresses=addresses, metadata=metadata)
        self.clients_created.append(client)
        return client

    def _initialize_local_llm_replica(self, plan: ReplicaInitPlan, stage_init_timeout: int) -> RoutingStageClient:
        from vllm_omni.engine import stage_engine_startup

        stage_engine_startup._POLL_PERIOD_MS = min(stage_engine_startup._POLL_PERIOD_MS, 200)  # see engine.py
        master = self._omni_master_server
        stage_id, replica_id = plan.metadata.stage_id, plan.replica_id
        # What the head's own EngineCore does: register its slot, then UP + heartbeats.
        resp = register_stage_with_omni_master(
            omni_master_address=self.bind_ip, omni_master_port=master.port, omni_stage_id=stage_id,
            omni_stage_config={"stage_id": stage_id}, replica_id=replica_id, replica_bind_address=self.bind_ip,
        )
        master.release_route_port_reservations(stage_id, replica_id)
        self.local_coord_client = create_stage_coord_client(
            coord_zmq_addr=resp.coordinator_router_address, input_addr=resp.input_address,
            output_addr=resp.output_address, stage_id=stage_id, queue_length_getter=lambda: 0,
        )
        addresses = {"input_address": resp.input_address, "output_address": resp.output_address,
                     "replica_host": self.bind_ip}
        return self._client(plan.metadata, plan.stage_vllm_config, addresses)

    def _create_remote_replica_client(self, ctx: Any, replica_id: int) -> RoutingStageClient:
        import copy

        # The real one runs the engine handshake (connect_remote_engine_cores) and make_async_mp_client
        # on the addresses the master allocated, with the replica's registered host injected.
        master = self._omni_master_server
        if master is None:
            raise RuntimeError("OmniMasterServer is not running; cannot create remote replica")
        if self.attach_delay:
            time.sleep(self.attach_delay)
        metadata = copy.deepcopy(ctx.base_metadata)
        metadata.replica_id = replica_id
        alloc = master.get_allocation(ctx.stage_id, replica_id)
        master.release_route_port_reservations(ctx.stage_id, replica_id)
        addresses = {"input_address": alloc.input_bind_address, "output_address": alloc.output_bind_address}
        replica_host = master.get_replica_host(ctx.stage_id, replica_id)
        if replica_host:
            addresses["replica_host"] = replica_host
        return self._client(metadata, ctx.vllm_config, addresses)


class MultiStageEngine(StandinEngine):
    """``StandinEngine`` whose runtime is :class:`MultiStageRuntime` (N stages). The constructor
    blocks, like a real head, until every planned replica of every stage attached, and raises when
    the real startup fails (e.g. ``TimeoutError`` from the stage-init wait)."""

    def __init__(self, options: MultiStageOptions, *, bind_ip: str, master_port: int, **kwargs: Any) -> None:
        self._multistage = options
        kwargs.setdefault("stats_interval", None)
        kwargs.setdefault("startup_timeout", options.stage_init_timeout + 60)
        super().__init__(options.stage_vllm_configs[0], bind_ip=bind_ip, master_port=master_port, **kwargs)

    def _initialize_stages(self, stage_init_timeout: int) -> None:
        options = self._multistage
        # What OmniEngineBase.__init__ resolves from the deploy config, for N stages.
        self.stage_configs = options.stages
        self.num_stages = len(options.stages)
        self.async_chunk = options.async_chunk
        self._start_runtime(MultiStageRuntime, options=options)
        self.stage_vllm_configs = list(options.stage_vllm_configs)
        self.input_processor = (options.frontend(self) if options.frontend is not None
                                else SimpleNamespace(renderer=SimpleNamespace(mm_processor_cache=None)))  # text only
        self.supported_tasks = ("generate",)

    def client(self, stage_id: int, replica_id: int) -> RoutingStageClient:
        return self.stage_pools[stage_id].clients[replica_id]


class StageReplica(SimulatedReplica):
    """A headless replica of stage ``stage_id`` (``vllm serve --headless --stage-id K``): like
    :class:`SimulatedReplica`, but it sends a stage config with its registration, as
    ``launch_headless_llm_replica`` does (the head's bootstrap path rejects a slot registered
    without one)."""

    def register(self) -> StageReplica:
        # Looked up at call time, as vllm-omni's headless launchers do: the engine plugin's
        # registration_report wraps it there when the plugin is loaded in this process.
        from vllm_omni.engine import stage_engine_startup

        self.response = stage_engine_startup.register_stage_with_omni_master(
            omni_master_address=self.master_ip,
            omni_master_port=self.master_port,
            omni_stage_id=self.stage_id,
            omni_stage_config={"stage_id": self.stage_id},
            replica_id=None,
            replica_bind_address=self.bind_ip,
        )
        return self


class PipelineHead:
    """A :class:`MultiStageEngine` started in a background thread (its constructor blocks until
    the initial remote replicas registered), with the replicas that registered with it."""

    def __init__(self, options: MultiStageOptions, bind_ip: str, **engine_kwargs: Any) -> None:
        self.options = options
        self.bind_ip = require_loopback(bind_ip, "bind address")
        self.master_port = free_port(bind_ip)
        self.engine: MultiStageEngine | None = None
        self.error: BaseException | None = None
        self.replicas: list[StageReplica] = []
        self._kwargs = engine_kwargs
        self.thread = threading.Thread(target=self._start, name="pipeline-head", daemon=True)

    def _start(self) -> None:
        try:
            self.engine = MultiStageEngine(self.options, bind_ip=self.bind_ip, master_port=self.master_port,
                                           **self._kwargs)
        except BaseException as err:  # noqa: BLE001 (reported to the test through .error)
            self.error = err

    @property
    def runtimes(self) -> list[MultiStageRuntime]:
        return self.options.runtimes

    def start(self) -> PipelineHead:
        self.thread.start()
        return self

    def replica(self, stage_id: int, ip: str, *, up: bool = True) -> StageReplica:
        """Register a stage replica from ``ip`` (and send UP, unless ``up`` is False)."""
        replica = StageReplica(self.bind_ip, self.master_port, ip, stage_id=stage_id).register()
        self.replicas.append(replica)
        return replica.up() if up else replica

    def wait_started(self, timeout: float) -> MultiStageEngine:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"the head did not finish starting within {timeout}s")
        if self.error is not None:
            raise self.error
        assert self.engine is not None
        return self.engine

    def stop(self) -> None:
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.down()
        self.thread.join(120)
        if self.engine is not None:
            self.engine.shutdown()
