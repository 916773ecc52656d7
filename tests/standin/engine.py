"""The stand-in engine head, in-process: real vllm-omni distributed machinery, stand-in engine cores.

See the package docstring (``tests/standin/__init__.py``) for what is real and what is stood in.
Used by the engine-tier tests directly and by ``python -m tests.standin.head``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self

import janus
from vllm.multimodal.cache import (
    MultiModalProcessorOnlyCache,
    MultiModalProcessorSenderCache,
    ShmObjectStoreSenderCache,
)
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.stats import SchedulerStats
from vllm_omni.distributed.omni_coordinator import create_stage_coord_client
from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
from vllm_omni.engine.stage_engine_startup import register_stage_with_omni_master
from vllm_omni.engine.stage_pool import StagePool
from vllm_omni.engine.stage_runtime import DistStageRuntime
from vllm_omni.entrypoints.omni_base import OmniBase
from vllm_omni.outputs.output_processor import MultimodalOutputProcessor

from tests.support.ports import free_port
from tests.support.waits import wait_for

from . import require_loopback

logger = logging.getLogger("tests.standin.engine")


def build_vllm_config(model_dir: Path, served_model_name: str = "standin") -> Any:
    """A real ``VllmConfig`` for stage 0 on the CPU (no accelerator, no weights, no tokenizer)."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        served_model_name=served_model_name,
        max_model_len=1024,
        dtype="float32",
    )
    return VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"))


