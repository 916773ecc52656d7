"""The list of engine patches, applied in order by `apply_all`."""

from __future__ import annotations

from ._patching import Outcome


def apply_all() -> list[Outcome]:
    # Each module exposes `apply() -> Outcome` built on _patching.apply_patch.
    return []
