"""The list of engine patches, applied in order by `apply_all`.

The order matters where two patches wrap the same function. `replica_metrics` and `membership`
both wrap `MembershipController._do_register`; `replica_metrics` goes first, so `membership`'s
wrapper sits outside: a replica's metric series are registered when the head attaches it, and
`membership` then bumps the epoch and, for a replica the operator told to leave while it was
still attaching, detaches it and removes the series just registered. `tests/engine/
test_patching.py` checks this chain.
"""

from __future__ import annotations

from . import (
    connector_ports,
    frontend_cache,
    membership_hooks,
    registration_report,
    replica_affinity,
    replica_aware_cache,
    replica_metrics,
    uuid_scope,
)
from ._patching import Outcome


def apply_all() -> list[Outcome]:
    # Each module exposes `apply()` built on _patching.apply_patch, which never raises.
    return [
        frontend_cache.apply(),  # defect 1: processor-only cache on the shared stage-0 frontend
        uuid_scope.apply(),  # defect 2: no replica-scoped UUID write-back into the caller's prompt
        *replica_metrics.apply(),  # defect 3: replica_metrics (series follow membership), mm_cache_metrics
        membership_hooks.apply(),  # the head's membership hooks behind the endpoint (membership_api)
        connector_ports.apply(),  # stages >= 1: connector ports without the replica term (one replica per pod)
        replica_aware_cache.apply(),  # cache mode replica-aware: tensors omitted per replica, after the pick
        replica_affinity.apply(),  # cache mode replica-aware: the pick prefers the replica holding the media
        # Headless replicas: the outcomes (read at registration, so every patch above is in them) go to the head.
        registration_report.apply(),
    ]
