"""A stage-0 engine of the real vllm 0.30.0 / vllm-omni 0.30.0 on the CPU, its replicas stood in:
what the engine tier's tests and the cache benchmark (tests/bench/bench_cache.py) build on.

* distinct images and their data URLs (the chat path fetches `data:` URLs locally);
* `stage0_engine_builder`: a real `AsyncOmniEngine` initialised by vllm-omni's `_initialize_stages`,
  its stage runtime stood in (`InertStageRuntime`, `InertStageClient`), and what `StagePool.submit_initial`
  reads stood in (`StandInOutputProcessor`, `stand_in_request_state`);
* `Replica`: the engine side of a stage-0 replica (its receiver cache), and `WireReplica`: one behind
  the real head-side client, its requests encoded as for the wire; `pixel_digest` fingerprints what a
  replica would feed the encoder.

Importing it imports engine_env first, which sets the process environment before vLLM is imported.
"""

from __future__ import annotations

import base64
import hashlib
import io
import threading
from types import SimpleNamespace
from typing import Any

import pytest

import tests.support.engine_env  # noqa: F401  (the environment, before anything imports vLLM)


# ---- media helpers -------------------------------------------------------------------------
def make_image(i: int, size: int = 56):
    """A distinct solid-colour RGB image per index (distinct content, distinct hash)."""
    from PIL import Image

    return Image.new("RGB", (size, size), ((37 * i) % 256, (91 * i + 17) % 256, (53 * i + 101) % 256))


def image_data_url(i: int) -> str:
    buf = io.BytesIO()
    make_image(i).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---- a stage-0 engine through vllm-omni's real stage initialisation ---------------------------
class InertStageClient:
    """Stands in for a stage replica's head-side EngineCore client (`StageEngineCoreClient`).

    A real client needs a running EngineCore process (GPU, weights); these tests never send
    anything to it. It carries the attributes vllm-omni's engine reads while initialising, and
    nothing else: no health, no output stream, no methods. Its `__init__` also seeds the real
    client class a `WireReplica` builds (make_wire_client), which must keep its own behaviour.

    Not tests/standin/engine.py's `StandinStageClient`: that one is a live replica attached to a
    running stand-in head through the master (the addresses it allocated, health checks, a stats
    stream, shutdown). Two classes because they play two roles; "inert" says this one's.
    """

    def __init__(self, replica_id: int, stage_type: str = "llm") -> None:
        from vllm import SamplingParams

        self.replica_id = replica_id
        self.stage_type = stage_type
        self.final_output = True
        self.final_output_type = "text"
        self.model_stage = None
        self.default_sampling_params = SamplingParams(max_tokens=4)
        self.prompt_transform_func = None
        self.prompt_expand_func = None
        # The address a replica advertises (loopback; nothing listens there, nothing dials it).
        self.client_addresses = {"input_address": f"tcp://127.0.0.1:{41000 + replica_id}"}


class StandInOutputProcessor:
    """Stands in for the orchestrator's output processor, which `StagePool.submit_initial` hands a
    request to before it routes it (nothing here reads outputs through it)."""

    def add_request(self, **_kwargs: Any) -> None:
        pass

    def remove_request(self, _request_id: str) -> None:
        pass


def stand_in_request_state(max_tokens: int = 4) -> Any:
    """The part of the orchestrator's `OrchestratorRequestState` `submit_initial` reads."""
    from vllm import SamplingParams

    return SimpleNamespace(sampling_params_list=[SamplingParams(max_tokens=max_tokens)])


class InertStageRuntime:
    """Stands in for vllm-omni's `StageRuntime` / `DistStageRuntime`, launching nothing (unlike
    tests/standin/engine.py's `StandinDistStageRuntime`, which runs the real master server).

    The real ones launch EngineCore processes (static) or an OmniMasterServer that waits for
    headless replicas to register (distributed); neither can run without GPUs. This one hands
    `OmniEngineBase._initialize_stages` a real `StagePool` per stage holding InertStageClients,
    and records the arguments the engine passed, so the rest of `_initialize_stages` (building
    the shared stage-0 input processor and renderer, reading stage metadata) runs unmodified.
    """

    def __init__(self, stage_pools: list[Any], kwargs: dict[str, Any]) -> None:
        self.stage_pools = stage_pools
        self.kwargs = kwargs

    def initialize(self) -> None:
        pass

    def create_membership_controller(self) -> None:
        return None


