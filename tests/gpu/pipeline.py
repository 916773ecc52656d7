"""A multi-stage pipeline on the GPU cluster, driven the way a user drives it: kubectl for the OmniStage,
its OmniStagePools and their pods, the head's membership listing and the OpenAI API through `kubectl
port-forward` to 127.0.0.1 (never a cluster IP). The decisions are in multistage.py (pure)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import pytest
import yaml
from omnistage_engine_patches import contract

from tests.standin.harness import L_OMNISTAGE, L_ROLE, HeadEndpoint, membership_port

from . import multistage as ms
from .checks import wait_gpu
from .support import ROOT, Settings

FIELD_MANAGER = "omnistage-gpu-tests"
REQUEST_TIMEOUT = 600  # one spoken answer; the talker may take a while under load


def _repro() -> Any:
    """hack/gpu-repro.py as a module: its PortForward (reads kubectl's output, waits for an answer),
    served_model and http_port."""
    if "gpu_repro" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_repro", ROOT / "hack" / "gpu-repro.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_repro"] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules["gpu_repro"]


@dataclass
class Pipeline:
    namespace: str
    name: str  # the OmniStage
    pools: list[str]
    mode: str  # network | sameNode
    http_port: int
    model: str
    objects: list[dict[str, Any]]  # as applied
    cross_node: bool = False  # the pools' pods were kept off the thinker pods' nodes
    membership_port: int = contract.DEFAULT_MEMBERSHIP_PORT  # spec.engine.membershipPort
    seconds_to_ready: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)


# ----- reading it ---------------------------------------------------------------------------------

def _get(kubectl: Any, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
    proc = kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def pods(kubectl: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    if not selector:
        return []
    items = kubectl.json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def read(kubectl: Any, p: Pipeline) -> tuple[dict[str, Any] | None, list[dict[str, Any]], list[dict[str, Any]],
                                             dict[str, list[dict[str, Any]]]]:
    """(OmniStage, pools, thinker pods, pods per pool), pods found by each object's status.selector."""
    stage = _get(kubectl, "omnistage", p.name, p.namespace)
    pools = [o for o in (_get(kubectl, "omnistagepool", n, p.namespace) for n in p.pools) if o]
    stage_pods = pods(kubectl, p.namespace, ((stage or {}).get("status") or {}).get("selector", ""))
    pool_pods = {o["metadata"]["name"]: pods(kubectl, p.namespace, (o.get("status") or {}).get("selector", ""))
                 for o in pools}
    return stage, pools, stage_pods, pool_pods


def head(kubectl: Any, p: Pipeline) -> HeadEndpoint:
    return HeadEndpoint(kubectl, p.namespace, p.name, http_port=p.http_port, membership_port=p.membership_port)


def problems(kubectl: Any, p: Pipeline) -> list[str]:
    stage, pools, stage_pods, pool_pods = read(kubectl, p)
    if stage is None or len(pools) != len(p.pools):
        return [f"{p.name} or one of its pools {p.pools} is not there"]
    return ms.pipeline_problems(stage, pools, stage_pods, pool_pods, head(kubectl, p).listing())


def wait_converged(kubectl: Any, p: Pipeline, what: str, timeout: float) -> float:
    """Seconds until the pipeline is converged (multistage.pipeline_problems empty)."""
    start = time.monotonic()
    last: list[str] = []

    def done() -> bool:
        nonlocal last
        found = problems(kubectl, p)
        if found and found != last:
            print("[gpu]   " + "\n[gpu]   ".join(found), flush=True)
        last = found
        return not found

    wait_gpu(f"{p.namespace}/{p.name} {what}", done, timeout)
    return time.monotonic() - start


def events(kubectl: Any, namespace: str) -> list[dict[str, Any]]:
    return kubectl.json("get", "events", "-n", namespace)["items"]


def reason_count(items: list[dict[str, Any]], reason: str, names: set[str]) -> int:
    return sum(int(e.get("count") or 1) for e in items
               if e.get("reason") == reason and (e.get("involvedObject") or {}).get("name") in names)


def exec_in(kubectl: Any, namespace: str, pod: dict[str, Any], *argv: str, check: bool = True) -> Any:
    container = ms.engine_container(pod).get("name", "engine")
    return kubectl("exec", "-n", namespace, pod["metadata"]["name"], "-c", container, "--", *argv, check=check,
                   timeout=120)


# ----- applying it --------------------------------------------------------------------------------

def _cross_node(objects: list[dict[str, Any]], name: str, per_node: dict[str, int]) -> bool:
    """Every thinker pod on the head's node and every pool pod on other nodes, so each thinker ->
    talker transfer crosses nodes: a required pod affinity of the OmniStage's pods to its head (the
    head matches its own term, so it schedules first) and a required anti-affinity of the pools' pods
    to it. Only with two GPU nodes or more, room for the thinkers on one node, and no affinity of the
    sample's own; returns whether it was set."""
    stage, pools = objects[0], objects[1:]
    thinkers = int(stage["spec"].get("replicas", 1)) * int(stage["spec"]["gpu"].get("count", 1))
    mine = [stage["spec"].get("placement") or {}, *((q["spec"].get("placement") or {}) for q in pools)]
    if sum(1 for n in per_node.values() if n) < 2 or max(per_node.values()) < thinkers \
            or any(m.get("affinity") for m in mine):
        return False
    term = {"labelSelector": {"matchLabels": {L_OMNISTAGE: name, L_ROLE: "head"}},
            "topologyKey": "kubernetes.io/hostname"}
    stage["spec"].setdefault("placement", {})["affinity"] = {
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    for q in pools:
        q["spec"].setdefault("placement", {})["affinity"] = {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
    return True


@contextlib.contextmanager
def deployed(settings: Settings, kubectl: Any, mode: str, gpu_nodes: list[dict[str, Any]],
             thinker_replicas: int | None = None, pool_replicas: int | None = None) -> Iterator[Pipeline]:
    """The speech sample applied in a namespace of its own (transport `mode`), converged; deleted at the
    end unless OMNISTAGE_GPU_KEEP=1. Fails the test when the cluster lacks the GPUs it needs."""
    docs = list(yaml.safe_load_all(settings.multistage_sample.read_text()))
    ns = settings.namespace or f"omnistage-gpu-{'sn' if mode == ms.SAME_NODE else 'net'}-{uuid.uuid4().hex[:5]}"
    objects = ms.speech_for_test(docs, settings, ns, mode=mode, thinker_replicas=thinker_replicas,
                                 pool_replicas=pool_replicas)
    stage, pools = objects[0], objects[1:]
    name = stage["metadata"]["name"]
    need = ms.gpus_for(objects)
    per_node = ms.gpus_per_node(gpu_nodes, settings.resource)
    if mode == ms.SAME_NODE and max(per_node.values(), default=0) < need:
        pytest.fail(f"sameNode needs {need} {settings.resource} on one node; the largest node has "
                    f"{max(per_node.values(), default=0)} (set OMNISTAGE_GPU_MULTISTAGE=network to skip this run)")
    if sum(per_node.values()) < need:
        pytest.fail(f"the speech sample needs {need} {settings.resource}; the cluster has {sum(per_node.values())}")
    cross = mode == ms.NETWORK and _cross_node(objects, name, per_node)
    if mode == ms.NETWORK and not cross:
        print(f"[gpu] network: {ns}/{name}'s thinker and speech pods may share nodes (one GPU node, too few GPUs "
              "on one node for the thinkers, or the sample sets its own affinity)", flush=True)
    made_ns = not kubectl.exists("namespace", ns)
    if made_ns:
        kubectl("create", "namespace", ns)
        if mode == ms.SAME_NODE:
            # sameNode mounts a hostPath directory as /dev/shm: the privileged Pod Security level.
            kubectl("label", "namespace", ns, f"{ms.PSA_ENFORCE}=privileged", "--overwrite")
    kubectl("apply", "--server-side", f"--field-manager={FIELD_MANAGER}", "-f", "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    stored = kubectl.json("get", "omnistage", name, "-n", ns)
    repro = _repro()
    p = Pipeline(ns, name, [o["metadata"]["name"] for o in pools], mode, repro.http_port(stored),
                 repro.served_model(stored), objects, cross_node=cross, membership_port=membership_port(stored))
    try:
        p.seconds_to_ready = wait_converged(kubectl, p, f"{mode} pipeline Ready with every stage registered",
                                            settings.ready_timeout)
        yield p
    finally:
        for kind, obj in (("omnistage", name), *(("omnistagepool", n) for n in p.pools)):
            out = kubectl("describe", kind, obj, "-n", ns, check=False).stdout
            print(f"[gpu] {ns}/{obj} at the end:\n{out}", flush=True)
        if settings.keep:
            print(f"[gpu] OMNISTAGE_GPU_KEEP=1: {ns} stays", flush=True)
        elif made_ns:
            kubectl("delete", "namespace", ns, "--wait=false", check=False)
        else:
            # A given namespace: wait until the pods are gone, the next run reuses the names and GPUs.
            for n in p.pools:
                kubectl("delete", "omnistagepool", n, "-n", ns, "--ignore-not-found", check=False, timeout=900)
            kubectl("delete", "omnistage", name, "-n", ns, "--ignore-not-found", check=False, timeout=900)
            kubectl("wait", "--for=delete", "pods", "-n", ns, "-l", f"{L_OMNISTAGE}={name}", "--timeout=900s",
                    check=False, timeout=960)


def scale_pool(kubectl: Any, p: Pipeline, pool: str, replicas: int) -> None:
    kubectl("scale", "omnistagepool", pool, "-n", p.namespace, f"--replicas={replicas}")


# ----- its API through a port-forward -------------------------------------------------------------

@contextlib.contextmanager
def api(kubectl: Any, p: Pipeline) -> Iterator[str]:
    """http://127.0.0.1:PORT forwarded to the OmniStage's API Service (the head)."""
    argv = [kubectl.binary, f"--kubeconfig={kubectl.kubeconfig}", "-n", p.namespace, "port-forward",
            "--address", "127.0.0.1", f"svc/{p.name}", f":{p.http_port}"]
    with _repro().PortForward(argv, probe_path="/health") as forward:
        yield forward.base_url


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy


def ask(base_url: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT) -> tuple[ms.Outcome, ms.Speech | None]:
    """One chat completion; ok when HTTP 200, no finish_reason "error", some text and a WAV with frames."""
    url = _repro()._loopback(f"{base_url}/v1/chat/completions")  # refuses anything but 127.0.0.0/8
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    start = time.monotonic()
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            speech = ms.parse_speech(json.load(resp))
    except urllib.error.HTTPError as err:
        detail = err.read().decode(errors="replace")[:200]
        return ms.Outcome(start, time.monotonic(), False, f"HTTP {err.code}: {detail}"), None
    except (urllib.error.URLError, OSError, ValueError) as err:
        return ms.Outcome(start, time.monotonic(), False, f"connection: {type(err).__name__}: {err}"), None
    end = time.monotonic()
    if speech.failed:
        return ms.Outcome(start, end, False, "finish_reason error"), speech
    if not speech.text:
        return ms.Outcome(start, end, False, "no text"), speech
    if ms.wav_seconds(speech.audio) <= 0:
        return ms.Outcome(start, end, False, f"no audio ({len(speech.audio)} bytes)"), speech
    return ms.Outcome(start, end, True), speech


def answers(base_url: str, model: str) -> tuple[dict[str, ms.Speech], list[ms.Outcome]]:
    """The fixed prompts, one at a time (so batching cannot change the thinker's text), at temperature 0."""
    out, outcomes = {}, []
    for prompt in ms.PROMPTS:
        outcome, speech = ask(base_url, ms.speech_request(model, prompt))
        outcomes.append(outcome)
        assert outcome.ok, f"{prompt!r}: {outcome.detail}"
        out[prompt] = speech
        print(f"[gpu]   {prompt!r} -> {speech.text!r}, {ms.wav_seconds(speech.audio):.1f} s of audio in "
              f"{outcome.end - outcome.start:.1f} s", flush=True)
    return out, outcomes


def burst(base_url: str, model: str, clients: int, per_client: int = 3) -> list[ms.Outcome]:
    """`clients` concurrent clients sending `per_client` requests each: throughput."""
    def one(i: int) -> list[ms.Outcome]:
        return [ask(base_url, ms.speech_request(model, ms.PROMPTS[(i + k) % len(ms.PROMPTS)], max_tokens=32))[0]
                for k in range(per_client)]

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        return [o for outs in pool.map(one, range(clients)) for o in outs]


class Load:
    """`clients` threads, each with one speech request in flight at a time, until stopped."""

    def __init__(self, base_url: str, model: str, clients: int):
        self.base_url, self.model, self.clients = base_url, model, clients
        self.outcomes: list[ms.Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            body = ms.speech_request(self.model, ms.PROMPTS[(i + k) % len(ms.PROMPTS)], max_tokens=32)
            outcome, _ = ask(self.base_url, body)
            with self._lock:
                self.outcomes.append(outcome)
            k += 1

    def ok(self) -> int:
        with self._lock:
            return sum(o.ok for o in self.outcomes)

    def reached(self, answers: int) -> bool:
        """At least `answers` successful answers so far. Raises AssertionError when the last 3 x clients
        requests all failed: a broken pipeline or port-forward, not worth waiting for."""
        with self._lock:
            last = self.outcomes[-3 * self.clients:]
            if len(last) == 3 * self.clients and not any(o.ok for o in last):
                raise AssertionError(f"the last {len(last)} requests failed: "
                                     + "; ".join(sorted({o.detail for o in last}))[:500])
            return sum(o.ok for o in self.outcomes) >= answers

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT + 30)


def spoken_answers(kubectl: Any, p: Pipeline, mode: str, clients: int, results: dict[str, Any]) -> None:
    """The prompts one at a time, then a burst of `clients`; the answers' texts and both summaries go
    into results[mode] (the sameNode run compares texts and figures with the network run's). Every
    answer carries audio and no burst request fails."""
    with api(kubectl, p) as base:
        said, outcomes = answers(base, p.model)
        many = burst(base, p.model, clients)
    result = results.setdefault(mode, {})
    result.update({"texts": {k: v.text for k, v in said.items()}, "sequential": ms.summary(outcomes),
                   "burst": ms.summary(many)})
    print(f"[gpu] {mode}: sequential {result['sequential']}, {clients} clients {result['burst']}")
    assert all(ms.wav_seconds(a.audio) > 0 for a in said.values())
    failed = [o.detail for o in many if not o.ok]
    assert not failed, failed
