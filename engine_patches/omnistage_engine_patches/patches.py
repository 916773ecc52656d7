"""The list of engine patches, applied in order by `apply_all`."""

from __future__ import annotations

from . import frontend_cache, uuid_scope
from ._patching import Outcome


def apply_all() -> list[Outcome]:
    # Each module exposes `apply() -> Outcome` built on _patching.apply_patch.
    return [
        frontend_cache.apply(),  # defect 1: processor-only cache on the shared stage-0 frontend
        uuid_scope.apply(),  # defect 2: no replica-scoped UUID write-back into the caller's prompt
    ]
