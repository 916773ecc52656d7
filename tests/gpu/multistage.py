"""The multi-stage GPU tests' logic (issue 12), pure: tested without a cluster in test_support.py.

What the tests apply (the speech sample, placed on the configured GPUs, network or sameNode), what
"converged" means for a pipeline (the OmniStage, its pools, their pods and the head's listing of every
stage), the speech request and its answer, and the verdict on a load run while a pool is scaled.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import re
import wave
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omnistage.api import conditions
from omnistage.known_pipelines import SHIPPED_DEPLOY

from tests.support.status import condition, pod_ready

from .support import Settings

API_GROUP = "serving.omnistage.io"
OMNISTAGE = "OmniStage"
POOL = "OmniStagePool"
SAME_NODE = "sameNode"
NETWORK = "network"
# A namespace label that allows hostPath (sameNode's shared /dev/shm) where Pod Security admission applies.
PSA_ENFORCE = "pod-security.kubernetes.io/enforce"
# The head listing's states of a replica that no longer serves (membership-and-metrics.md).
GONE = ("left", "detached")
# Events of a pod replaced or rolled (conditions.py): none may happen on the way to the first Ready.
RESTART_REASONS = (conditions.Progress.HEAD_RESTARTED, conditions.Progress.ROLLING_HEAD,
                   conditions.Progress.REPLACED_REPLICA, conditions.Progress.ROLLED_REPLICA,
                   conditions.Progress.ROLLING_REPLICA)
# Room above the stages' gpuMemoryUtilization sum: each process's CUDA context and allocator slack.
MEMORY_SLACK = 0.05

# Fixed prompts: the thinker's text at temperature 0 is compared between runs, so they never change.
PROMPTS = (
    "In one sentence, what is the capital of France?",
    "Count from one to five in words.",
    "Say hello and name two primary colours.",
)


# ----- the objects the tests apply -----------------------------------------------------------------

def split_sample(docs: Iterable[dict[str, Any] | None]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the OmniStage, its pools) of a multi-stage sample; ValueError when it is not one OmniStage and
    at least one OmniStagePool naming it."""
    docs = [d for d in docs if d]
    stages = [d for d in docs if d.get("kind") == OMNISTAGE]
    pools = [d for d in docs if d.get("kind") == POOL]
    others = sorted({str(d.get("kind")) for d in docs} - {OMNISTAGE, POOL})
    if len(stages) != 1 or not pools or others:
        raise ValueError(f"a multi-stage sample holds one {OMNISTAGE} and its {POOL}s; found "
                         f"{len(stages)} {OMNISTAGE}, {len(pools)} {POOL}" + (f", and {others}" if others else ""))
    name = stages[0]["metadata"]["name"]
    strays = [p["metadata"]["name"] for p in pools if (p.get("spec") or {}).get("omniStage") != name]
    if strays:
        raise ValueError(f"{POOL}s {strays} do not name the OmniStage {name!r} in spec.omniStage")
    return stages[0], pools


def _place(gpu: dict[str, Any], settings: Settings) -> None:
    gpu.update({"product": settings.product, "productLabel": settings.product_label, "resource": settings.resource})


def speech_for_test(docs: Iterable[dict[str, Any] | None], settings: Settings, namespace: str,
                    mode: str | None = None, thinker_replicas: int | None = None,
                    pool_replicas: int | None = None) -> list[dict[str, Any]]:
    """The objects the tier applies: the sample's OmniStage and pools in `namespace` on the configured
    GPUs; `mode` sets spec.transport.mode (sameNode also sets protocol tcp: it moves data through
    /dev/shm), the replica counts override the sample's. The sample is not changed."""
    stage, pools = split_sample(copy.deepcopy(list(docs)))
    for obj in (stage, *pools):
        obj.setdefault("metadata", {})["namespace"] = namespace
        _place(obj.setdefault("spec", {}).setdefault("gpu", {}), settings)
    spec = stage["spec"]
    if thinker_replicas is not None:
        spec["replicas"] = thinker_replicas
    if mode is not None:
        transport = spec.setdefault("transport", {})
        transport["mode"] = mode
        if mode == SAME_NODE:
            transport["protocol"] = "tcp"
    if settings.engine_image and settings.operator == "existing":
        spec.setdefault("engine", {})["image"] = settings.engine_image
    for pool in pools:
        if pool_replicas is not None:
            pool["spec"]["replicas"] = pool_replicas
    return [stage, *pools]


