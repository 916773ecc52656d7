"""The repository as the tests read it: its root, the committed sample OmniStage, and a script of
hack/ imported as a module."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = yaml.safe_load((ROOT / "manifests/samples/omnistage.yaml").read_text())


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
