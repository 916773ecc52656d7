"""The engine patches: one module per patch name (its `NAME` and `install()`), in PATCHES in the
order `apply_all` applies them.

The order matters where two patches wrap the same function:
- `replica_metrics` and `membership` both wrap `MembershipController._do_register`;
  `replica_metrics` goes first, so `membership`'s wrapper sits outside: a replica's metric series
  are registered when the head attaches it, and `membership` then bumps the epoch and, for a
  replica the operator told to leave while it was still attaching, detaches it and removes the
  series just registered. `tests/engine/test_patching.py` checks this chain.
- `replica_metrics` and `mm_cache_metrics` both wrap `OrchestratorBase._init_metrics_state` and
  `_process_llm_stage_outputs`; neither wrapper depends on the other's (each adds its own state
  and runs the original), so their order does not matter.

Patch names never change (they are in status.engine.patches, OMNISTAGE_DISABLE_PATCHES and the
registration report); a module may be renamed, a patch not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .._patching import Outcome, apply_patch
from . import (
    connector_ports,
    engine_liveness,
    frontend_cache,
    idle_stats,
    membership,
    mm_cache_metrics,
    public_routes,
    reattach,
    registration_report,
    replica_affinity,
    replica_aware_cache,
    replica_metrics,
    uuid_scope,
)


@dataclass(frozen=True)
class Patch:
    name: str
    install: Callable[[], str | None]  # _patching.apply_patch's contract: check everything, then change

    def apply(self) -> Outcome:
        """Once per process, never raises (recorded as skipped instead)."""
        return apply_patch(self.name, self.install)


PATCHES = tuple(Patch(m.NAME, m.install) for m in (
    frontend_cache,  # defect 1: processor-only cache on the shared stage-0 frontend
    uuid_scope,  # defect 2: no replica-scoped UUID write-back into the caller's prompt
    replica_metrics,  # defect 3: metric series follow membership
    mm_cache_metrics,  # defect 3: the frontend's multimodal cache statistics
    idle_stats,  # every engine core: the stats of the step that empties the scheduler are sent
    membership,  # the head's membership hooks behind the endpoint (membership_api)
    connector_ports,  # stages >= 1: connector ports without the replica term (one replica per pod)
    replica_aware_cache,  # cache mode replica-aware: tensors omitted per replica, after the pick
    replica_affinity,  # cache mode replica-aware: the pick prefers the replica holding the media
    # After membership (whose epoch it bumps): a silent stage engine is kept, not killed (issue 26).
    engine_liveness,
    public_routes,  # the public port's allow-list (vllm-omni's /v1/omni/sleep and the like refused)
    # Before registration_report, so its launcher wrapper sits inside: the report (outer) makes the
    # stage config a dict, this adds the instance, and the report lists reattach's outcome.
    reattach,
    # Headless replicas: the outcomes (read at registration, so every patch above is in them) go to the head.
    registration_report,
))
BY_NAME = {p.name: p for p in PATCHES}


def apply_all() -> list[Outcome]:
    return [p.apply() for p in PATCHES]