def gpus_for(objects: Sequence[dict[str, Any]], extra: Mapping[str, int] | None = None) -> int:
    """GPUs the pods of an OmniStage and its pools request, with `extra` more pods of the named pools."""
    total = 0
    for obj in objects:
        spec = obj.get("spec") or {}
        more = (extra or {}).get(obj["metadata"]["name"], 0) if obj.get("kind") == POOL else 0
        total += int((spec.get("gpu") or {}).get("count", 1)) * (int(spec.get("replicas", 1)) + more)
    return total


def gpus_per_node(nodes: Iterable[Mapping[str, Any]], resource: str) -> dict[str, int]:
    """Allocatable GPUs of each schedulable node."""
    out = {}
    for node in nodes:
        if (node.get("spec") or {}).get("unschedulable"):
            continue
        value = str(((node.get("status") or {}).get("allocatable") or {}).get(resource, "0"))
        out[node["metadata"]["name"]] = int(value) if value.isdigit() else 0
    return out


def remote_stage_ids(pools: Iterable[dict[str, Any]]) -> dict[int, str]:
    """stage id -> the pool that runs it."""
    return {int(sid): p["metadata"]["name"] for p in pools for sid in (p.get("spec") or {}).get("stageIds") or []}


def memory_budget(stage: dict[str, Any], stage_ids: Iterable[int]) -> float:
    """The sum of gpuMemoryUtilization of these stages (spec.stages[].engine, else vllm-omni's shipped value):
    the share of one GPU a pool pod running them may fill."""
    spec = stage.get("spec") or {}
    shipped = {s["stage_id"]: s for s in SHIPPED_DEPLOY[spec["pipeline"]]["config"]["stages"]}
    given = {int(s["id"]): (s.get("engine") or {}) for s in spec.get("stages") or []}
    return round(sum(float(given.get(i, {}).get("gpuMemoryUtilization")
                           or shipped[i].get("gpu_memory_utilization", 0.9)) for i in stage_ids), 6)


# ----- converged: the pipeline as kubectl and the head show it -------------------------------------

def live_members(listing: Mapping[str, Any] | None, stage: int) -> list[dict[str, Any]]:
    """The head's remote replicas of `stage` that still serve (its own local replica excluded)."""
    members = ((listing or {}).get("stages") or {}).get(str(stage)) or []
    return [m for m in members if not m.get("local") and str(m.get("state", "")).lower() not in GONE]


def left_members(listing: Mapping[str, Any] | None, stage: int, host: str) -> list[dict[str, Any]]:
    """The head's records of a `leave` of the replica of `stage` at `host` (a listing with ?all=true)."""
    members = ((listing or {}).get("stages") or {}).get(str(stage)) or []
    return [m for m in members if m.get("host") == host and str(m.get("state", "")).lower() == "left"]


def _current(obj: Mapping[str, Any]) -> bool:
    st = obj.get("status") or {}
    return st.get("observedGeneration") == (obj.get("metadata") or {}).get("generation")


