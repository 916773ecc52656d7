"""Issue 12, connector tier: a NIXL chain thinker (0) -> talker (1) -> code2wav (2), one process per
stage, each stage's pod on its own loopback address, with master-assigned replica ids 0, 5 and 1.

Real: vllm-omni 0.30.0's real connector resolution and NixlConnector over UCX/TCP on loopback; no
GPU, no model. Each stage process (tests/connector/nixl_stage.py) parses the deploy config with
`load_omni_transfer_config`, picks its connector with `get_stage_connector_spec`, builds it with the
stage worker's `_create_connector` (`resolve_connector_spec` with the replica id from
`VLLM_OMNI_REPLICA_ID`, then the real connector factory) and computes the endpoint the head would
advertise for it with `StageEngineCoreClient._build_payload_sender_info`; this project's plugin is
loaded through vLLM's plugin loader, so `OMNISTAGE_CONNECTOR_PORTS=per-pod` acts as in an engine pod.
Stage 0 puts a tensor and a dict; stage 1 gets them from stage 0's advertised endpoint and puts a
derived payload; stage 2 gets that from stage 1's advertised endpoint: real NIXL READs over UCX
(`UCX_TLS=tcp,self,sm`; the processes share one host, so UCX may pick shared memory for the bulk
copy where pods on two nodes would use TCP; the ZMQ handshakes are TCP on the 127.x addresses).

Not real: the head and the orchestrator (this test hands each stage its upstream's advertised
endpoint, as the head does through `payload_sender_info`), the EngineCore and the model (the
payload is made up), Kubernetes networking (loopback addresses stand for pod IPs).

Two runs through the same three processes, each run on its own addresses (127.0.42.x and
127.0.43.x): with vllm-omni's port arithmetic (base + 1024 * replica id + stage: 47121 for talker
replica 5) and with `OMNISTAGE_CONNECTOR_PORTS=per-pod` (base + stage), which the process sets
while it builds that run's connector. The test judges the `RESULT` lines the processes print, not
their exit codes (NIXL's UCX teardown has segfaulted at interpreter exit; the processes leave with
`os._exit`). Skipped when `import nixl` fails. Cost: three vLLM imports (about 10 s of CPU each).

Negative control: `OMNISTAGE_DISABLE_PATCHES=connector_ports pytest tests/connector/test_nixl_chain.py`
(passed on to the stage processes) fails the per-pod run: the talker then listens on 47121.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omnistage_engine_patches import contract

from tests.support.loopback import LOOPBACK_ENV

try:
    import nixl  # noqa: F401

    NIXL_IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001  (ImportError, or a wheel without its CUDA variant)
    NIXL_IMPORT_ERROR = f"{type(e).__name__}: {e}"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is None,
                       reason="connector tier needs vllm_omni 0.30.0 (run hack/setup.sh)"),
    pytest.mark.skipif(NIXL_IMPORT_ERROR is not None,
                       reason=f"NIXL chain needs the nixl packages (engine extra, hack/setup.sh): {NIXL_IMPORT_ERROR}"),
]

ROOT = Path(__file__).resolve().parents[2]
BASE = 42000
REPLICA_IDS = {0: 0, 1: 5, 2: 1}  # master-assigned: ids are never reused, so not 0, 1, 2
# One /24 of loopback per run, so the two runs never share an address (127.0.4x.2/.3/.4).
MODES = {"upstream-ports": (None, "127.0.42"), "per-pod": (contract.PORTS_PER_POD, "127.0.43")}
READY_TIMEOUT_S = 240.0  # three vLLM imports on 2 busy cores
STEP_TIMEOUT_S = 60.0  # a transfer; each process gives up its get after 30 s


def progress(message: str) -> None:
    print(f"[connector {time.strftime('%H:%M:%S')}] {message}", flush=True)


class StageProcess:
    """One stage, serving its pod of every run: a subprocess whose `RESULT {json}` lines a reader
    thread collects."""

    def __init__(self, stage: int) -> None:
        self.stage = stage
        env = {**os.environ, **LOOPBACK_ENV, "UCX_TLS": "tcp,self,sm",
               contract.VLLM_PLUGINS_ENV: f"{contract.GENERAL_PLUGIN},vllm_omni_register_models",
               "PYTHONUNBUFFERED": "1"}
        env.pop(contract.CONNECTOR_PORTS_ENV, None)  # set per run by the process itself
        pods = [a for run, (_, net) in MODES.items() for a in ("--pod", f"{run}={net}.{stage + 2}")]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.connector.nixl_stage", "--stage", str(stage),
             "--replica-id", str(REPLICA_IDS[stage]), "--base", str(BASE), *pods],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1)
        self.results: dict[tuple[str, str], queue.Queue[dict[str, Any]]] = {}
        self.ready: dict[str, dict[str, Any]] = {}  # run -> its ready line
        self.output: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _queue(self, event: str, pod: str) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self.results.setdefault((event, pod), queue.Queue())

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line.rstrip())
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
                self._queue(result["event"], result["pod"]).put(result)

    def send(self, **command: Any) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, pod: str, timeout: float) -> dict[str, Any]:
        """The next `event` line of run `pod`; fails with the process's output on an error line,
        its exit or the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                return self._queue(event, pod).get(timeout=0.5)
            if not self._queue("error", pod).empty() or self.proc.poll() is not None:
                break
        tail = "\n".join(self.output[-40:])
        pytest.fail(f"stage {self.stage}, {pod}: no {event!r} line (exit code {self.proc.poll()}); "
                    f"output:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send(op="exit")
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def stages() -> Iterator[dict[int, StageProcess]]:
    """Stages 0, 1, 2, each ready with one connector per run (net.2/.3/.4 of that run's net)."""
    started = time.monotonic()
    progress(f"starting stages {list(REPLICA_IDS)} (replica ids {list(REPLICA_IDS.values())}), "
             f"runs {list(MODES)}")
    procs = {k: StageProcess(k) for k in REPLICA_IDS}
    try:
        for k, proc in procs.items():
            for run in MODES:
                proc.ready[run] = proc.expect("ready", run, READY_TIMEOUT_S)
                progress(f"stage {k} ready, {run}: {proc.ready[run]}")
        progress(f"stages ready in {time.monotonic() - started:.1f}s")
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()
        progress(f"stages stopped; {time.monotonic() - started:.1f}s in all")


@pytest.fixture(scope="module", params=list(MODES))
def chain(request, stages) -> tuple[str, dict[str, Any]]:
    """One request through 0 -> 1 -> 2 in run `request.param`; every RESULT line of it."""
    run = request.param
    progress(f"NIXL chain, {run} ({contract.CONNECTOR_PORTS_ENV}={MODES[run][0]}), on {MODES[run][1]}.2-4")
    ready = {k: proc.ready[run] for k, proc in stages.items()}
    stages[0].send(op="put", pod=run)
    put0 = stages[0].expect("put", run, STEP_TIMEOUT_S)
    progress(f"stage 0 put: {put0}")
    stages[1].send(op="get", pod=run, source=ready[0]["advertised"])  # what the head tells stage 1
    got1 = stages[1].expect("got", run, STEP_TIMEOUT_S)
    progress(f"stage 1 got: {got1}")
    put1 = stages[1].expect("put", run, STEP_TIMEOUT_S)
    progress(f"stage 1 put: {put1}")
    stages[2].send(op="get", pod=run, source=ready[1]["advertised"])
    got2 = stages[2].expect("got", run, STEP_TIMEOUT_S)
    progress(f"stage 2 got: {got2}")
    return run, {"ready": ready, "put0": put0, "got1": got1, "put1": put1, "got2": got2}


def tensor(values: list[float], shape: list[int], dtype: str) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "values": values}


