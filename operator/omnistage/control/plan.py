"""The reconcile decision as one pure function: plan(t, observed) -> Plan(actions, status, pools).

Nothing here talks to the API server or a head: `reconcile.observe` reads, `act` executes, and
status.py describes what the decision leaves. Keeping the decision pure lets a table of situations
(tests/unit/test_plan.py) pin down every rule, and makes a pass cheap to reason about: the same
observation always yields the same actions.

The steps run in dependency order (children, a spare head's take-over, head, spare head, head
restart, stale replicas, template roll, scale, standbys' holds, membership) on one Pass (state.py),
which records what each decided, so that a pod deleted early in the pass is not counted, joined or
deleted again by a later step. Each step is a function of that state in the module named for what
it decides; this module holds their order, once for the serving set and once for the set beside it
during a head change (the successor's or the predecessor's: headswap.py), and plan().
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, NamedTuple

from ..api.conditions import Cond, Reason, Type, merge, timestamp
from ..api.conditions import get as condition
from ..api.validation import InvalidSpec
from ..render.common import Target
from . import (
    children,
    collisions,
    head,
    headswap,
    identity,
    liveness,
    membership,
    pool_status,
    rollout,
    spare,
    stages,
    standby,
    status,
)
from .actions import Action, Observed, PostEvent
from .state import Pass


class Plan(NamedTuple):
    actions: list[Action]  # for act, in order
    status: dict[str, Any]  # the OmniStage's, as the actions leave it
    pools: dict[str, dict[str, Any]]  # OmniStagePool name -> its status, for those that changed


class Decision(NamedTuple):
    """plan()'s answer and the steps' state its status describes: a pass describes it again, told what
    its act step could not do (plan_with_report), instead of deciding again."""
    plan: Plan
    made: Pass | None  # None: an invalid spec or a refused Secret (their status reads no act report)


def plan(t: Target | InvalidSpec, o: Observed, at: str | None = None) -> Plan:
    """The one decision. `t` is the validated target or the InvalidSpec it raised; `at` is the
    timestamp for condition transitions (a parameter, so the function stays pure)."""
    return decision(t, o, at).plan


def decision(t: Target | InvalidSpec, o: Observed, at: str | None = None) -> Decision:
    at = at or timestamp()
    generation = o.obj["metadata"].get("generation")
    if isinstance(t, InvalidSpec):
        return Decision(_invalid(t, o, generation, at), None)
    taken = collisions.refusal(o.obj, o.neighbours)
    if taken is not None:  # an older object of the namespace needs names its children would take
        return Decision(_invalid(taken, o, generation, at), None)
    if o.secret_refused:
        return Decision(_secret_refused(t, o, generation, at), None)
    p = decided_pass(t, o, at)
    made = Plan(p.actions, status.omnistage_status(p, generation, at), pool_status.pool_statuses(p, at))
    return Decision(made, p)


def plan_with_report(d: Decision, problems: tuple[str, ...], refused: tuple[str, ...]) -> Plan:
    """The decision's plan, its status told what the act step could not do (`problems`, the children
    the API server `refused`: what status reads as Observed.problems and .refused). The steps do not
    read them, so the decision stands as made: only its status is written again."""
    if d.made is None or (not problems and not refused):
        return d.plan
    p = d.made
    p.o = replace(p.o, problems=problems, refused=refused)
    return d.plan._replace(status=status.omnistage_status(p, p.o.obj["metadata"].get("generation"), p.at))


# The steps, in dependency order, each a function of the pass's state that returns its actions (and
# records in the Pass what the later steps read: the pods it retires, the roles it gives). The
# serving set's:
SERVING_STEPS: tuple[Callable[[Pass], list[Action]], ...] = (
    children.ensure,
    identity.restore,
    spare.take_over,
    headswap.begin,
    head.head_pod,
    spare.keep,
    head.engine_report,
    head.membership_read,
    rollout.retire_stale,
    rollout.roll,
    rollout.scale,
    standby.hold,
    membership.sync,
    membership.mark_joined,
    liveness.announce,
    stages.announce,
)
# The steps of the set beside the serving one while a head change runs (the successor's or the predecessor's:
# headswap.begin makes it): its membership and its replicas.
BESIDE_SERVING_STEPS: tuple[Callable[[Pass], list[Action]], ...] = (
    head.engine_report,
    head.membership_read,
    rollout.retire_stale,
    rollout.scale,
    standby.hold,
    membership.sync,
    membership.mark_joined,
)


def decided_pass(t: Target, o: Observed, at: str | None = None) -> Pass:
    p = Pass(t, o, at or timestamp())
    for step in SERVING_STEPS:
        p.actions += step(p)
    if p.change.swap is not None:
        beside = p.change.swap.beside
        for step in BESIDE_SERVING_STEPS:
            beside.actions += step(beside)
        p.actions += headswap.finish(p)
    return p


def _invalid(err: InvalidSpec, o: Observed, generation: int | None, at: str) -> Plan:
    """Loses nothing: running pods stay as they are until the spec is fixed, and the children as the
    last valid spec rendered them (Observed.last_valid): an edit someone makes meanwhile (a
    NetworkPolicy peer admitting every namespace) is undone as on any pass."""
    previous = o.obj.get("status") or {}
    message = str(err)
    actions: list[Action] = []
    if o.last_valid is not None:
        actions += children.ensure(Pass(o.last_valid, o, at))
    if condition(previous, Type.CONFIG_RENDERED).get("message") != message:
        actions.append(PostEvent("Warning", err.reason, message))
    conds = [Cond(Type.CONFIG_RENDERED, False, err.reason, message),
             Cond(Type.READY, False, err.reason, message)]
    return Plan(
        actions, {**previous, "conditions": merge(previous.get("conditions", []), conds, generation, at)}, {}
    )


def _secret_refused(t: Target, o: Observed, generation: int | None, at: str) -> Plan:
    """A Secret of the membership token's name that the OmniStage does not own: pods would mount a
    token the operator did not issue. Loses nothing: the children are kept as rendered, running pods
    stay as they are, and nothing is created or deleted until the Secret is deleted or renamed."""
    p = Pass(t, o, at)
    actions = children.ensure(p)
    message = o.secret_refused or ""
    if condition(p.previous, Type.MEMBERSHIP_SYNCED).get("message") != message:
        actions.append(PostEvent("Warning", Reason.NOT_SYNCED, message))
    conds = [Cond(Type.MEMBERSHIP_SYNCED, False, Reason.NOT_SYNCED, message),
             Cond(Type.READY, False, Reason.WAITING, f"waiting for {Type.MEMBERSHIP_SYNCED}: {message}")]
    return Plan(
        actions,
        {**p.previous, "conditions": merge(p.previous.get("conditions", []), conds, generation, at)},
        {},
    )
