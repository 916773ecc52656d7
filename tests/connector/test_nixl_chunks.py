"""Issue 29, connector tier: chunk streaming over NIXL cannot start on vllm-omni 0.30.0, so the
operator's `transport: network` renders `async_chunk: false`.

Real: vllm-omni 0.30.0's connector resolution and NixlConnector construction (its UCX agent and its
ZMQ handshake listener on loopback), the two builders a sending stage runs (the model runner's
`_create_connector` and the scheduler's `OmniChunkTransferAdapter.create_connector`), and the
operator's own rendering of the speech sample with `transport: network`. Not real: the EngineCore and
the worker processes around them (both builders run in one process here; in an engine they run in
two processes of one pod, which share its network namespace and so its ports), the model, the GPU.

What it shows (tests/connector/nixl_chunks_probe.py prints one line per connector built):
* streaming (vllm-omni's shipped async_chunk true): the scheduler's chunk connector fails to bind the
  handshake port the worker's holds: "Address already in use". This is the defect; when an upstream
  release fixes it this assertion fails, and the render's NO_CHUNKS_OVER_NIXL should be revisited.
* rendered (what the operator renders now, async_chunk false): the scheduler builds no chunk adapter
  and the worker's connector binds the port alone.
The data path over that connector (put and get across stage processes) is test_nixl_chain.py's.
Skipped when `import nixl` fails. Cost: one vLLM import (about 10 s of CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.connector.test_nixl_chain import pytestmark  # noqa: F401  (the same skips: vllm_omni, nixl)
from tests.support.loopback import LOOPBACK_ENV

ROOT = Path(__file__).resolve().parents[2]
HOST, BASE = "127.0.44.2", 43000


def probe() -> dict[tuple[str, str], dict]:
    env = {**os.environ, **LOOPBACK_ENV, "UCX_TLS": "tcp,self,sm", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "operator"), str(ROOT / "engine_patches"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "tests.connector.nixl_chunks_probe", HOST, str(BASE)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    lines = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    for ln in lines:
        print(f"[connector] {ln}")
    assert lines, f"the probe printed no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return {(ln["variant"], ln["who"]): ln for ln in lines}


@pytest.fixture(scope="module")
def built() -> dict[tuple[str, str], dict]:
    return probe()


def test_streaming_chunks_over_nixl_binds_the_handshake_port_twice(built):
    worker, scheduler = built[("streaming", "worker")], built[("streaming", "scheduler")]
    assert worker.get("bound") == [HOST, BASE], worker
    assert "Address already in use" in scheduler.get("error", ""), scheduler


def test_what_the_operator_renders_builds_one_connector_that_binds(built):
    assert built[("rendered", "worker")] == {"variant": "rendered", "async_chunk": False, "who": "worker",
                                             "bound": [HOST, BASE]}
    assert ("rendered", "scheduler") not in built  # async_chunk false: the scheduler builds no chunk adapter