class StandinStageClient:
    """Stands in for a replica's head-side EngineCore client (``StageEngineCoreClient``).

    The real client talks to an EngineCore process (GPU, weights) over the sockets the master
    allocated. This one carries the same addresses and the attributes the orchestrator and the
    pool read, serves no requests, and, like a real EngineCore with stats on, emits a
    ``SchedulerStats`` batch every ``stats_interval`` seconds (real ``EngineCoreOutputs``), so
    the orchestrator's real stats path runs for every attached replica.

    The engine tier's ``InertStageClient`` (tests/support/engine_stack.py) is the other stand-in for
    the same upstream class: attributes only, for engines whose stage pools are built and never
    run. This one is live.
    """

    def __init__(
        self,
        stage_id: int,
        replica_id: int,
        *,
        input_address: str,
        output_address: str,
        replica_host: str | None,
        stats_interval: float | None,
    ) -> None:
        from vllm import SamplingParams

        self.stage_id = stage_id
        self.replica_id = replica_id
        self.stage_type = "llm"
        self.model_stage = None
        self.final_output = True
        self.final_output_type = "text"
        self.default_sampling_params = SamplingParams(max_tokens=16)
        self.prompt_transform_func = None
        self.prompt_expand_func = None
        self.requires_multimodal_data = False
        self.custom_process_input_func = None
        self.engine_input_source: list[int] = []
        self.is_comprehension = True
        self.client_addresses = {"input_address": input_address, "output_address": output_address}
        if replica_host:
            self.client_addresses["replica_host"] = replica_host
        self.engine_dead = False
        self.stats_interval = stats_interval
        self.stats_emitted = 0
        self.reported_running = 0  # num_running_reqs in the next SchedulerStats (tests set it)
        self.shut_down = threading.Event()
        self._next_stats = time.monotonic()

    def check_health(self) -> None:
        if self.engine_dead:
            raise EngineDeadError()

    def shutdown(self) -> None:
        self.shut_down.set()

    async def get_output_async(self) -> EngineCoreOutputs:
        # The orchestrator polls this (legacy loop: with a 1 ms timeout; event-driven loop: a
        # blocking reader task). Cancellation at the sleep loses nothing.
        while True:
            if self.engine_dead:
                raise EngineDeadError()
            if not self.stats_interval or self.shut_down.is_set():
                await asyncio.sleep(0.5)
                continue
            delay = self._next_stats - time.monotonic()
            if delay <= 0:
                self._next_stats = time.monotonic() + self.stats_interval
                self.stats_emitted += 1
                return EngineCoreOutputs(
                    engine_index=0, outputs=[], scheduler_stats=SchedulerStats(num_running_reqs=self.reported_running)
                )
            await asyncio.sleep(delay)

    async def add_request_async(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the stand-in engine head serves no generation requests")

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        return None

    async def collective_rpc_async(self, method: str, timeout: float | None = None, args=(), kwargs=None) -> Any:
        return None


class StandinDistStageRuntime(DistStageRuntime):
    """vllm-omni's ``DistStageRuntime`` with stand-in engine cores.

    Real: ``_start_omni_master_server`` (``OmniCoordinatorRuntime`` child process + the
    ``OmniMasterServer`` thread, bound on ``bind_ip``), ``_dispatch_master_register`` (the
    ``on_register`` callback queueing ``RegisterRemoteReplicaMessage`` for the orchestrator),
    ``create_membership_controller`` and the cleanup. The head's local stage-0 replica registers
    with ``register_stage_with_omni_master`` and heartbeats with ``create_stage_coord_client``,
    as the head's local EngineCore would. Stood in: ``initialize`` (no stage plans from a model
    registry, no EngineCore launch) and ``_build_remote_replica`` (no EngineCore handshake: it
    returns a :class:`StandinStageClient` on the addresses the master allocated).
    """

    def __init__(
        self,
        *,
        vllm_config: Any,
        bind_ip: str,
        master_port: int,
        request_queue: janus.Queue,
        log_stats: bool,
        heartbeat_timeout: float,
        lb_policy: str,
        stats_interval: float | None,
        attach_delay: float = 0.0,
    ) -> None:
        super().__init__(
            stage_configs=[],
            model=str(vllm_config.model_config.model),
            config_path=None,
            stage_init_timeout=60,
            async_chunk=False,
            single_stage_id_filter=0,
            omni_master_address=bind_ip,
            omni_master_port=master_port,
            log_stats=log_stats,
            omni_heartbeat_timeout=heartbeat_timeout,
            omni_lb_policy=lb_policy,
            request_queue=request_queue,
        )
        self.vllm_config = vllm_config
        self.bind_ip = bind_ip
        self.stats_interval = stats_interval
        self.attach_delay = attach_delay
        self.local_coord_client: Any = None
        self.remote_clients: list[StandinStageClient] = []

    def initialize(self) -> None:
        from vllm_omni.engine import stage_engine_startup

        # The master's ROUTER loop polls with a 5 s period and checks its stop flag in between,
        # so a real head takes up to 5 s to stop; a timing knob only, shortened for the stand-in.
        stage_engine_startup._POLL_PERIOD_MS = min(stage_engine_startup._POLL_PERIOD_MS, 200)
        plans = [SimpleNamespace(stage_id=0, replicas=[SimpleNamespace(replica_id=0, launch_mode="local")])]
        try:
            self._start_omni_master_server(plans)
            master = self._omni_master_server
            # The head registers its own local slot like the real head does for its engine.
            resp = register_stage_with_omni_master(
                omni_master_address=self.bind_ip,
                omni_master_port=master.port,
                omni_stage_id=0,
                replica_id=0,
                replica_bind_address=self.bind_ip,
            )
            master.release_route_port_reservations(0, 0)
            local = StandinStageClient(
                0, 0, input_address=resp.input_address, output_address=resp.output_address,
                replica_host=self.bind_ip, stats_interval=self.stats_interval,
            )
            # What the local EngineCore process creates after its handshake: UP + heartbeats.
            self.local_coord_client = create_stage_coord_client(
                coord_zmq_addr=resp.coordinator_router_address,
                input_addr=resp.input_address,
                output_addr=resp.output_address,
                stage_id=0,
                queue_length_getter=lambda: 0,
            )
            output_processor = MultimodalOutputProcessor(tokenizer=None, log_stats=self._log_stats)
            self.stage_pools = [StagePool(0, [local], output_processor=output_processor,
                                          stage_vllm_config=self.vllm_config)]
        except BaseException:
            self._close_local_coord_client()
            self._cleanup_distributed_infra()
            raise

    def _build_remote_replica(self, stage_id: int, replica_id: int) -> StandinStageClient:
        # Runs in a worker thread (MembershipController._do_register uses asyncio.to_thread),
        # where the real runtime waits for the replica's EngineCore handshake.
        master = self._omni_master_server
        if master is None:
            raise RuntimeError("OmniMasterServer is not running")
        if self.attach_delay:
            time.sleep(self.attach_delay)
        alloc = master.get_allocation(stage_id, replica_id)
        # The real client binds these ports now; release the master's reservations like it does.
        master.release_route_port_reservations(stage_id, replica_id)
        client = StandinStageClient(
            stage_id, replica_id, input_address=alloc.input_bind_address, output_address=alloc.output_bind_address,
            replica_host=master.get_replica_host(stage_id, replica_id), stats_interval=self.stats_interval,
        )
        self.remote_clients.append(client)
        return client

    def _close_local_coord_client(self) -> None:
        if self.local_coord_client is not None:
            try:
                self.local_coord_client.close()  # DOWN for the head's local replica
            except RuntimeError:
                pass
            self.local_coord_client = None

    def shutdown(self) -> None:
        self._close_local_coord_client()
        super().shutdown()


#: A stand-in knob (not read by the real plugin): the mode the stand-in frontend builds whatever
#: the plugin decides, to play an engine image whose frontend patch did not take effect.
FRONTEND_KNOB = "OMNISTAGE_STANDIN_FRONTEND_CACHE"
_CACHE_CLASSES = {"processor-only": MultiModalProcessorOnlyCache, "lru": MultiModalProcessorSenderCache,
                  "shm": ShmObjectStoreSenderCache}


def standin_frontend(engine: Any) -> SimpleNamespace:
    """Stands in for the stage-0 input processor a real head builds (a multimodal renderer needs
    a processor and tokenizer; the stand-in model has neither). Its renderer holds an instance of
    the real vLLM cache class that the plugin's real decision (`frontend_cache.choose_cache_type`,
    honouring the operator's OMNISTAGE_FRONTEND_CACHE) selects for a multimodal model on one API
    process, where vLLM itself chooses `lru`; with the frontend patch not applied, vLLM's `lru`
    stays. The instance is not initialised: the stand-in frontend processes no media, and the
    engine report only reads its class."""
    from omnistage_engine_patches import _patching, contract
    from omnistage_engine_patches.patches import frontend_cache, replica_aware_cache

    mode = os.environ.get(FRONTEND_KNOB)
    if not mode:
        mode = contract.CACHE_LRU
        if _patching.applied(contract.FRONTEND_CACHE):
            chosen = frontend_cache.choose_cache_type("lru", frontend_cache.requested_mode(),
                                                      frontend_cache.stage0_needs_processor_only(engine))
            mode = {"processor_only": contract.CACHE_PROCESSOR_ONLY, None: contract.CACHE_NONE}.get(chosen, chosen)
            # As the real frontend_cache does for replica-aware: the per-replica dispatch on top
            # (the deploy config's default size; the stand-in sends no media).
            replica_aware = mode == contract.CACHE_PROCESSOR_ONLY and \
                frontend_cache.requested_mode() == contract.CACHE_REPLICA_AWARE
            replica_aware_cache.activate(4.0 if replica_aware else None)
    cls = _CACHE_CLASSES.get(mode)
    cache = object.__new__(cls) if cls is not None else None
    logger.info("stand-in stage-0 frontend: %s", type(cache).__name__ if cache is not None else "no cache")
    return SimpleNamespace(renderer=SimpleNamespace(mm_processor_cache=cache))


class StandinEngine(AsyncOmniEngine):
    """``AsyncOmniEngine`` whose stages come from :class:`StandinDistStageRuntime`.

    ``__init__`` sets only what ``OmniEngineBase.__init__`` sets for the orchestrator (its real
    ``__init__`` resolves a model's pipeline and deploy configs), then starts the orchestrator
    thread exactly as the base class does: the real ``_bootstrap_orchestrator`` builds the
    runtime (``_initialize_stages``, overridden), the real ``MembershipController`` and the real
    ``Orchestrator`` (stats on: the real ``OmniPrometheusStatLogger``), and runs it.
    """

    def __init__(
        self,
        vllm_config: Any,
        *,
        bind_ip: str,
        master_port: int,
        log_stats: bool = True,
        heartbeat_timeout: float = 30.0,
        lb_policy: str = "round-robin",
        stats_interval: float | None = 1.0,
        attach_delay: float = 0.0,
        event_driven: bool = True,
        input_processor: Any = None,
        startup_timeout: float = 120.0,
    ) -> None:
        from vllm_omni.metrics.prometheus import OmniRequestCounter

        self.model = str(vllm_config.model_config.model)
        self.tokenizer = None
        self.config_path = None
        self.stage_configs = [SimpleNamespace(stage_id=0, is_comprehension=True)]
        self.num_stages = 1
        self.async_chunk = False
        self.single_stage_mode = True
        self._single_stage_id_filter = 0
        self._omni_master_address = require_loopback(bind_ip, "bind address")
        self._omni_master_port = master_port
        self._omni_dp_size_local = 1
        self._omni_heartbeat_timeout = heartbeat_timeout
        self._omni_lb_policy = lb_policy
        self._parallel_stage_init = False
        self._log_stats = log_stats
        self._enable_orch_monitor = False
        # vllm-omni's event-driven orchestration loop (an upstream option): blocking readers
        # instead of a 1 ms poll, which keeps an idle stand-in head cheap on a small machine.
        self._event_driven_orch_default = event_driven
        self._transfer_emitter = None
        self._prom_metrics = None
        self._client_config = None
        self._standin_vllm_config = vllm_config
        self._standin_input_processor = input_processor
        self._standin_options = {"stats_interval": stats_interval, "attach_delay": attach_delay}
        self.stage_pools = []
        self.stage_clients = []
        self.input_processor = None
        self.endpoint_restrictions = ()
        self.request_queue = janus.Queue()
        self.output_queue = janus.Queue()
        self.rpc_output_queue = janus.Queue()
        self._shutdown_called = False
        self._weak_finalizer = None
        self._correlated_rpc_client = None
        self._output_drain_executor = None
        self._running_counter = OmniRequestCounter()
        self._engines_waiting_counter = OmniRequestCounter()

        startup_future: concurrent.futures.Future = concurrent.futures.Future()
        self.orchestrator_thread = threading.Thread(
            target=self._bootstrap_orchestrator,
            args=(60, startup_future),
            daemon=True,
            name="orchestrator",
        )
        self.orchestrator_thread.start()
        self._wait_for_orchestrator_init(startup_future, int(startup_timeout))

    def _start_runtime(self, runtime_class: Any, **kwargs: Any) -> None:
        """Build and start the (stand-in) stage runtime on this head's master address, and take its
        stage pools as the engine's, as vllm-omni's `_initialize_stages` does."""
        self._runtime = runtime_class(
            bind_ip=self._omni_master_address,
            master_port=self._omni_master_port,
            request_queue=self.request_queue,
            log_stats=self._log_stats,
            heartbeat_timeout=self._omni_heartbeat_timeout,
            lb_policy=self._omni_lb_policy,
            **kwargs,
            **self._standin_options,
        )
        self._runtime.initialize()
        self.stage_pools = self._runtime.stage_pools
        self.stage_clients = [pool.stage_client for pool in self.stage_pools]
        self.output_processors = [pool.output_processor for pool in self.stage_pools]

    def _initialize_stages(self, stage_init_timeout: int) -> None:
        self._start_runtime(StandinDistStageRuntime, vllm_config=self._standin_vllm_config)
        self.stage_vllm_configs = [self._standin_vllm_config]
        self.input_processor = self._standin_input_processor or standin_frontend(self)
        self.supported_tasks = ("generate",)

    def _detect_pd_config(self) -> None:
        return None  # no prefill/decode disaggregation in the stand-in

    def _create_orchestrator(self, **orchestrator_kwargs: Any) -> Any:
        # AsyncOmniEngine's (the real Orchestrator); kept for tests to reach its loop and state.
        self.orchestrator = super()._create_orchestrator(**orchestrator_kwargs)
        self.orchestrator_loop = asyncio.get_running_loop()  # called on the orchestrator's loop
        return self.orchestrator

    # ---- conveniences for tests and the head process ----

    @property
    def master(self) -> Any:
        return self._runtime._omni_master_server

    @property
    def stage0(self) -> StagePool:
        return self.stage_pools[0]

    def attached_replica_ids(self, stage_id: int = 0) -> list[int]:
        return self.stage_pools[stage_id].live_replica_ids()

    def on_loop(self, fn, timeout: float = 30.0) -> Any:
        """Run ``fn()`` (sync or async) on the orchestrator's loop, where the pool, the
        membership controller and the stat logger live, and return its result."""

        async def call() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(call(), self.orchestrator_loop).result(timeout)


# The engine tier's waits: in one process, many and short, so every 50 ms and without progress lines
# (a stand-in head's own waits would go to its pod log).
wait_quietly = functools.partial(wait_for, interval=0.05, say=None)


@contextlib.contextmanager
def standin_head(vllm_config: Any, bind_ip: str, **kwargs: Any):
    """A running :class:`StandinEngine` on ``bind_ip`` (free master port); shut down after."""
    engine = StandinEngine(vllm_config, bind_ip=bind_ip, master_port=free_port(bind_ip), **kwargs)
    try:
        yield engine
    finally:
        engine.shutdown()


class HttpServerThread:
    """uvicorn serving ``app`` on ``host:port`` from a background thread (tests)."""

    def __init__(self, app: Any, host: str, port: int | None = None) -> None:
        import uvicorn

        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning",
                                                   access_log=False, lifespan="on"))
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, name="standin-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Self:
        self.thread.start()
        wait_quietly("the HTTP server to start", lambda: self.server.started, 30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class StandinEngineClient(OmniBase):
    """The ``app.state.engine_client`` of the stand-in head (stands in for ``AsyncOmni``).

    Carries ``engine`` (what the membership endpoint reads) and vllm-omni's own health logic:
    ``check_health`` is ``OmniBase.check_health`` (503 when the orchestrator thread died or a
    stage that had replicas has no live one), awaited the way ``AsyncOmniBase`` does.
    """

    def __init__(self, engine: StandinEngine) -> None:  # OmniBase.__init__ would build an engine
        self.engine = engine

    async def check_health(self) -> None:  # type: ignore[override]
        OmniBase.check_health(self)

    def shutdown(self, timeout: float | None = None) -> None:
        self.engine.shutdown()


def build_http_app(engine_client: StandinEngineClient, host: str, port: int) -> Any:
    """vLLM's own FastAPI app (``vllm.entrypoints.launchers.app.build_app``, the function
    vllm-omni's server uses): core routers including ``/metrics``, and the endpoint plugins
    ``VLLM_PLUGINS`` allows (``omnistage_membership``: the real entry point, loaded by vLLM).
    ``/health`` is vllm-omni's handler, swapped in the way vllm-omni's server does it."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import FrontendArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm_omni.entrypoints.openai.api_server import health
    from vllm_omni.entrypoints.serve.utils.routes import remove_route_from_app

    # The frontend half of `vllm serve`'s arguments (what build_app reads); the engine half would
    # build a DeviceConfig, which cannot infer a device on a machine without an accelerator.
    parser = FrontendArgs.add_cli_args(FlexibleArgumentParser(prog="standin-head"))
    args = parser.parse_args(["--host", host, "--port", str(port)])
    app = build_app(args, ("generate",))
    remove_route_from_app(app, "/health", {"GET"})
    app.add_api_route("/health", health, methods=["GET"])
    app.state.engine_client = engine_client
    # What omni_init_app_state would set; False: no periodic do_log_stats() logging loop (the
    # Prometheus stat logger records on the orchestrator's stats path regardless).
    app.state.log_stats = False
    return app