def stage0_engine_builder(monkeypatch: pytest.MonkeyPatch):
    """Factory: a real `AsyncOmniEngine` object initialised by vllm-omni's `_initialize_stages`.

    `build_stage0_engine(vllm_config, replicas=N, distributed=False)`:

    * `distributed=False`: a single runtime whose stage 0 has `N` replicas
      (`runtime_config.num_replicas = N`, N >= 1 as vllm-omni's typed config requires);
    * `distributed=True`: a head started with `--stage-id 0` and a master address
      (`single_stage_mode`), whose stage-0 pool holds `N` replicas when the frontend is built
      (N may be 0: the decision must not depend on who has registered yet).

    The engine object is made with `object.__new__` plus the attributes `OmniEngineBase.__init__`
    would set (its `__init__` resolves deploy configs and starts the orchestrator thread, which
    launches engines); `create_stage_runtime` is replaced by `InertStageRuntime` (see there).
    Everything `_initialize_stages` builds after that is real: the input processor, the Omni
    renderer, its multimodal processor and the cache vLLM (or our patch) gives it.
    """
    from vllm_omni.config.omni_config import OmniStageRuntimeConfig
    from vllm_omni.engine import omni_engine_base
    from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
    from vllm_omni.engine.stage_pool import StagePool

    def build(vllm_config: Any, *, replicas: int, distributed: bool = False, stage_type: str = "llm") -> Any:
        runtimes: list[InertStageRuntime] = []

        def create_stage_runtime(**kwargs: Any) -> InertStageRuntime:
            clients = [InertStageClient(i, stage_type) for i in range(replicas)]
            pool = StagePool(0, clients, stage_vllm_config=vllm_config)
            runtimes.append(InertStageRuntime([pool], kwargs))
            return runtimes[-1]

        monkeypatch.setattr(omni_engine_base, "create_stage_runtime", create_stage_runtime)

        engine = object.__new__(AsyncOmniEngine)
        engine.model = str(vllm_config.model_config.model)
        engine.tokenizer = None
        engine.config_path = None
        engine.stage_configs = [
            SimpleNamespace(
                stage_id=0,
                is_comprehension=True,
                runtime_config=OmniStageRuntimeConfig(num_replicas=max(1, replicas)),
            )
        ]
        engine.async_chunk = False
        engine.single_stage_mode = distributed
        engine._single_stage_id_filter = 0 if distributed else None
        engine._omni_master_address = "127.0.0.1" if distributed else None
        engine._omni_master_port = 29555 if distributed else None
        engine._omni_dp_size_local = max(1, replicas) if distributed else 1
        engine._omni_heartbeat_timeout = 30.0
        engine._omni_lb_policy = "round-robin"
        engine._parallel_stage_init = False
        engine.request_queue = None
        engine._initialize_stages(300)
        engine.stand_in_runtime = runtimes[-1]
        return engine

    return build


# ---- the engine side of a stage-0 replica ----------------------------------------------------
class Replica:
    """The engine side of one stage-0 replica: the receiver cache its EngineCore / workers build
    (`engine_receiver_cache_from_config` in `EngineCore.__init__`, or for shm
    `worker_receiver_cache_from_config` in the workers), fed a request's `mm_features` as
    `EngineCore.preprocess_add_request` does. Real vLLM classes; no engine process."""

    def __init__(self, vllm_config: Any, replica_id: int) -> None:
        self.replica_id = replica_id
        self.vllm_config = vllm_config
        self._cache: Any = None
        self._built = False

    @property
    def cache(self) -> Any:
        # Built on first use: an SHM receiver attaches to the frontend's ring, which exists only
        # once an SHM sender has created it.
        if not self._built:
            from vllm.multimodal import MULTIMODAL_REGISTRY

            if MULTIMODAL_REGISTRY._get_cache_type(self.vllm_config) == "shm":
                self._cache = MULTIMODAL_REGISTRY.worker_receiver_cache_from_config(
                    self.vllm_config, threading.Lock()
                )
            else:
                self._cache = MULTIMODAL_REGISTRY.engine_receiver_cache_from_config(self.vllm_config)
            self._built = True
        return self._cache

    def receive(self, request: Any) -> list[Any]:
        if self.cache is None:  # caching disabled on the engine: features arrive complete
            return request.mm_features
        return self.cache.get_and_update_features(request.mm_features)


def pixel_digest(item: Any) -> str:
    """A stable fingerprint of the tensor a replica would feed the encoder."""
    if item is None or "pixel_values" not in item:
        return "no-tensor"
    return hashlib.sha256(item["pixel_values"].data.contiguous().numpy().tobytes()).hexdigest()[:16]


