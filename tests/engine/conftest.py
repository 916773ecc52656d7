"""Engine tier: the real vllm 0.30.0 / vllm-omni 0.30.0 packages on the CPU.

Shared fixtures for every engine-tier test module (keep them generic):

* the process environment every engine test needs (loopback only, offline hub, the plugin
  allow-list), set at import time, before anything imports vLLM;
* `engine_patches`: this project's patches applied once per session through vLLM's real plugin
  loader (`vllm.plugins.load_general_plugins` with `VLLM_PLUGINS` naming our entry point), so
  `OMNISTAGE_DISABLE_PATCHES=name` in the environment of the pytest run switches a patch off for
  the whole run; that is how the negative controls run;
* `tiny_model_dirs` / `make_vllm_config`: real `ModelConfig` / `VllmConfig` objects for a tiny
  multimodal model (Qwen2-VL architecture) and a tiny text-only model (Qwen2). Nothing is mocked:
  the test writes a real Hugging Face checkpoint directory *without weights* (config.json, a
  byte-level BPE tokenizer, the real Qwen2-VL image processor config, a chat template; built by
  tests/support/tiny_models.py), so vLLM's own config, tokenizer, processor and renderer code load
  it exactly as they would a downloaded model. No test here loads weights or runs a forward pass;
* small helpers for distinct images and data URLs (the chat path fetches `data:` URLs locally).

Every test in this directory gets the `engine` marker; the tier is skipped (with the reason)
only when vllm_omni cannot be imported.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import itertools
import os
import tempfile
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.tiny_models import build_tiny_multimodal_model, build_tiny_text_model

# ---- process environment (before any vLLM import) -------------------------------------------
# Loopback only: vLLM's get_ip() would otherwise probe a route with a UDP socket to a public
# address. Force it, whatever the caller's environment says.
os.environ["VLLM_HOST_IP"] = "127.0.0.1"
# No hub traffic: tiny models are local directories; a missing file must fail, not download.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["VLLM_NO_USAGE_STATS"] = "1"
os.environ["DO_NOT_TRACK"] = "1"
# Plugins loaded by vLLM's loader: ours, and vllm-omni's own registration (which must be listed
# whenever VLLM_PLUGINS is set). Engine-tier modules that need more may extend ENGINE_PLUGINS.
ENGINE_PLUGINS = ["omnistage_engine_patches", "vllm_omni_register_models"]
_listed = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys(_listed + ENGINE_PLUGINS))
# vLLM names its shared-memory multimodal ring per process tree; keep test runs apart.
os.environ.setdefault("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", f"omnistage_test_{uuid.uuid4().hex[:12]}")

try:
    import vllm_omni  # noqa: F401  (its import applies vllm-omni's own class patches)

    VLLM_OMNI_IMPORT_ERROR: str | None = None
except Exception as e:  # noqa: BLE001  (ImportError, or a broken install raising anything)
    VLLM_OMNI_IMPORT_ERROR = f"{type(e).__name__}: {e}"

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Called with the whole session's items: touch only this directory's.
    skip = (
        pytest.mark.skip(
            reason=f"engine tier needs vllm_omni 0.30.0 (hack/setup.sh): {VLLM_OMNI_IMPORT_ERROR}"
        )
        if VLLM_OMNI_IMPORT_ERROR
        else None
    )
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.engine)
            if skip is not None:
                item.add_marker(skip)


# ---- patches through the real plugin path ---------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def engine_patches() -> dict[str, Any]:
    """Load the general plugins the way every vLLM process does; return the patch outcomes.

    vLLM loads plugins once per process. If something in this session already loaded them
    (before VLLM_PLUGINS named us), call the same entry point our plugin registers.
    """
    if VLLM_OMNI_IMPORT_ERROR:
        return {}
    from importlib.metadata import entry_points

    import vllm.plugins as vllm_plugins
    from omnistage_engine_patches import _patching

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert "omnistage_engine_patches" in names, (
        "the omnistage_engine_patches entry point is not installed: run hack/setup.sh (pip install -e .)"
    )
    if getattr(vllm_plugins, "plugins_loaded", False):
        import omnistage_engine_patches

        omnistage_engine_patches.apply()
    else:
        vllm_plugins.load_general_plugins()
    return _patching.outcomes()


@pytest.fixture(autouse=True)
def shm_ring_name(monkeypatch: pytest.MonkeyPatch):
    """One SHM ring name per test, unlinked afterwards. vLLM's SHM sender creates the ring under
    the name in the environment and unlinks it only when it is garbage-collected: a sender kept
    alive by a reference cycle made the next test's sender fail with FileExistsError (CI), or
    unlinked a later test's ring of the same name when it was finally collected."""
    name = f"omnistage_test_{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME", name)
    yield name
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/{name}")


