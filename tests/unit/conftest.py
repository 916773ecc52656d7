import pathlib

import pytest
import yaml
from omnistage.api import ENGINE_IMAGE_ENV

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())


@pytest.fixture(autouse=True)
def _no_operator_engine_image(monkeypatch):
    """Renderings use the built-in engine image unless a test sets the operator's configuration."""
    monkeypatch.delenv(ENGINE_IMAGE_ENV, raising=False)
