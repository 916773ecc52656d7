"""Unit tier fixtures. What the unit tests share besides fixtures is in tests/support/ (repo.py: the
repository's root, the sample, hack/ scripts; specs.py: refused_exactly)."""

import pytest
from omnistage.api import ENGINE_IMAGE_ENV
from omnistage.api.security import ALLOWED_HOST_PATHS_ENV


@pytest.fixture(autouse=True)
def _no_operator_engine_image(monkeypatch):
    """Renderings use the built-in engine image unless a test sets the operator's configuration."""
    monkeypatch.delenv(ENGINE_IMAGE_ENV, raising=False)


@pytest.fixture(autouse=True)
def _no_allowed_host_paths(monkeypatch):
    """No host directory is allowed unless a test sets the operator's configuration."""
    monkeypatch.delenv(ALLOWED_HOST_PATHS_ENV, raising=False)
