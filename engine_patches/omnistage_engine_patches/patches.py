"""The list of engine patches, applied in order by `apply_all`."""

from __future__ import annotations

from . import frontend_cache, membership, replica_metrics, uuid_scope
from ._patching import Outcome


def apply_all() -> list[Outcome]:
    # Each module exposes `apply() -> Outcome` built on _patching.apply_patch.
    return [
        frontend_cache.apply(),  # defect 1: processor-only cache on the shared stage-0 frontend
        uuid_scope.apply(),  # defect 2: no replica-scoped UUID write-back into the caller's prompt
        *replica_metrics.apply(),  # defect 3: replica_metrics (series follow membership), mm_cache_metrics
        membership.apply(),  # the head's membership hooks behind the membership endpoint (membership_api)
    ]