def pipeline_problems(stage: Mapping[str, Any], pools: Sequence[Mapping[str, Any]],
                      stage_pods: Sequence[Mapping[str, Any]], pool_pods: Mapping[str, Sequence[Mapping[str, Any]]],
                      listing: Mapping[str, Any] | None) -> list[str]:
    """Why the pipeline is not converged (empty: it is): the OmniStage Ready with every stage covered and
    ready for its current generation; spec.replicas thinker pods Ready and registered; every pool Ready
    with spec.replicas pods Ready and registered; and the head's own listing holding, for every remote
    stage, exactly one live replica per pod of its pool, at that pod's IP."""
    problems = []
    name = stage["metadata"]["name"]
    st = stage.get("status") or {}
    want = int((stage.get("spec") or {}).get("replicas", 1))
    for ctype in ("Ready", "StagesCovered", "StagesReady"):
        c = condition(stage, ctype)
        if c.get("status") != "True":
            problems.append(f"{name} {ctype}={c.get('status')} ({c.get('reason')}: {c.get('message')})")
    if not _current(stage):
        problems.append(f"{name}: status is for generation {st.get('observedGeneration')}")
    if not (st.get("replicas") == st.get("readyReplicas") == st.get("registeredReplicas") == want):
        problems.append(f"{name}: thinker replicas {st.get('replicas')}, ready {st.get('readyReplicas')}, "
                        f"registered {st.get('registeredReplicas')}, want {want}")
    if len(stage_pods) != want or not all(pod_ready(p) for p in stage_pods):
        problems.append(f"{name}: {sum(pod_ready(p) for p in stage_pods)}/{len(stage_pods)} thinker pods Ready, "
                        f"want {want}")
    if listing is None:
        problems.append("the head's membership listing did not answer")
    elif len(live_members(listing, 0)) != want - 1:
        problems.append(f"the head lists {len(live_members(listing, 0))} remote thinker replicas, want {want - 1}")
    by_pool = {p["metadata"]["name"]: p for p in pools}
    for entry in st.get("stages") or []:
        pool = by_pool.get(entry.get("pool"))
        desired = int((pool.get("spec") or {}).get("replicas", 1)) if pool else None
        if pool is None or not (entry.get("desired") == entry.get("ready") == entry.get("registered") == desired):
            problems.append(f"{name}: status.stages {entry}")
    covered = {int(e["id"]) for e in st.get("stages") or [] if "id" in e}
    for pool in pools:
        pname, pst = pool["metadata"]["name"], pool.get("status") or {}
        desired = int((pool.get("spec") or {}).get("replicas", 1))
        ready = condition(pool, "Ready")
        if ready.get("status") != "True":
            problems.append(f"pool {pname} Ready={ready.get('status')} ({ready.get('reason')}: {ready.get('message')})")
        if not _current(pool):
            problems.append(f"pool {pname}: status is for generation {pst.get('observedGeneration')}")
        if not (pst.get("replicas") == pst.get("readyReplicas") == pst.get("registeredReplicas") == desired):
            problems.append(f"pool {pname}: replicas {pst.get('replicas')}, ready {pst.get('readyReplicas')}, "
                            f"registered {pst.get('registeredReplicas')}, want {desired}")
        pods = list(pool_pods.get(pname) or [])
        if len(pods) != desired or not all(pod_ready(p) for p in pods):
            problems.append(f"pool {pname}: {sum(pod_ready(p) for p in pods)}/{len(pods)} pods Ready, want {desired}")
        ips = sorted((p.get("status") or {}).get("podIP") or "" for p in pods)
        wanted = sorted(str(int(i)) for i in (pool.get("spec") or {}).get("stageIds") or [])
        for m in pst.get("members") or []:
            if m.get("state") != "Joined" or sorted(m.get("replicaIds") or {}) != wanted:
                problems.append(f"pool {pname}: member {m.get('pod')} is {m.get('state')} with replica ids "
                                f"{m.get('replicaIds')}, want Joined for stages {', '.join(wanted)}")
        for sid in (pool.get("spec") or {}).get("stageIds") or []:
            if int(sid) not in covered:
                problems.append(f"{name}: status.stages has no entry for stage {sid}")
            if listing is not None:
                hosts = sorted(m.get("host") or "" for m in live_members(listing, int(sid)))
                if hosts != ips:
                    problems.append(f"the head lists stage {sid} replicas at {hosts}, pool {pname}'s pods are at {ips}")
    return problems


# ----- the speech request and its answer -----------------------------------------------------------