_BLOCKS = Path(tempfile.gettempdir()) / "omnistage-engine-blocks"
_HELD: list[Any] = []  # the claimed block's lock, held for the life of this process (and its children)


def _claim_block() -> int:
    """One of 50 address blocks that no other process on this machine holds: a lock file, held until
    the process ends. The pid modulo 50 alone let two concurrent runs share one (make test's engine
    tier beside its negative controls: EADDRINUSE on a head's master port)."""
    _BLOCKS.mkdir(exist_ok=True)
    for k in range(50):
        n = (os.getpid() + k) % 50
        f = open(_BLOCKS / f"{n}.lock", "w")  # noqa: SIM115 -- held open for the life of the process
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            continue
        _HELD.append(f)
        return n
    raise RuntimeError(f"all 50 engine-tier address blocks are held ({_BLOCKS}): 50 engine-tier runs at once?")


def _loopback_addresses():
    """Loopback "pod IPs" (any 127/8 address binds on Linux without configuration), one sequence for
    every engine-tier module of this process, so no two of them hand out the same address; a /16
    (127.76) no cluster test uses, four /24 blocks per process, claimed, so parallel runs never meet."""
    first = _claim_block() * 4 + 1
    for i in itertools.count():
        yield f"127.76.{first + i // 254}.{i % 254 + 1}"


_LOOPBACK = _loopback_addresses()


def loopback_ip() -> str:
    return next(_LOOPBACK)


def patch_applied(name: str) -> bool:
    """Whether the named patch is in effect in this test process."""
    from omnistage_engine_patches import _patching

    outcome = _patching.outcomes().get(name)
    return bool(outcome and outcome.applied)


# ---- tiny real models (no weights): tests/support/tiny_models.py ----------------------------
@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if VLLM_OMNI_IMPORT_ERROR:
        pytest.skip(f"engine tier needs vllm_omni: {VLLM_OMNI_IMPORT_ERROR}")
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "multimodal": build_tiny_multimodal_model(root / "tiny-qwen2-vl"),
        "text": build_tiny_text_model(root / "tiny-qwen2"),
    }


@pytest.fixture(scope="session")
def make_vllm_config(tiny_model_dirs: dict[str, Path]):
    """Factory: `make_vllm_config("multimodal" | "text", **model_config_kwargs) -> VllmConfig`.

    Model-config keyword arguments are vLLM's own (e.g. `mm_processor_cache_gb=0`,
    `mm_processor_cache_type="shm"`). The device is the CPU (no accelerator here), and
    `parallel_config` keyword arguments go to vLLM's `ParallelConfig`.
    """
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    def make(kind: str = "multimodal", *, parallel: dict[str, Any] | None = None, **model_kwargs: Any):
        model_kwargs.setdefault("max_model_len", 1024)
        model_kwargs.setdefault("dtype", "float32")
        model_config = ModelConfig(model=str(tiny_model_dirs[kind]), **model_kwargs)
        return VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig(device="cpu"),
            parallel_config=ParallelConfig(**(parallel or {})),
        )

    return make


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


@pytest.fixture
def build_stage0_engine(monkeypatch: pytest.MonkeyPatch):
    """Factory fixture around `stage0_engine_builder` (function scope: the stand-in runtime is
    undone after each test)."""
    return stage0_engine_builder(monkeypatch)


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
