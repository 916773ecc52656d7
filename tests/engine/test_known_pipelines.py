"""The operator's table of vllm-omni pipelines (operator/omnistage/known_pipelines.py) against the
installed vllm-omni's real registry (`OMNI_PIPELINES`) and shipped deploy YAMLs (SHIPPED_DEPLOY, read
with vllm-omni's `resolve_deploy_yaml` and `load_omni_transfer_config`), by the same code that generates
the table (hack/gen-known-pipelines.py). A vllm-omni upgrade that adds, drops or reshapes a pipeline
or changes a shipped deploy config the operator renders from fails here until the table is regenerated."""

from __future__ import annotations

import importlib.util
from importlib import metadata
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

from omnistage import known_pipelines
from omnistage.api.field_rules import MULTI_STAGE_PIPELINES, SINGLE_STAGE_EXAMPLES

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_known_pipelines", ROOT / "hack" / "gen-known-pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_is_the_installed_registry():
    gen = _generator()
    assert known_pipelines.VLLM_OMNI_VERSION == metadata.version("vllm-omni")
    assert known_pipelines.PIPELINES == gen.registry_table(), "run: python hack/gen-known-pipelines.py"
    assert known_pipelines.SHIPPED_DEPLOY == gen.shipped_table(), "run: python hack/gen-known-pipelines.py"


def test_qwen3_omni_resolves_to_the_speech_pipeline_and_its_thinker_only_variant():
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES

    assert known_pipelines.PIPELINES["qwen3_omni_moe"] == ("thinker", "talker", "code2wav")
    assert [s.model_stage for s in OMNI_PIPELINES["qwen3_omni_moe_thinker_only"].stages] == ["thinker"]
    assert "qwen3_omni_moe" in MULTI_STAGE_PIPELINES
    assert not set(SINGLE_STAGE_EXAMPLES) & set(MULTI_STAGE_PIPELINES)