def speech_request(model: str, prompt: str, max_tokens: int = 64, temperature: float = 0.0,
                   audio_b64: str | None = None) -> dict[str, Any]:
    """An OpenAI chat completion asking for text and audio; `temperature` applies to the thinker (the
    talker keeps the sampling of the deploy config)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": prompt}]
    if audio_b64:
        content.insert(0, {"type": "input_audio", "input_audio": {"data": audio_b64, "format": "wav"}})
    return {"model": model, "messages": [{"role": "user", "content": content}], "modalities": ["text", "audio"],
            "max_tokens": max_tokens, "temperature": temperature}


@dataclass(frozen=True)
class Speech:
    text: str
    audio: bytes
    finish_reasons: tuple[str | None, ...]

    @property
    def failed(self) -> bool:
        return "error" in self.finish_reasons


def parse_speech(body: Mapping[str, Any]) -> Speech:
    """The text and the decoded audio of a chat completion: vllm-omni puts the audio in
    choices[i].message.audio.data (base64), in the text's choice or in a choice of its own."""
    texts, audio, reasons = [], b"", []
    for choice in body.get("choices") or []:
        message = choice.get("message") or {}
        reasons.append(choice.get("finish_reason"))
        if isinstance(message.get("content"), str) and message["content"]:
            texts.append(message["content"])
        data = (message.get("audio") or {}).get("data")
        if data:
            try:
                audio += base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                pass
    return Speech("".join(texts), audio, tuple(reasons))


def wav_seconds(audio: bytes) -> float:
    """Duration of a WAV file (0.0 when it is not one or holds no frames)."""
    try:
        with wave.open(io.BytesIO(audio), "rb") as w:
            rate = w.getframerate()
            return w.getnframes() / rate if rate else 0.0
    except (wave.Error, EOFError):
        return 0.0