# ---- a replica behind a real head-side client (the wire) ---------------------------------------
class WireReplica(Replica):
    """A stage-0 replica behind the head-side client vllm-omni really uses: a
    `StageEngineCoreClient` whose `add_request_async` / `get_output_async` / `shutdown` are
    vLLM's and vllm-omni's own (and whatever the plugin wrapped on them), so a request is
    msgpack-encoded by the client's real `MsgpackEncoder` exactly as it would be for the wire.

    Stood in (there is no EngineCore process): the client's constructor (it would handshake with
    an EngineCore), its ZMQ sockets and its output task. `_send_input_message` puts the encoded
    frames into this replica's inbox (in order, as a ZMQ socket does; an optional `send_delay`
    makes the send's awaitable finish later, as a busy socket would), and outputs are put on the
    client's `outputs_queue` after a round trip through the real encoder/decoder. `drain()` is
    the replica's input thread: decode each message with `MsgpackDecoder(OmniEngineCoreRequest)`,
    run the receiver cache as `EngineCore.preprocess_add_request` does, and answer a miss with
    the real `EngineCoreProc._handle_mm_cache_miss` (`mm_cache_miss_hashes`), a success with a
    finished output.
    """

    def __init__(self, vllm_config: Any, replica_id: int, *, send_delay: Any = None) -> None:
        super().__init__(vllm_config, replica_id)
        self.inbox: list[list[memoryview]] = []
        self.wire_bytes = 0
        self.used: dict[str, list[Any]] = {}  # request id -> the features this replica used
        self.misses: list[str] = []  # request ids this replica answered with a cache miss
        self.send_delay = send_delay
        self.client = make_wire_client(self)

    def deliver(self, message: tuple[Any, ...]) -> None:
        from vllm.v1.engine import EngineCoreRequestType

        if bytes(message[0]) != EngineCoreRequestType.ADD.value:
            return  # an abort or a utility call: nothing for the receiver cache
        # ZMQ sends with copy=False: the frames still point at the tensors; the copy (the wire)
        # happens in drain(), on the replica's side of the socket.
        frames = [memoryview(f) for f in message[1:]]  # [0] is the request type
        self.wire_bytes += sum(f.nbytes for f in frames)
        self.inbox.append(frames)

    def drain(self) -> int:
        """Process every message received so far, in order; return how many."""
        import queue

        from vllm.multimodal.cache import MultiModalCacheMissError
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.engine.core import EngineCoreProc
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
        from vllm_omni.engine import OmniEngineCoreRequest

        decoder, encoder = MsgpackDecoder(OmniEngineCoreRequest), MsgpackEncoder()
        out_decoder = MsgpackDecoder(EngineCoreOutputs)
        n = 0
        while self.inbox:
            frames, n = [bytearray(f) for f in self.inbox.pop(0)], n + 1
            request = decoder.decode(frames)
            try:
                self.used[request.request_id] = self.receive(request)
            except MultiModalCacheMissError as err:
                self.misses.append(request.request_id)
                answers: queue.Queue = queue.Queue()
                EngineCoreProc._handle_mm_cache_miss(SimpleNamespace(output_queue=answers, engine_index=0),
                                                     request, err)
                outputs = answers.get_nowait()[1]
            else:
                outputs = EngineCoreOutputs(outputs=[EngineCoreOutput(
                    request_id=request.request_id, new_token_ids=[1], finish_reason=FinishReason.LENGTH)],
                    finished_requests={request.request_id})
            self.client.outputs_queue.put_nowait(out_decoder.decode(encoder.encode(outputs)))
        return n


def make_wire_client(replica: WireReplica) -> Any:
    """The real `StageEngineCoreClient` class, built without its constructor (see WireReplica)."""
    import asyncio

    from vllm.v1.serial_utils import MsgpackEncoder
    from vllm_omni.engine.stage_engine_core_client import StageEngineCoreClient

    class WireStageClient(StageEngineCoreClient):
        def _send_input_message(self, message: Any, engine: Any) -> Any:
            self.ensure_alive()
            replica.deliver(message)

            async def sent() -> None:
                await asyncio.sleep(replica.send_delay() if replica.send_delay else 0)

            return sent()

        def _ensure_output_queue_task(self) -> None:
            pass  # the task reading a real EngineCore's output socket

    client = object.__new__(WireStageClient)
    InertStageClient.__init__(client, replica.replica_id)
    client.stage_id = 0
    client.vllm_config = replica.vllm_config
    client.encoder = MsgpackEncoder()
    client.client_index = 0
    client.core_engine = (0).to_bytes(2, "little")
    client.resources = SimpleNamespace(engine_dead=False, engine_manager=None)
    client._finalizer = SimpleNamespace(detach=lambda: None)  # nothing to clean up
    client.outputs_queue = asyncio.Queue()
    return client