def test_the_payload_goes_through_both_edges_intact(chain):
    _, r = chain
    sent = {"hidden": tensor([float(i) for i in range(12)], [3, 4], "torch.float32"),
            "meta": {"request_id": "req-0", "token_ids": [11, 12, 13], "stage": "thinker"}}
    assert r["put0"]["ok"] and r["put0"]["payload"] == sent
    assert r["got1"]["key"] == "req-0_0_0" and r["got1"]["payload"] == sent
    relayed = {"codes": tensor([2 * i + 1 for i in range(12)], [3, 4], "torch.int64"),
               "meta": {**sent["meta"], "stage": "talker", "from_thinker": "thinker"}}
    assert r["put1"]["ok"] and r["put1"]["payload"] == relayed
    assert r["got2"]["key"] == "req-0_1_0" and r["got2"]["payload"] == relayed


def test_roles_and_advertised_ports(chain):
    mode, r = chain
    ready = r["ready"]
    net = MODES[mode][1]
    assert {k: (v["connector"], v["role"]) for k, v in ready.items()} == {
        0: ("NixlConnector", "sender"),
        1: ("NixlConnector", "receiver"),  # with an `outgoing` listener
        2: ("NixlConnector", "receiver")}
    assert {v["connector_ports"] for v in ready.values()} == {MODES[mode][0]}
    per_pod = MODES[mode][0] == contract.PORTS_PER_POD
    # base + request-forwarding offset 0 + 1024 * replica id (dropped per pod) + from_stage
    expected = {k: BASE + (0 if per_pod else 1024 * REPLICA_IDS[k]) + k for k in (0, 1)}
    assert expected == ({0: 42000, 1: 42001} if per_pod else {0: 42000, 1: 47121})
    for k in (0, 1):  # the producers: the head advertises exactly what the replica listens on
        assert ready[k]["bound"] == {"host": f"{net}.{k + 2}", "zmq_port": expected[k]}
        assert ready[k]["advertised"] == ready[k]["bound"]
    # code2wav only receives: no listener, nothing to advertise.
    assert ready[2]["bound"] == {"host": None, "zmq_port": None} and ready[2]["advertised"] is None
    assert r["got1"]["source"] == ready[0]["advertised"] and r["got2"]["source"] == ready[1]["advertised"]
    if per_pod:  # without the variable the patch leaves vllm-omni's arithmetic alone
        assert {v["patch"] for v in ready.values()} == {contract.APPLIED}
