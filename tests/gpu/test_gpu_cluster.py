"""Tier 4: the serving reproduction against a real GPU cluster. Skipped unless one is configured:
OMNISTAGE_GPU_OMNISTAGE=namespace/name names an OmniStage already running on H200 nodes."""

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
TARGET = os.environ.get("OMNISTAGE_GPU_OMNISTAGE")


@pytest.mark.skipif(not TARGET, reason="no GPU cluster configured (set KUBECONFIG and OMNISTAGE_GPU_OMNISTAGE)")
def test_serving_reproduction_on_gpus():
    namespace, name = TARGET.split("/", 1)
    script = pathlib.Path(__file__).resolve().parents[2] / "hack/gpu-repro.py"
    result = subprocess.run([sys.executable, str(script), "--namespace", namespace, "--name", name],
                            capture_output=True, text=True, timeout=3 * 3600, check=False)
    print(result.stdout, result.stderr)
    assert result.returncode == 0
