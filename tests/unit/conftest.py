import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest
import yaml
from omnistage.api import ENGINE_IMAGE_ENV
from omnistage.api.security import ALLOWED_HOST_PATHS_ENV
from omnistage.api.validation import InvalidSpec, validate_omnistage

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())


def refused_exactly(obj: dict, field: str, words: str) -> None:
    """validate_omnistage finds exactly one problem in `obj`, at `field`, its message holding `words`,
    and names the field where the InvalidSpec condition and Event will."""
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(obj)
    assert [f for f, _ in err.value.problems] == [field], err.value.problems
    assert words in err.value.problems[0][1]
    assert field in str(err.value)


def hack_script(filename: str) -> ModuleType:
    """A script of hack/ imported as a module (its name has dashes), registered in sys.modules
    because dataclasses look their module up by name."""
    spec = importlib.util.spec_from_file_location(
        filename.removesuffix(".py").replace("-", "_"), ROOT / "hack" / filename
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_operator_engine_image(monkeypatch):
    """Renderings use the built-in engine image unless a test sets the operator's configuration."""
    monkeypatch.delenv(ENGINE_IMAGE_ENV, raising=False)


@pytest.fixture(autouse=True)
def _no_allowed_host_paths(monkeypatch):
    """No host directory is allowed unless a test sets the operator's configuration."""
    monkeypatch.delenv(ALLOWED_HOST_PATHS_ENV, raising=False)