def first_divergence(a: str, b: str) -> int | None:
    """Index of the first character where a and b differ, None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def text_differences(reference: Mapping[str, str], other: Mapping[str, str]) -> list[str]:
    """Prompts whose answers differ, with where they part."""
    out = []
    for prompt, want in reference.items():
        got = other.get(prompt)
        if got is None:
            out.append(f"{prompt!r}: no answer in the second run")
        elif (i := first_divergence(want, got)) is not None:
            out.append(f"{prompt!r}: differs at character {i}: {want[max(0, i - 20):i + 40]!r} vs "
                       f"{got[max(0, i - 20):i + 40]!r}")
    return out


# ----- a bounded load while a pool is scaled -------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    start: float
    end: float
    ok: bool
    detail: str = ""  # why it failed: HTTP status, finish_reason error, no audio, connection error


def load_problems(outcomes: Sequence[Outcome], leaving: Sequence[tuple[float, float]], drain_timed_out: bool,
                  clients: int) -> list[str]:
    """The verdict on a load run while a pool was scaled: no failure at all, except, when a leave hit its
    drain timeout, requests ending while a replica was leaving (at most one per client: each client
    has one request in flight). `leaving` holds the (start, end) of each scale-down."""
    problems = []
    if not any(o.ok for o in outcomes):
        problems.append(f"none of {len(outcomes)} requests succeeded")
    failed = [o for o in outcomes if not o.ok]
    during = [o for o in failed if any(s <= o.end <= e for s, e in leaving)]
    outside = [o for o in failed if o not in during]
    if outside:
        problems.append(f"{len(outside)} requests failed outside a scale-down: "
                        + "; ".join(sorted({o.detail for o in outside}))[:500])
    allowed = clients * len(leaving) if drain_timed_out else 0
    if len(during) > allowed:
        why = "a drain timed out" if drain_timed_out else "every leave drained (Left)"
        problems.append(f"{len(during)} requests failed while a replica was leaving, at most {allowed} may "
                        f"({why}): " + "; ".join(sorted({o.detail for o in during}))[:500])
    return problems


def summary(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Count, failures, requests per second and the median latency of a run."""
    if not outcomes:
        return {"requests": 0, "failed": 0, "per_second": 0.0, "median_s": 0.0}
    span = max(o.end for o in outcomes) - min(o.start for o in outcomes)
    latencies = sorted(o.end - o.start for o in outcomes if o.ok) or [0.0]
    return {"requests": len(outcomes), "failed": sum(not o.ok for o in outcomes),
            "per_second": round(sum(o.ok for o in outcomes) / span, 3) if span > 0 else 0.0,
            "median_s": round(latencies[len(latencies) // 2], 3)}


# ----- what a pod shows ---------------------------------------------------------------------------

def engine_container(pod: Mapping[str, Any]) -> dict[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or []
    return next((c for c in containers if c.get("name") == "engine"), containers[0] if containers else {})


def stage_ids_of(container: Mapping[str, Any]) -> list[int]:
    """The --stage-id values of a pool pod's supervisor (before its `--`)."""
    argv = [*(container.get("command") or []), *(container.get("args") or [])]
    if "--" in argv:
        argv = argv[:argv.index("--")]
    ids = []
    for i, arg in enumerate(argv):
        if arg == "--stage-id" and i + 1 < len(argv) and argv[i + 1].isdigit():
            ids.append(int(argv[i + 1]))
        elif arg.startswith("--stage-id=") and arg.split("=", 1)[1].isdigit():
            ids.append(int(arg.split("=", 1)[1]))
    return ids


def shm_volume(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The volume the engine container mounts at /dev/shm (empty when none)."""
    mount = next((m for m in engine_container(pod).get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"), None)
    if mount is None:
        return {}
    return next((v for v in (pod.get("spec") or {}).get("volumes") or [] if v.get("name") == mount.get("name")), {})


def startup_timeouts(pod: Mapping[str, Any]) -> dict[str, float]:
    """The startup bounds of an engine pod: --stage-init-timeout and --init-timeout of its command,
    VLLM_ENGINE_READY_TIMEOUT_S of its env, and its startup probe's period x failureThreshold."""
    c = engine_container(pod)
    argv = [*(c.get("command") or []), *(c.get("args") or [])]
    out: dict[str, float] = {}
    for flag in ("--stage-init-timeout", "--init-timeout"):
        for i, arg in enumerate(argv):
            value = arg.split("=", 1)[1] if arg.startswith(flag + "=") else (
                argv[i + 1] if arg == flag and i + 1 < len(argv) else None)
            if value is not None and re.fullmatch(r"\d+(\.\d+)?", value):
                out[flag] = float(value)
    env = {e.get("name"): e.get("value") for e in c.get("env") or []}
    if re.fullmatch(r"\d+(\.\d+)?", str(env.get("VLLM_ENGINE_READY_TIMEOUT_S") or "")):
        out["VLLM_ENGINE_READY_TIMEOUT_S"] = float(env["VLLM_ENGINE_READY_TIMEOUT_S"])
    probe = c.get("startupProbe") or {}
    if probe:
        out["startupProbe"] = float(probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
                                    + probe.get("initialDelaySeconds", 0))
    return out


def env_value(pod: Mapping[str, Any], name: str) -> str | None:
    return next((e.get("value") for e in engine_container(pod).get("env") or [] if e.get("name") == name), None)


def restarts(pod: Mapping[str, Any]) -> int:
    return sum(int(s.get("restartCount", 0)) for s in (pod.get("status") or {}).get("containerStatuses") or [])


def parse_gpu_memory(text: str) -> list[tuple[int, float, float]]:
    """`nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits` ->
    [(index, used MiB, total MiB)]."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and all(re.fullmatch(r"\d+(\.\d+)?", p) for p in parts):
            out.append((int(float(parts[0])), float(parts[1]), float(parts[2])))
    return out


def parse_df_kib(text: str) -> int | None:
    """Size in KiB of the file system in `df -k PATH` output (its last line), None when unreadable."""
    lines = [line.split() for line in text.strip().splitlines()[1:]]
    if not lines or len(lines[-1]) < 2 or not lines[-1][1].isdigit():
        return None
    return int(lines[-1][1])


def log_highlights(text: str, limit: int = 40) -> list[str]:
    """The lines of an engine log that tell the startup order: stage initialization, registration,
    readiness, connector creation and the engine plugin's patches."""
    pattern = re.compile(r"(?i)(stage[ _-]?(id)?[ =:]*\d|regist|ready|connector|nixl|ucx|patch|initializ)")
    return [line for line in text.splitlines() if pattern.search(line)][:limit]
