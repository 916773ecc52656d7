"""The price of the processor-only (and replica-aware) stage-0 cache: a benchmark that prints figures, asserts nothing.

What it measures, per cell (modality x workload x mode x stage-0 replicas x routing policy):

* bytes encoded per request toward replicas: the frames vLLM's `MsgpackEncoder` produces for the
  engine-core request (what the head sends a replica over ZMQ, less ZMQ's 1-byte request-type and
  routing-identity frames);
* frontend CPU per request: `time.process_time()` (the whole process, all threads) around the
  frontend's part: render + build request (once per mode and workload, see "shared frontend"),
  plus route + encode (per cell);
* frontend cache memory at the end of the workload: the cache's own size accounting
  (`LRUCache.currsize`) and, separately, the tensor bytes it really holds (a sender cache accounts
  the size of every item it shadows but holds only metadata);
* cache misses and stale features per 1,000 requests: a request fails when the replica's receiver
  raises `MultiModalCacheMissError`; it is stale when any feature the replica would feed the
  encoder (after its receiver cache) differs from the tensor the frontend processed for that
  media (compared with `torch.equal`).

Modes: `lru` on one static replica (vLLM's sender cache, built by vllm-omni for a static head
with one stage-0 replica; the reference every ratio is taken against), `processor-only` (what the
operator renders whenever membership can change; built by this project's plugin on a distributed
head), `disabled` (`mm_processor_cache_gb: 0`: no frontend and no receiver cache), and, as a
negative control, `lru-unpatched`: that same sender-cache frontend's requests routed to 2 or 4
replicas, which is what vllm-omni 0.30.0 does without the plugin (no retry and no invalidation on
a miss: vllm-omni ignores `mm_cache_miss_hashes`). Its errors show that the error columns can see
errors. `replica-aware` (opt-in, issue 11 section 2): the processor-only frontend built with the
operator's `OMNISTAGE_FRONTEND_CACHE=replica-aware`; in its cells each replica sits behind a real
head-side `StageEngineCoreClient` (engine_stack's `WireReplica`: constructor, ZMQ socket and EngineCore
process stood in), so the plugin strips per replica inside the client's real `add_request_async`,
the client's own `MsgpackEncoder` encodes, and misses come back through its `get_output_async`
(vLLM's `_handle_mm_cache_miss`). Its extra figures: the mirrors' memory, misses re-sent in full,
and the items sent in full against the floor of the routing (distinct replica x media pairs).
replica-aware also runs with the policies `round-robin+affinity` and `least-queue-length+affinity`:
the same balancer, but each request enters through the real `StagePool.submit_initial`, which the
`replica_affinity` patch wraps (stage 0 prefers the replica whose mirror holds most of the
request's media, within a load bound; the balancer decides when nobody holds anything). Its load
figure is the head's bindings: in every replica-aware cell a request's binding is released when
the request finishes on the virtual clock below (the orchestrator's `release_bindings`), which
round robin and least-queue-length do not read. After the main table a second one sets
replica-aware against processor-only, cell by cell (an affinity policy against its balancer's
processor-only cell), with the load balance: requests per replica, their max/min, and the largest
gap in requests in flight between two replicas seen at any routing.

Workloads (each `--requests` requests, 40 by default): `multi-turn` (`--requests / --turns`
users, 5 turns each, interleaved in a shuffled order each round; turn k carries k media items:
the k-1 of its earlier turns plus one new one), `multi-turn-20` (the same with 20 turns and
`--long-users` users, 4 by default: 80 requests; by default audio only, `--long-modalities`: with
images each processor-only request would encode ~64 MB), `repeated` (each request a new user with
one item drawn from 5 popular items, skewed), `all-new` (each request one item never seen
before). Each workload runs once with images and once with audio.

Real (nothing mocked):
* vLLM 0.30.0 and vllm-omni 0.30.0 code: the stage-0 frontend built by vllm-omni's
  `OmniEngineBase._initialize_stages` with this project's plugin loaded through vLLM's plugin
  loader (tests/support/engine_stack.py's `stage0_engine_builder`); requests take the
  `/v1/chat/completions` path: `renderer.render_chat_async` (data-URL decoding, HF processing,
  hashing, the frontend cache) -> `AsyncOmniEngine._build_add_request_message` -> a real
  `StagePool` picks the replica (distributed mode: `pick` with vllm-omni's `RoundRobinBalancer` or
  `LeastQueueLengthBalancer`; the static reference: `select_replica_id`) -> vLLM's
  `MsgpackEncoder` encodes the `OmniEngineCoreRequest` -> the frames are copied into replica-owned
  buffers (the wire) -> vLLM's `MsgpackDecoder(OmniEngineCoreRequest)` (what a vllm-omni replica
  decodes) -> the replica's receiver cache from `engine_receiver_cache_from_config`
  (engine_stack's `Replica`, fed `mm_features` as `EngineCore.preprocess_add_request` does);
* the cache classes (`MultiModalProcessorSenderCache`, `MultiModalProcessorOnlyCache`,
  `MultiModalReceiverCache`) and their size accounting;
* the processors and item sizes: a 1000x1000 JPEG (1.0 megapixel) through the real
  `Qwen2VLImageProcessor` of a tiny weightless Qwen2-VL checkpoint (tests/support/tiny_models.py's
  `build_tiny_multimodal_model`, its `max_pixels` raised to the released Qwen2-VL checkpoints'
  12845056 so the image is processed at full size: 72x72 patches of 14 px), and a 30 s 16 kHz
  WAV through the real `WhisperFeatureExtractor` (128 mel bins, Qwen2-Audio's settings) of a tiny
  weightless Qwen2-Audio checkpoint written here (`Qwen2AudioProcessor`, vLLM's
  `Qwen2AudioForConditionalGeneration` processing). No weights, no downloads (offline hub).

Stood in:
* the stage runtime and the replicas' head-side clients (engine_stack's `InertStageRuntime` /
  `InertStageClient`: nothing launches an EngineCore); a replica is its decoder plus its
  receiver cache, in this process; no ZMQ socket is opened and no network is used at all;
* the coordinator hub (`get_replicas_for_stage`) and the replicas' load: least-queue-length
  needs each replica's `queue_length`, which a vllm-omni replica reports as its scheduler's
  unfinished requests in a heartbeat every 5 s. Simulated here on a virtual clock: Poisson
  arrivals sized so that each replica would have 4 requests in flight on average, except that a
  conversation's next turn arrives only once the answer to its previous turn is complete (the
  clock waits for it: with few conversations fewer requests are in flight); a request stays
  unfinished for 2.0 s (about 100 output tokens at 20 ms) plus its prompt tokens / 10,000 per s
  of prefill (continuous batching: no queueing delay); each replica samples its count every
  5 s (heartbeats staggered across replicas) and the hub shows the last sample. Ties go to
  `random.choice`, as in vllm-omni, seeded per cell. Round robin ignores the load. With 40
  requests arriving within a few heartbeats, the stale samples make least-queue-length herd onto
  the replica whose last sample was lowest (the per-replica request counts are printed): that
  follows from the 5 s heartbeat at this arrival rate, and is left as it is;
* the shared frontend: the frontend of these modes never looks at the routing (the cache
  decision is taken before a replica is chosen; that is the defect the plugin fixes), so one
  real frontend per mode x workload renders every request once, and each routing cell (its own
  `StagePool`, balancer, encoder and replicas) receives the same rendered requests. The render
  CPU is that frontend's; route + encode CPU is measured in each cell;
* the time model above and the client (data URLs are made here before the clock starts).

Usage (from the repo root; several minutes on 2 cores; progress is printed):

  python tests/bench/bench_cache.py [--requests 40] [--turns 5] [--modalities image,audio]
                                    [--long-users 4] [--long-modalities audio]
                                    [--out /tmp/omnistage-bench]

A quick subset: `--modalities audio --requests 10 --long-users 1`.

It prints the table, writes `cache.svg` (the plot, hand-written SVG: matplotlib is not a
dependency; also `cache.png` when `rsvg-convert` is on PATH), `cache.md` (the table as Markdown)
and `cache.json` (every figure) into `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import gc
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

START = (time.monotonic(), time.process_time())  # before vLLM's import: the run time includes it
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # runnable as a script: `python tests/bench/bench_cache.py`

# The engine tier's process environment (loopback only, offline hub, the plugin allow-list) is
# set when engine_env is imported, before anything imports vLLM: import it first.
from tests.support import engine_env, engine_stack, tiny_models

MODES = ("lru", "lru-unpatched", "processor-only", "replica-aware", "disabled")
REPLICAS = (1, 2, 4)
POLICIES = ("round-robin", "least-queue-length")
#: replica-aware only: the same balancer, with the `replica_affinity` patch steering stage 0.
AFFINITY = "+affinity"
AFFINITY_POLICIES = tuple(p + AFFINITY for p in POLICIES)
WORKLOADS = ("multi-turn", "multi-turn-20", "repeated", "all-new")
TURNS = 5  # multi-turn: turns per conversation
LONG_TURNS = 20  # multi-turn-20: turns per conversation (`--long-users` users)
POPULAR = 5  # repeated: size of the popular pool
MAX_TOKENS = 100
# The simulated load behind least-queue-length (see the docstring).
DECODE_S = 2.0
PREFILL_TOKENS_PER_S = 10_000.0
IN_FLIGHT_PER_REPLICA = 4.0
HEARTBEAT_S = 5.0
MB = 1e6


def log(msg: str) -> None:
    print(f"[bench-cache {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- tiny local checkpoints --------------------------------------------------------------------
def build_image_model(out: Path) -> Path:
    """The tiny Qwen2-VL checkpoint (tests/support/tiny_models.py) with the released checkpoints'
    pixel limits."""
    tiny_models.build_tiny_multimodal_model(out)
    # transformers 5 keeps the image processor in processor_config.json, older versions in
    # preprocessor_config.json: raise max_pixels (size.longest_edge) wherever it is.
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = out / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        proc = data.get("image_processor", data)
        proc.setdefault("size", {})
        proc["size"].update({"longest_edge": 12845056, "shortest_edge": 3136})
        for key in ("max_pixels", "min_pixels"):
            proc.pop(key, None)
        path.write_text(json.dumps(data, indent=1))
    _lift_context(out / "config.json")
    return out


AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
AUDIO_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'audio' %}<|audio_bos|><|AUDIO|><|audio_eos|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def build_audio_model(out: Path) -> Path:
    """A Qwen2-Audio-architecture checkpoint without weights: the tiny tokenizer plus the audio
    tokens, Qwen2-Audio's feature extractor settings (Whisper, 128 mel bins, 30 s at 16 kHz)."""
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    out.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = tiny_models.tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": tiny_models.SPECIAL_TOKENS[1:] + AUDIO_TOKENS})
    tokenizer.chat_template = AUDIO_CHAT_TEMPLATE
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, chunk_length=30),
        tokenizer=tokenizer,
        chat_template=AUDIO_CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    vocab = tokenizer.get_vocab()
    text = {**tiny_models.text_config(len(vocab)), "model_type": "qwen2", "vocab_size": len(tokenizer)}
    config = {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_token_index": vocab["<|AUDIO|>"],
        "vocab_size": len(tokenizer),
        "text_config": text,
        "audio_config": {
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "d_model": 32,
            "max_source_positions": 1500,
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    _lift_context(out / "config.json")
    return out


def _lift_context(config_json: Path) -> None:
    """Room for five 1 MP images in one prompt (the tiny text configs stop at 2048 positions)."""
    data = json.loads(config_json.read_text())
    for cfg in (data, data.get("text_config")):
        if isinstance(cfg, dict) and "max_position_embeddings" in cfg:
            cfg["max_position_embeddings"] = 32768
    config_json.write_text(json.dumps(data, indent=1))


def make_vllm_config(model_dir: Path, **model_kwargs: Any) -> Any:
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=str(model_dir), max_model_len=32768, dtype="float32", **model_kwargs)
    return VllmConfig(
        model_config=model_config, device_config=DeviceConfig(device="cpu"), parallel_config=ParallelConfig()
    )


# ---- media (the client side, made before any clock starts) ------------------------------------
class Media:
    def __init__(self) -> None:
        import numpy as np

        self._np = np
        yy, xx = np.mgrid[0:1000, 0:1000]
        self._gradient = np.stack([xx * 255 // 999, yy * 255 // 999, (xx + yy) * 255 // 1998], -1)
        self._t = np.arange(30 * 16000) / 16000.0
        self._urls: dict[tuple[str, int], str] = {}

    def url(self, modality: str, mid: int) -> str:
        key = (modality, mid)
        if key not in self._urls:
            self._urls[key] = self._image(mid) if modality == "image" else self._audio(mid)
        return self._urls[key]

    def _image(self, mid: int) -> str:
        """1000x1000 RGB, a distinct gradient with photo-like noise, JPEG quality 90 (~0.45 MB)."""
        from PIL import Image

        np = self._np
        rng = np.random.default_rng(mid)
        pixels = (self._gradient + np.array([37, 91, 53]) * mid) % 256 + rng.normal(0, 12, self._gradient.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()

    def _audio(self, mid: int) -> str:
        """30 s of 16 kHz mono PCM16 WAV, a distinct tone with a slow envelope and noise (~0.96 MB)."""
        import soundfile

        np = self._np
        rng = np.random.default_rng(10_000 + mid)
        t = self._t
        wave = 0.3 * np.sin(2 * np.pi * (180 + 7 * mid) * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 0.3 * t))
        wave = wave + 0.02 * rng.standard_normal(t.shape)
        buf = io.BytesIO()
        soundfile.write(buf, wave.astype(np.float32), 16000, format="WAV", subtype="PCM_16")
        return "data:audio/wav;base64," + base64.b64encode(buf.getvalue()).decode()


def media_part(modality: str, url: str) -> dict[str, Any]:
    if modality == "image":
        return {"type": "image_url", "image_url": {"url": url}}
    return {"type": "audio_url", "audio_url": {"url": url}}


PROMPT = {"image": "describe the image", "audio": "what is in this"}


@dataclass
class WorkloadRequest:
    user: int
    media: list[int]  # media ids, in prompt order
    messages: list[dict[str, Any]]


def workload(name: str, modality: str, n: int, media: Media, turns: int = TURNS) -> list[WorkloadRequest]:
    def user_turn(mid: int) -> dict[str, Any]:
        return {"role": "user", "content": [media_part(modality, media.url(modality, mid)),
                                            {"type": "text", "text": PROMPT[modality]}]}

    out: list[WorkloadRequest] = []
    if name.startswith("multi-turn"):
        users = max(1, n // turns)
        rng = random.Random(5)
        for k in range(1, turns + 1):  # interleaved: every user's turn k before anyone's turn k+1
            # Users answer in a different order each round: with a fixed order and a user count
            # divisible by the replica count, round robin would pin each user to one replica.
            for u in rng.sample(range(users), users):
                mids = [u * turns + j for j in range(k)]
                messages: list[dict[str, Any]] = []
                for j, mid in enumerate(mids):
                    messages.append(user_turn(mid))
                    if j < k - 1:
                        messages.append({"role": "assistant", "content": "a b c"})
                out.append(WorkloadRequest(u, mids, messages))
    elif name == "repeated":
        rng = random.Random(7)
        weights = [0.4, 0.25, 0.15, 0.12, 0.08]
        for u in range(n):
            mid = 1000 + rng.choices(range(POPULAR), weights)[0]
            out.append(WorkloadRequest(u, [mid], [user_turn(mid)]))
    else:
        for u in range(n):
            out.append(WorkloadRequest(u, [2000 + u], [user_turn(2000 + u)]))
    return out


# ---- the frontend: a real stage-0 engine -------------------------------------------------------
FRONTEND = {
    # mode: (distributed head?, model kwargs, the cache class the frontend must hold)
    "lru": (False, {}, "MultiModalProcessorSenderCache"),
    "processor-only": (True, {}, "MultiModalProcessorOnlyCache"),
    # The operator's OMNISTAGE_FRONTEND_CACHE=replica-aware: the same processor-only frontend, plus
    # the plugin's per-replica dispatch (switched on when this frontend is built).
    "replica-aware": (True, {}, "MultiModalProcessorOnlyCache"),
    "disabled": (True, {"mm_processor_cache_gb": 0}, "NoneType"),
}


@dataclass
class Rendered:
    request_id: str
    request: Any  # the OmniEngineCoreRequest the head would send
    media: list[int]
    tokens: int
    cpu_s: float
    user: int  # the conversation (multi-turn) or the one-off user


@dataclass
class FrontendRun:
    mode: str
    vllm_config: Any
    rendered: list[Rendered]
    cache_acct: int  # the cache's own accounting (LRUCache.currsize)
    cache_held: int  # tensor bytes the cache really holds
    cache_class: str


def build_frontend(model_dir: Path, mode: str) -> tuple[Any, Any]:
    import pytest
    from omnistage_engine_patches import contract

    distributed, kwargs, expected = FRONTEND[mode]
    vllm_config = make_vllm_config(model_dir, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        if mode == contract.CACHE_REPLICA_AWARE:  # only an operator asks for it (opt-in)
            mp.setenv(contract.FRONTEND_CACHE_ENV, mode)
        engine = engine_stack.stage0_engine_builder(mp)(vllm_config, replicas=1, distributed=distributed)
    got = type(engine.input_processor.renderer.mm_processor_cache).__name__
    if got != expected:
        raise SystemExit(f"{mode}: the stage-0 frontend holds {got}, expected {expected} "
                         "(is the frontend_cache patch disabled, or OMNISTAGE_FRONTEND_CACHE set?)")
    return engine, vllm_config


def cache_figures(cache: Any) -> tuple[int, int]:
    from vllm.multimodal.cache import MultiModalCache, MultiModalProcessorCacheItem

    if cache is None:
        return 0, 0
    lru = cache._cache
    held = sum(
        MultiModalCache.get_item_size(v.item)
        for v in lru.cache.values()
        if isinstance(v, MultiModalProcessorCacheItem)
    )
    return int(lru.currsize), int(held)


async def run_frontend(model_dir: Path, mode: str, requests: list[WorkloadRequest], label: str) -> FrontendRun:
    from vllm import SamplingParams
    from vllm.renderers.params import ChatParams

    engine, vllm_config = build_frontend(model_dir, mode)
    renderer = engine.input_processor.renderer
    rendered: list[Rendered] = []
    for i, req in enumerate(requests):
        request_id = f"chatcmpl-{i}"
        start = time.process_time()
        (_conversation,), (prompt,) = await renderer.render_chat_async([req.messages], ChatParams())
        msg = engine._build_add_request_message(
            request_id, prompt, sampling_params_list=[SamplingParams(max_tokens=MAX_TOKENS)]
        )
        cpu = time.process_time() - start
        rendered.append(Rendered(request_id, msg.prompt, req.media, len(msg.prompt.prompt_token_ids), cpu, req.user))
        if (i + 1) % 10 == 0 or i + 1 == len(requests):
            log(f"  {label} {mode}: rendered {i + 1}/{len(requests)}")
    acct, held = cache_figures(renderer.mm_processor_cache)
    cls = type(renderer.mm_processor_cache).__name__
    return FrontendRun(mode, vllm_config, rendered, acct, held, cls)


# ---- the replicas' load, for least-queue-length ------------------------------------------------
class SimulatedHub:
    """Stands in for vllm-omni's `OmniCoordClientForHub` (see the module docstring)."""

    def __init__(self, addrs: list[str], rendered: list[Rendered], seed: int) -> None:
        self.addrs = addrs
        self.service = [DECODE_S + r.tokens / PREFILL_TOKENS_PER_S for r in rendered]
        mean = sum(self.service) / len(self.service)
        rate = IN_FLIGHT_PER_REPLICA * len(addrs) / mean
        rng = random.Random(seed)
        t, self.arrivals = 0.0, []
        answered: dict[int, float] = {}  # user -> when its last request finishes
        for r, service in zip(rendered, self.service):
            # A user sends its next turn only after the answer to the previous one: the clock
            # waits for it (requests keep their workload order, so time never runs backwards).
            t = max(t + rng.expovariate(rate), answered.get(r.user, 0.0))
            self.arrivals.append(t)
            answered[r.user] = t + service
        self.now = 0.0
        self.assigned: list[tuple[str, float, float]] = []  # (addr, start, end)
        self.phase = {a: i * HEARTBEAT_S / len(addrs) for i, a in enumerate(addrs)}

    def at(self, i: int) -> None:
        self.now = self.arrivals[i]

    def assign(self, i: int, addr: str) -> None:
        self.assigned.append((addr, self.arrivals[i], self.arrivals[i] + self.service[i]))

    def _reported(self, addr: str) -> int:
        beats = (self.now - self.phase[addr]) // HEARTBEAT_S
        if beats < 0:
            return 0  # registered with an empty queue, no heartbeat yet
        sample = self.phase[addr] + beats * HEARTBEAT_S
        return sum(1 for a, s, e in self.assigned if a == addr and s <= sample < e)

    def get_replicas_for_stage(self, stage_id: int) -> Any:
        from vllm_omni.distributed.omni_coordinator.messages import ReplicaInfo, ReplicaList, ReplicaStatus

        reps = [
            ReplicaInfo(
                input_addr=a, output_addr=a.replace("tcp://", "tcp://out-"), stage_id=stage_id,
                status=ReplicaStatus.UP, queue_length=self._reported(a), last_heartbeat=self.now,
                registered_at=0.0,
            )
            for a in self.addrs
        ]
        return ReplicaList(replicas=reps, timestamp=self.now)


# ---- a routing cell ----------------------------------------------------------------------------
@dataclass
class Cell:
    modality: str
    workload: str
    mode: str
    replicas: int
    policy: str
    requests: int = 0
    bytes_total: int = 0
    render_cpu_s: float = 0.0
    route_encode_cpu_s: float = 0.0
    cache_acct: int = 0
    cache_held: int = 0
    misses: int = 0
    stale: int = 0
    items_sent: int = 0
    items_omitted: int = 0
    receiver_bytes: int = 0  # sum over replicas of their receiver caches' accounting
    mirror_bytes: int = 0  # replica-aware: the frontend's per-replica mirrors (keys and sizes), estimated
    misses_resent: int = 0  # replica-aware: misses the head re-sent in full (not failed)
    floor_items: int = 0  # the fewest full items any cache could send with this routing: distinct (replica, media)
    per_replica: list[int] = field(default_factory=list)
    peak_in_flight_skew: int = 0  # replica-aware: the largest (max - min) of in-flight requests at any routing
    steering: dict[str, int] = field(default_factory=dict)  # replica-aware + affinity: replica_affinity.STATS
    ref_bytes: float | None = None
    ref_cpu_ms: float | None = None

    @property
    def balance(self) -> str:
        """Requests per replica, most over fewest (1.00: even; inf: a replica got none)."""
        if not self.per_replica:
            return "-"
        return f"{max(self.per_replica) / min(self.per_replica):.2f}" if min(self.per_replica) else "inf"

    @property
    def bytes_per_req(self) -> float:
        return self.bytes_total / max(1, self.requests)

    @property
    def cpu_ms_per_req(self) -> float:
        return 1000 * (self.render_cpu_s + self.route_encode_cpu_s) / max(1, self.requests)

    @property
    def misses_per_1k(self) -> float:
        return 1000 * self.misses / max(1, self.requests)

    @property
    def stale_per_1k(self) -> float:
        return 1000 * self.stale / max(1, self.requests)


def same_features(used: Any, truth: Any) -> bool:
    import torch

    if used is None or set(used.keys()) != set(truth.keys()):
        return False
    for key in truth:
        a, b = used[key].data, truth[key].data
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or not torch.equal(a, b):
                return False
        elif a != b:
            return False
    return True


def in_flight_skew(pool: Any, replicas: int) -> int:
    """Most minus fewest requests in flight per replica, by the head's bindings (affinity's load)."""
    from omnistage_engine_patches.patches import replica_affinity

    load = replica_affinity.in_flight(pool)
    return max(load[r] for r in range(replicas)) - min(load[r] for r in range(replicas))


def mirror_footprint(d: Any) -> int:
    """Python memory of the replica-aware mirrors: per entry its key, its metadata object and the
    LRU's bookkeeping (an estimate with sys.getsizeof; they hold no tensors)."""
    total = 0
    for mirror in list(d._mirrors.values()):
        for key, meta in mirror._cache.cache.items():
            total += sys.getsizeof(key) + sys.getsizeof(meta) + sys.getsizeof(vars(meta)) + 3 * 8 + 100
    return total


def balancer(policy: str) -> Any:
    """vllm-omni's balancer that `--omni-lb-policy` names (an affinity policy: its fallback)."""
    from vllm_omni.distributed.omni_coordinator.load_balancer import (
        LeastQueueLengthBalancer,
        RoundRobinBalancer,
    )

    return RoundRobinBalancer() if policy.startswith("round-robin") else LeastQueueLengthBalancer()


class Bindings:
    """The head's stage-0 bindings live until the request finishes on the virtual clock (the
    orchestrator's `release_bindings`): they are the in-flight load `replica_affinity` bounds.
    Round robin and least-queue-length do not read them."""

    def __init__(self, pool: Any, hub: SimulatedHub) -> None:
        self.pool, self.hub, self.ends = pool, hub, []

    def finish_until(self, now: float) -> None:
        keep = []
        for end, request_id in self.ends:
            if end <= now:
                self.pool.release_binding(request_id)
            else:
                keep.append((end, request_id))
        self.ends = keep

    def started(self, i: int, request_id: str) -> None:
        self.ends.append((self.hub.arrivals[i] + self.hub.service[i], request_id))


async def route(pool: Any, policy: str, request_id: str, request: Any) -> int:
    """Upstream's routing: `pick`, then the chosen client's `add_request_async` (submit_initial's
    route and tail, without the affinity wrapper); an affinity policy enters through the real,
    wrapped `StagePool.submit_initial`."""
    if policy.endswith(AFFINITY):
        return await pool.submit_initial(request_id, engine_stack.stand_in_request_state(MAX_TOKENS), request)
    rid = await pool.pick(request_id)
    await pool._llm_client(rid).add_request_async(request)
    return rid


async def run_replica_aware_cell(cell: Cell, fe: FrontendRun, truth: dict[int, Any], seed: int) -> Cell:
    """The replica-aware cell: each replica behind a real head-side `StageEngineCoreClient`
    (engine_stack's `WireReplica`); the plugin's wrapper strips per replica before the client's own
    `MsgpackEncoder` encodes; outputs (and misses) come back through `get_output_async`. An
    affinity cell routes through the real `StagePool.submit_initial` (the `replica_affinity`
    wrapper), with the orchestrator's output processor and request state stood in."""
    from omnistage_engine_patches.patches import replica_affinity, replica_aware_cache
    from vllm.v1.engine import FinishReason
    from vllm_omni.engine.stage_pool import StagePool

    dispatch = replica_aware_cache.dispatch()
    if dispatch is None:
        raise SystemExit("replica-aware: the dispatch is not live (is the replica_aware_cache patch disabled?)")
    replicas = {i: engine_stack.WireReplica(fe.vllm_config, i) for i in range(cell.replicas)}
    clients = [replicas[i].client for i in range(cell.replicas)]
    pool = StagePool(0, clients, output_processor=engine_stack.StandInOutputProcessor(),
                     stage_vllm_config=fe.vllm_config)
    hub = SimulatedHub([c.client_addresses["input_address"] for c in clients], fe.rendered, seed)
    pool.attach_hub(hub)
    pool.attach_load_balancer(balancer(cell.policy))
    bindings = Bindings(pool, hub)
    random.seed(seed)
    cell.per_replica = [0] * cell.replicas
    cell.cache_acct, cell.cache_held = fe.cache_acct, fe.cache_held
    before, steering = dispatch.stats.copy(), replica_affinity.STATS.copy()
    served: set[tuple[int, int]] = set()
    for i, r in enumerate(fe.rendered):
        hub.at(i)
        bindings.finish_until(hub.now)
        rep = replicas
        start = time.process_time()
        wire0 = sum(x.wire_bytes for x in rep.values())
        rid = await route(pool, cell.policy, r.request_id, r.request)
        cell.route_encode_cpu_s += time.process_time() - start
        cell.peak_in_flight_skew = max(cell.peak_in_flight_skew, in_flight_skew(pool, cell.replicas))
        bindings.started(i, r.request_id)
        cell.render_cpu_s += r.cpu_s
        cell.requests += 1
        cell.per_replica[rid] += 1
        cell.bytes_total += sum(x.wire_bytes for x in rep.values()) - wire0
        hub.assign(i, clients[rid].client_addresses["input_address"])
        served.update((rid, m) for m in r.media)
        failed = False
        while rep[rid].drain() or not rep[rid].client.outputs_queue.empty():
            while not rep[rid].client.outputs_queue.empty():
                outputs = await rep[rid].client.get_output_async()  # misses are handled in here
                failed |= any(o.finish_reason == FinishReason.ERROR for o in outputs.outputs)
        if failed:
            cell.misses += 1
        else:
            used = rep[rid].used[r.request_id]
            if any(not same_features(f.data, truth[m]) for f, m in zip(used, r.media, strict=True)):
                cell.stale += 1
    bindings.finish_until(math.inf)
    cell.steering = dict(replica_affinity.STATS - steering)
    delta = dispatch.stats - before
    cell.items_sent, cell.items_omitted = delta["items_sent"], delta["items_omitted"]
    cell.misses_resent = delta["misses_resent"]
    cell.floor_items = len(served)
    cell.mirror_bytes = mirror_footprint(dispatch)
    for rep_ in replicas.values():
        if rep_.cache is not None:
            cell.receiver_bytes += int(rep_.cache._cache.currsize)
        dispatch.drop(rep_.client, "end of the cell")
    return cell


async def run_cell(cell: Cell, fe: FrontendRun, truth: dict[int, Any], seed: int) -> Cell:
    from vllm.multimodal.cache import MultiModalCacheMissError
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm_omni.engine import OmniEngineCoreRequest
    from vllm_omni.engine.stage_pool import StagePool

    clients = [engine_stack.InertStageClient(i) for i in range(cell.replicas)]
    pool = StagePool(0, clients, stage_vllm_config=fe.vllm_config)
    hub = None
    if cell.policy != "static":  # a distributed head: hub + the balancer --omni-lb-policy names
        hub = SimulatedHub([c.client_addresses["input_address"] for c in clients], fe.rendered, seed)
        pool.attach_hub(hub)
        pool.attach_load_balancer(balancer(cell.policy))
    random.seed(seed)  # LeastQueueLengthBalancer breaks ties with random.choice
    replicas = {i: engine_stack.Replica(fe.vllm_config, i) for i in range(cell.replicas)}
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(OmniEngineCoreRequest)
    cell.per_replica = [0] * cell.replicas
    cell.cache_acct, cell.cache_held = fe.cache_acct, fe.cache_held
    for i, r in enumerate(fe.rendered):
        if hub is not None:
            hub.at(i)
        start = time.process_time()
        rid = await pool.pick(r.request_id)
        frames = encoder.encode(r.request)
        cell.route_encode_cpu_s += time.process_time() - start
        cell.render_cpu_s += r.cpu_s
        cell.requests += 1
        cell.per_replica[rid] += 1
        cell.bytes_total += sum(memoryview(f).nbytes for f in frames)
        for feature in r.request.mm_features:
            if feature.data is None:
                cell.items_omitted += 1
            else:
                cell.items_sent += 1
        if hub is not None:
            hub.assign(i, clients[rid].client_addresses["input_address"])
        # The wire: the replica gets its own copy of every frame, then decodes as a replica does.
        received = decoder.decode([bytearray(f) for f in frames])
        try:
            features = replicas[rid].receive(received)
        except MultiModalCacheMissError:
            cell.misses += 1
        else:
            if any(not same_features(f.data, truth[m]) for f, m in zip(features, r.media, strict=True)):
                cell.stale += 1
        pool.release_binding(r.request_id)
    for rep in replicas.values():
        if rep.cache is not None:
            cell.receiver_bytes += int(rep.cache._cache.currsize)
    return cell


# ---- the run -----------------------------------------------------------------------------------
def cells_for(mode: str) -> list[tuple[int, str]]:
    if mode == "lru":
        return [(1, "static")]
    if mode == "lru-unpatched":
        return [(n, p) for n in REPLICAS if n > 1 for p in POLICIES]
    if mode == "replica-aware":
        return [(n, p) for n in REPLICAS for p in POLICIES + AFFINITY_POLICIES]
    return [(n, p) for n in REPLICAS for p in POLICIES]


def combos_for(args: argparse.Namespace) -> list[tuple[str, str, int, int]]:
    """(modality, workload, requests, turns) in run order; multi-turn-20 only for `--long-modalities`."""
    out = []
    for m in args.modalities:
        for wl in WORKLOADS:
            if wl == "multi-turn-20":
                if m in args.long_modalities:
                    out.append((m, wl, args.long_users * LONG_TURNS, LONG_TURNS))
            else:
                out.append((m, wl, args.requests, args.turns))
    return out


def seed_of(*parts: Any) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate("/".join(map(str, parts)))) % (2**31)


async def run_all(args: argparse.Namespace, model_dirs: dict[str, Path], media: Media) -> tuple[list[Cell], dict]:
    cells: list[Cell] = []
    sizes: dict[str, dict[str, Any]] = {}
    combos = combos_for(args)
    for n_combo, (modality, wl, n_requests, turns) in enumerate(combos, 1):
        label = f"[{n_combo}/{len(combos)}] {modality}/{wl}"
        requests = workload(wl, modality, n_requests, media, turns)
        log(f"{label}: {len(requests)} requests, {sum(len(r.media) for r in requests)} media items "
            f"({len({m for r in requests for m in r.media})} distinct)")
        truth: dict[int, Any] = {}
        for mode in ("disabled", "processor-only", "replica-aware", "lru"):
            fe = await run_frontend(model_dirs[modality], mode, requests, label)
            if mode == "disabled":  # no cache anywhere: what was processed is the truth
                for r in fe.rendered:
                    for f, m in zip(r.request.mm_features, r.media, strict=True):
                        truth.setdefault(m, f.data)
                if modality not in sizes:
                    sizes[modality] = item_size_report(fe.rendered[0].request)
            ref: Cell | None = None
            for cell_mode in ((mode,) if mode != "lru" else ("lru", "lru-unpatched")):
                for n, policy in cells_for(cell_mode):
                    cell = Cell(modality, wl, cell_mode, n, policy)
                    run = run_replica_aware_cell if cell_mode == "replica-aware" else run_cell
                    await run(cell, fe, truth, seed_of(modality, wl, n, policy))
                    cells.append(cell)
                    if cell_mode == "lru":
                        ref = cell
                    log(f"  {label} {cell_mode} x{n} {policy}: {cell.bytes_per_req / MB:.2f} MB/req, "
                        f"{cell.cpu_ms_per_req:.0f} ms CPU/req, misses {cell.misses}, stale {cell.stale}, "
                        f"items omitted {cell.items_omitted}/{cell.items_sent + cell.items_omitted}, "
                        f"requests per replica {cell.per_replica}"
                        + (f", steering {cell.steering}" if cell.steering else ""))
            del fe
            gc.collect()
            if ref is not None:
                for c in cells:
                    if c.modality == modality and c.workload == wl:
                        c.ref_bytes, c.ref_cpu_ms = ref.bytes_per_req, ref.cpu_ms_per_req
        del truth, requests
        gc.collect()
    return cells, sizes


def item_size_report(request: Any) -> dict[str, Any]:
    from vllm.multimodal.cache import MultiModalCache

    f = request.mm_features[0]
    return {
        "bytes": int(MultiModalCache.get_item_size(f.data)),
        "tokens": int(f.mm_position.length),
        "tensors": {k: [list(v.data.shape), str(v.data.dtype).replace("torch.", "")]
                    for k, v in f.data.items() if hasattr(v.data, "shape")},
    }


# ---- output ------------------------------------------------------------------------------------
HEADER = ("modality", "workload", "mode", "repl", "policy", "MB/req", "x lru", "CPU ms/req", "x lru",
          "cache acct MB", "held MB", "mirrors KB", "miss/1k", "resent/1k", "stale/1k")


def table_rows(cells: list[Cell]) -> list[tuple[str, ...]]:
    rows = []
    for c in cells:
        ratio = c.bytes_per_req / c.ref_bytes if c.ref_bytes else float("nan")
        cpu_ratio = c.cpu_ms_per_req / c.ref_cpu_ms if c.ref_cpu_ms else float("nan")
        rows.append((
            c.modality, c.workload, c.mode, str(c.replicas), c.policy, f"{c.bytes_per_req / MB:.3f}",
            f"{ratio:.1f}", f"{c.cpu_ms_per_req:.0f}", f"{cpu_ratio:.1f}", f"{c.cache_acct / MB:.1f}",
            f"{c.cache_held / MB:.1f}", f"{c.mirror_bytes / 1e3:.1f}",
            f"{c.misses_per_1k:.0f}", f"{1000 * c.misses_resent / max(1, c.requests):.0f}", f"{c.stale_per_1k:.0f}",
        ))
    return rows


def goal_rows(cells: list[Cell]) -> list[tuple[str, ...]]:
    """replica-aware against processor-only, same modality x workload x replicas x policy: bytes
    (goal <= 10% on multi-turn with 2 and 4 replicas), errors (goal 0) and frontend memory (goal
    <= 1.2x: the frontend cache plus the mirrors, against the frontend cache)."""
    rows = []
    for c in cells:
        if c.mode != "replica-aware":
            continue
        po = pick(cells, c.modality, c.workload, "processor-only", c.replicas, c.policy.removesuffix(AFFINITY))
        if po is None:
            continue
        mem = (c.cache_acct + c.mirror_bytes) / max(1, po.cache_acct)
        rows.append((c.modality, c.workload, str(c.replicas), c.policy,
                     f"{100 * c.bytes_per_req / po.bytes_per_req:.1f}%", f"{c.cpu_ms_per_req / po.cpu_ms_per_req:.2f}",
                     f"{mem:.4f}", str(c.misses + c.stale), str(c.misses_resent),
                     f"{c.items_sent}/{c.floor_items}", f"{100 * po_floor(cells, c) / po.bytes_per_req:.1f}%",
                     "/".join(map(str, c.per_replica)), c.balance, str(c.peak_in_flight_skew)))
    return rows


GOAL_HEADER = ("modality", "workload", "repl", "policy", "bytes vs p-o", "CPU vs p-o", "memory vs p-o", "errors",
               "resent", "full items/floor", "lru 1 replica vs p-o", "requests per replica", "max/min",
               "peak in-flight skew")


def po_floor(cells: list[Cell], c: Cell) -> float:
    """The bytes per request of lru on one static replica (each distinct item sent once): no
    cache on any number of replicas can send less."""
    ref = pick(cells, c.modality, c.workload, "lru", 1, "static")
    return ref.bytes_per_req if ref is not None else float("nan")


def print_rows(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def print_table(cells: list[Cell]) -> str:
    rows = table_rows(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADER)]
    lines = ["  ".join(h.rjust(w) if i >= 3 else h.ljust(w) for i, (h, w) in enumerate(zip(HEADER, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    prev = None
    for r in rows:
        if prev is not None and r[:2] != prev:
            lines.append("")
        prev = r[:2]
        lines.append("  ".join(v.rjust(w) if i >= 3 else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def markdown_table(cells: list[Cell]) -> str:
    rows = table_rows(cells)
    out = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" if i < 5 else "---:" for i in range(len(HEADER))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def pick(cells: list[Cell], modality: str, wl: str, mode: str, n: int, policy: str) -> Cell | None:
    for c in cells:
        if (c.modality, c.workload, c.mode, c.replicas, c.policy) == (modality, wl, mode, n, policy):
            return c
    return None


@dataclass
class Axis:
    """A panel's value axis: value -> y pixel (linear from 0, or log10)."""

    base: float  # y pixel of the axis' bottom
    height: float
    vmax: float
    log: bool
    vmin: float = 0.0

    def __post_init__(self) -> None:
        if self.log:
            self.lo = 10 ** math.floor(math.log10(max(self.vmin, 1e-6)))
            self.hi = 10 ** math.ceil(math.log10(max(self.vmax, self.lo * 10)))
            self.ticks = [self.lo * 10**k for k in range(round(math.log10(self.hi / self.lo)) + 1)]
        else:
            raw = self.vmax / 4 if self.vmax > 0 else 0.25
            mag = 10 ** math.floor(math.log10(raw))
            step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
            self.lo, self.hi = 0.0, step * math.ceil(self.vmax / step) if self.vmax > 0 else 1.0
            self.ticks = [step * k for k in range(round(self.hi / step) + 1)]

    def y(self, v: float) -> float:
        if self.log:
            v = max(v, self.lo)
            frac = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            frac = v / self.hi
        return self.base - self.height * frac


PLOT_SERIES = [
    ("lru, 1 static replica (reference)", "#4c72b0", ("lru", 1, "static")),
    ("processor-only, 2 replicas, round robin", "#dd8452", ("processor-only", 2, "round-robin")),
    ("replica-aware, 2 replicas, round robin", "#937860", ("replica-aware", 2, "round-robin")),
    ("replica-aware, 4 replicas, round robin", "#da8bc3", ("replica-aware", 4, "round-robin")),
    ("replica-aware + affinity, 2 replicas, round robin", "#8c613c", ("replica-aware", 2, "round-robin" + AFFINITY)),
    ("replica-aware + affinity, 4 replicas, round robin", "#e8a0d8", ("replica-aware", 4, "round-robin" + AFFINITY)),
    ("disabled, 2 replicas, round robin", "#55a868", ("disabled", 2, "round-robin")),
    ("lru unpatched, 2 replicas, round robin", "#c44e52", ("lru-unpatched", 2, "round-robin")),
    ("lru unpatched, 4 replicas, least queue", "#8172b3", ("lru-unpatched", 4, "least-queue-length")),
]
MEMORY_PANEL = "Frontend cache memory at the end, MB (outline: the cache's own accounting; filled: tensor bytes held)"
PLOT_PANELS = [
    ("Bytes encoded per request toward replicas (MB, log scale)", lambda c: c.bytes_per_req / MB, True),
    ("Frontend CPU per request (ms, process_time)", lambda c: c.cpu_ms_per_req, False),
    (MEMORY_PANEL, lambda c: c.cache_acct / MB, False),
    ("Requests failed by a receiver cache miss (per 1,000)", lambda c: c.misses_per_1k, False),
]


def svg_plot(cells: list[Cell], groups: list[tuple[str, str]], path: Path) -> None:
    """Four bar panels, one group per modality x workload (hand-written SVG, no plotting library)."""
    width, panel_h, top, left, right = 1180, 250, 80, 70, 20
    height = top + len(PLOT_PANELS) * (panel_h + 40) + 20
    el = [
        (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Arial, sans-serif">'),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        ('<text x="20" y="24" font-size="17" font-weight="bold">The price of processor-only on the stage-0 '
         'frontend (tests/bench/bench_cache.py)</text>'),
    ]
    lx, ly = 20, 38
    for label, color, _ in PLOT_SERIES:  # legend, wrapped
        w = 16 + 6.2 * len(label) + 18
        if lx + w > width - right:
            lx, ly = 20, ly + 18
        el.append(f'<rect x="{lx}" y="{ly}" width="12" height="12" fill="{color}"/>')
        el.append(f'<text x="{lx + 16}" y="{ly + 11}" font-size="11">{label}</text>')
        lx += w
    gw = (width - left - right) / len(groups)
    bw = gw * 0.8 / len(PLOT_SERIES)

    def label(x: float, y: float, v: float) -> None:
        txt = f"{v:.2g}" if v < 10 else f"{v:.0f}"
        el.append(f'<text x="{x:.1f}" y="{y - 3:.1f}" font-size="9" text-anchor="middle">{txt}</text>')

    for p, (title, metric, log_scale) in enumerate(PLOT_PANELS):
        y0 = top + p * (panel_h + 40)
        chosen = [[pick(cells, m, w, *spec) for _, _, spec in PLOT_SERIES] for m, w in groups]
        flat = [metric(c) for row in chosen for c in row if c is not None]
        positive = [v for v in flat if v > 0] or [1.0]
        axis = Axis(base=y0 + panel_h - 40, height=panel_h - 64, vmax=max(flat + [1e-9]), log=log_scale,
                    vmin=min(positive))
        el.append(f'<text x="{left}" y="{y0 + 14}" font-size="13" font-weight="bold">{title}</text>')
        for t in axis.ticks:
            y = axis.y(t)
            el.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#ddd"/>')
            el.append(f'<text x="{left - 6}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{t:g}</text>')
        el.append(f'<line x1="{left}" y1="{axis.base}" x2="{width - right}" y2="{axis.base}" stroke="#333"/>')
        for g, (m, w) in enumerate(groups):
            for s, (_, color, _) in enumerate(PLOT_SERIES):
                cell = chosen[g][s]
                if cell is None:
                    continue
                v, x = metric(cell), left + g * gw + gw * 0.1 + s * bw
                y = axis.y(v)
                if title != MEMORY_PANEL:
                    el.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw - 2:.1f}" '
                              f'height="{axis.base - y:.1f}" fill="{color}"><title>{v:.3g}</title></rect>')
                    label(x + bw / 2 - 1, y, v)
                    continue
                held = cell.cache_held / MB
                yh = axis.y(held)
                el.append(f'<rect x="{x + 0.5:.1f}" y="{y:.1f}" width="{bw - 3:.1f}" height="{axis.base - y:.1f}" '
                          f'fill="none" stroke="{color}" stroke-width="1.5"><title>accounted {v:.3g}</title></rect>')
                el.append(f'<rect x="{x:.1f}" y="{yh:.1f}" width="{bw - 2:.1f}" height="{axis.base - yh:.1f}" '
                          f'fill="{color}"><title>held {held:.3g}</title></rect>')
                label(x + bw / 2 - 1, y, v)
                if held != v:
                    label(x + bw / 2 - 1, yh, held)
            el.append(f'<text x="{left + g * gw + gw / 2:.1f}" y="{axis.base + 16}" font-size="11" '
                      f'text-anchor="middle">{m} · {w}</text>')
    el.append(f'<text x="20" y="{height - 6}" font-size="10" fill="#555">processor-only and disabled send the '
              'same bytes with 1, 2 or 4 replicas and either policy (see the table); CPU includes render, build, '
              'route and msgpack encode.</text>')
    el.append("</svg>")
    path.write_text("\n".join(el) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40, help="requests per workload (default 40)")
    ap.add_argument("--turns", type=int, default=TURNS, help=f"multi-turn: turns per conversation (default {TURNS})")
    ap.add_argument("--long-users", type=int, default=4,
                    help=f"multi-turn-20: conversations of {LONG_TURNS} turns (default 4: 80 requests)")
    ap.add_argument("--long-modalities", default="audio",
                    help="modalities that run multi-turn-20 (default audio; an image run encodes ~64 MB per "
                         "processor-only request), empty for none")
    ap.add_argument("--modalities", default="image,audio", help="comma-separated: image,audio")
    ap.add_argument("--out", default="/tmp/omnistage-bench", help="directory for cache.svg/.md/.json")
    args = ap.parse_args()
    args.modalities = [m for m in args.modalities.split(",") if m]
    args.long_modalities = [m for m in args.long_modalities.split(",") if m]
    wall0, cpu0 = START
    if engine_env.VLLM_OMNI_IMPORT_ERROR:
        print(f"bench-cache needs vllm_omni 0.30.0 (make setup): {engine_env.VLLM_OMNI_IMPORT_ERROR}")
        return 2
    from omnistage_engine_patches import contract

    os.environ.pop(contract.FRONTEND_CACHE_ENV, None)  # no operator here: the plugin's detection decides
    log("loading vLLM's general plugins (this project's patches) ...")
    import vllm.plugins

    vllm.plugins.load_general_plugins()
    if not engine_env.patch_applied("frontend_cache"):
        print("the frontend_cache patch is not applied (OMNISTAGE_DISABLE_PATCHES?): nothing to measure")
        return 2
    for name in (contract.REPLICA_AWARE_CACHE, contract.REPLICA_AFFINITY):
        if not engine_env.patch_applied(name):
            print(f"the {name} patch is not applied (OMNISTAGE_DISABLE_PATCHES?): the replica-aware mode "
                  "cannot be measured")
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-models-") as tmp:
        log("writing the tiny weightless checkpoints (Qwen2-VL, Qwen2-Audio) ...")
        model_dirs = {"image": build_image_model(Path(tmp) / "tiny-qwen2-vl"),
                      "audio": build_audio_model(Path(tmp) / "tiny-qwen2-audio")}
        media = Media()
        log("making the media (1000x1000 JPEGs, 30 s WAVs) ...")
        for m, wl, n_requests, turns in combos_for(args):
            workload(wl, m, n_requests, media, turns)
        cells, sizes = asyncio.run(run_all(args, model_dirs, media))
    print()
    for m, s in sizes.items():
        what = "1000x1000 JPEG (1.0 MP)" if m == "image" else "30 s of 16 kHz audio"
        tensors = ", ".join(f"{k} {shape} {dtype}" for k, (shape, dtype) in s["tensors"].items())
        print(f"processed item, {m}: {what} -> {s['bytes']:,} bytes ({tensors}); {s['tokens']} placeholder tokens")
    print()
    text = print_table(cells)
    print()
    print("replica-aware against processor-only (same cell; an affinity policy against its fallback balancer): "
          "bytes per request, CPU per request, frontend memory (cache + mirrors), errors (misses that failed a "
          "request + stale), misses re-sent in full, items sent in full against the floor (distinct replica x media "
          "pairs the routing produced), lru on one replica (each distinct item once) against processor-only, and "
          "the load balance: requests per replica, their max/min, and the largest gap in requests in flight "
          "(head bindings) between two replicas at any routing")
    goal = print_rows(GOAL_HEADER, goal_rows(cells))
    text += "\n\n" + goal
    svg, md, js = out / "cache.svg", out / "cache.md", out / "cache.json"
    svg_plot(cells, [(m, wl) for m, wl, _n, _t in combos_for(args)], svg)
    plots = [svg]
    if shutil.which("rsvg-convert"):  # a PNG too where librsvg's converter happens to be installed
        png = out / "cache.png"
        if subprocess.run(["rsvg-convert", str(svg), "-o", str(png)], check=False).returncode == 0:
            plots.append(png)
    goal_md = ["| " + " | ".join(GOAL_HEADER) + " |", "|" + "|".join("---" for _ in GOAL_HEADER) + "|"]
    goal_md += ["| " + " | ".join(r) + " |" for r in goal_rows(cells)]
    md.write_text(markdown_table(cells) + "\n" + "\n".join(goal_md) + "\n")
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    js.write_text(json.dumps({
        "item_sizes": sizes,
        "cells": [{**{k: v for k, v in c.__dict__.items()}, "bytes_per_req": c.bytes_per_req,
                   "cpu_ms_per_req": c.cpu_ms_per_req, "misses_per_1k": c.misses_per_1k,
                   "stale_per_1k": c.stale_per_1k} for c in cells],
        "run": {"wall_s": wall, "cpu_s": cpu, "requests_per_workload": args.requests, "turns": args.turns},
        "table": text,
    }, indent=1))
    print()
    print("MB/req: vLLM MsgpackEncoder frames per request toward the replica; 'x lru': the cell's figure over "
          "the lru single-replica reference of the same modality and workload (bytes, then CPU). "
          f"Run: {wall:.0f} s wall, {cpu:.0f} s CPU.")
    print(f"plot: {', '.join(map(str, plots))}")
    print(f"table (Markdown): {md}; every figure: {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
