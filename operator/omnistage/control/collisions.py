"""Names another object of the namespace needs: the operator names children after
their OmniStage or OmniStagePool, and two names can give the same child. An OmniStage named X-master
would apply X's master Service (its own OpenAI Service) and take X's traffic; one named X-replica-3
would create the Secret X-replica-3-membership, X's third replica's credential, and X's scale to 4
would never land; a pool named X-replica would make X's replica pods. No rule on one object can see
this: the decision compares the object with the others of its namespace (Observed.neighbours, from the
watches) through the table of derived names (api/child_names.collisions).

The older object keeps the names (its children came first); the newer is refused, writes no child, and
says which object and which names in a condition and an Event. For an OmniStage it is an InvalidSpec
(reason NameCollision, field metadata.name): nothing running is touched, as for any refused spec. For
a pool, its Ready condition, like a pool that does not fit its OmniStage (pools.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..api import KIND, POOL_KIND
from ..api.child_names import OMNISTAGE_NAMES, POOL_NAMES, Derived, collisions
from ..api.conditions import Reason
from ..api.validation import InvalidSpec

ROWS: dict[str, tuple[Derived, ...]] = {KIND: OMNISTAGE_NAMES, POOL_KIND: POOL_NAMES}


@dataclass(frozen=True, order=True)
class Named:
    """An OmniStage or an OmniStagePool of the namespace as the decision sees it; ordered by age (the
    creation time, then kind and name: one order both objects of a collision agree on)."""

    created: str  # metadata.creationTimestamp (RFC 3339 in UTC: its text sorts as its time)
    kind: str  # KIND or POOL_KIND
    name: str


def named(obj: Mapping[str, Any], kind: str = KIND) -> Named:
    meta = obj.get("metadata") or {}
    return Named(meta.get("creationTimestamp") or "", kind, meta.get("name") or "")


def clash(me: Named, others: Iterable[Named]) -> str | None:
    """Why `me` may write none of its children: the older objects that need some of their names."""
    found = [(o, shared) for o in others if o < me
             and (shared := collisions(me.name, ROWS[me.kind], o.name, ROWS[o.kind]))]
    if not found:
        return None
    return (
        "; ".join(f"{me.kind} {me.name} would write {', '.join(shared)}, which the older {o.kind} {o.name} "
                  "writes" for o, shared in found)
        + f": the older keeps its names, and this {me.kind} writes none of its children: delete it and "
        "create it under another name, one that no other OmniStage or OmniStagePool of the namespace makes "
        "a child of (NAME-master, NAME-replica-INDEX, POOL-INDEX)"
    )


def refusal(obj: Mapping[str, Any], neighbours: Iterable[Named]) -> InvalidSpec | None:
    """An OmniStage's: None, or its refusal as an InvalidSpec on metadata.name (plan._invalid)."""
    why = clash(named(obj), neighbours)
    return None if why is None else InvalidSpec([("metadata.name", why)], Reason.NAME_COLLISION)


def pool_problem(pool: Mapping[str, Any], names: Iterable[Named]) -> tuple[str, str] | None:
    """A pool's (reason, message), None when its names are its own. `names`: the objects of the
    namespace the pass knows of (the OmniStage and its Observed.neighbours); the pool is skipped."""
    me = named(pool, POOL_KIND)
    why = clash(me, (n for n in names if n != me))
    return None if why is None else (Reason.NAME_COLLISION, why)
