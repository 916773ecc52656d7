"""A head change without an outage: blue/green within spec.rollout.

A change that reaches the head pod (engine image, spec.template, engine settings) cannot roll the
head in place without stopping service: its replicas are bound to it (they never register again)
and a new head serves only once it has loaded the model. So, when spec.rollout allows a surge:

  1. surging: a successor head (ROLE_NEXT_HEAD, outside the Services) is created beside the
     serving one with its first min(maxSurge - 1, replicas - 1) replicas and its spec.standby
     standbys (the serving set's standbys are deleted: they serve nothing), while the serving set serves;
  2. moving: once the successor is Ready and those replicas joined, the role labels move the
     Services: the successor turns ROLE_HEAD first (both heads are selected for a moment, never
     neither), then the head it replaces, its predecessor, ROLE_OLD_HEAD;
  3. draining: the predecessor's replicas leave it, drained, all at once (no new request reaches
     them), the serving set grows into the GPUs they free (never more than replicas + maxSurge pods
     in all, its standbys beside: it joins them first), and the predecessor is deleted once they are
     gone; its preStop hook waits for what it accepted.

The three names are the heads' role labels', in every layer: serving (ROLE_HEAD), successor
(ROLE_NEXT_HEAD), predecessor (ROLE_OLD_HEAD); the set of either of the last two is the one beside
the serving set (Observed.beside, Swap.beside, BesideServing).

Each set is a state.Pass of its own (its head, its replicas, what its head said), so every rule of
a pass holds in both; this module only says how many replicas each gets and when the labels move.
Without a surge (maxSurge 0, a multi-stage pipeline, a head that serves nothing anyway) or when
the successor finds no node (no GPU free for a successor head), the head is replaced in place as
before, and RolloutSurge says so one pass before the head is deleted.
"""

from __future__ import annotations

from ..api.conditions import Cond, EventReason, Progress, Reason, Type
from ..api.conditions import get as condition
from ..names import ROLE_HEAD, ROLE_NEXT_HEAD, ROLE_OLD_HEAD
from ..render import render_head_pod
from ..render.pods import head_pod_name
from . import pods
from .actions import Action, CreatePod, OnPredecessor, OnSuccessor, PostEvent, SetRole
from .state import Pass, Phase, Swap, outdated


def in_place_why(p: Pass) -> str | None:
    """Why this head change cannot run a successor head beside the serving one (None: it can)."""
    if p.t.spec.rollout.max_surge < 1:
        return "spec.rollout.maxSurge is 0"
    if p.t.spec.stages:
        return ("a multi-stage head serves only once a pool pod of every stage is bound to it: a successor "
                "head would need a second pipeline's GPUs")
    if not pods.ready(p.head):
        return f"head pod {pods.name(p.head)} is not Ready (it serves nothing to hand over)"
    return None


def begin(p: Pass) -> list[Action]:
    """Before the serving set's steps: start, follow or give up a head change (p.change)."""
    acts: list[Action] = []
    t, head, beside = p.t, p.head, p.o.beside
    beside_head = beside.head if beside is not None else None  # the successor, or the predecessor
    if beside_head is None:
        if head is None or pods.terminating(head) or pods.terminal(head) or not outdated(p):
            return acts
        why = in_place_why(p)
        if why is not None:
            acts += _in_place(p, why, Reason.HEAD_IN_PLACE)
            return acts
        name = head_pod_name(t, pods.template_hash(p.want_head))
        acts.append(
            CreatePod(
                render_head_pod(t, name, ROLE_NEXT_HEAD),
                EventReason.CREATED_HEAD,
                f"created head pod {{pod}} beside {pods.name(head)}: the Services move to it once it serves",
            )
        )
        acts.append(PostEvent(
            "Normal",
            Progress.SURGING_HEAD,
            f"head pod {pods.name(head)}'s template changed: starting {name} "
            f"beside it (spec.rollout.maxSurge {t.spec.rollout.max_surge})",
        ))
        p.progressing.append(Progress.SURGING_HEAD)
        p.change.keep_head = True
        return acts
    # The set beside is a pass of its own; its head is compared with the same rendered template.
    q = Pass(t, beside, p.at, want_head=p.want_head)
    q.change.names_held, p.change.names_held = p.o.replicas, beside.replicas  # replica names are shared
    if pods.role(beside_head) in (ROLE_OLD_HEAD, ROLE_HEAD):  # the predecessor: the Services moved to p's
        if pods.role(beside_head) == ROLE_HEAD:  # the move was cut off between its two patches: finish it
            acts.append(SetRole(pods.name(beside_head), pods.uid(beside_head), ROLE_OLD_HEAD))
        _draining(p, q)
        return acts
    successor = beside_head  # ROLE_NEXT_HEAD
    if head is None or pods.terminating(head) or pods.terminal(head):
        # Nothing serves to hand over from (the old head died, or was replaced in place): the
        # successor is the head now.
        acts.append(SetRole(pods.name(successor), pods.uid(successor), ROLE_HEAD))
        p.change.create_head = False
        return acts
    stuck = pods.unschedulable(successor)
    if stuck and not pods.terminating(successor):
        # The successor takes the old head's GPU: the old head is deleted (on the pass after the one
        # whose status says so) and the successor, scheduled then, is promoted as above.
        acts += _in_place(p, f"no node can take the successor head ({pods.name(successor)}: {stuck})",
                  Reason.NO_CAPACITY_FOR_SURGE)
        return acts
    p.change.keep_head = True
    if pods.terminating(successor):
        return acts  # given up (its template changed again): the next pass starts a new one
    if pods.template_hash(successor) != pods.template_hash(p.want_head):
        acts.append(p.deletion(successor, Progress.SURGING_HEAD, f"deleted head pod {pods.name(successor)}: "
                               "the template changed again before it served"))
        return acts
    desired = t.replica_pods
    q.change.replica_target = min(desired, t.spec.rollout.max_surge - 1)
    # The standbys come up beside the successor (they are bound to the head they registered with); the
    # serving set's go at once, no drain (they serve nothing), and give it their GPUs.
    p.change.standby_target = 0
    p.change.swap = Swap(Phase.SURGING, successor=q, first=q.change.replica_target)
    p.progressing.append(Progress.SURGING_HEAD)
    return acts


def _in_place(p: Pass, why: str, reason: Reason) -> list[Action]:
    """The head replaced in place, said first: deleted on the pass after the one whose status says so."""
    acts: list[Action] = []
    p.change.in_place = (reason, why)
    before = condition(p.previous, Type.ROLLOUT_SURGE)
    if before.get("reason") != reason or before.get("status") != "False":
        acts.append(PostEvent(
            "Warning",
            reason,
            f"replacing head pod {pods.name(p.head)} in place: {why}. Serving stops until "
            "the new head and its replicas are up",
        ))
        p.change.keep_head = True
    return acts


def _draining(p: Pass, predecessor: Pass) -> None:
    t = p.t
    predecessor.change.replica_target = predecessor.change.standby_target = 0
    p.change.keep_head = True  # the next head change waits until this one is done
    old_pods = (0 if pods.terminating(predecessor.head) else 1) + len(predecessor.o.replicas)
    desired = t.replica_pods
    # The new set grows into the GPUs the old one frees: never more than replicas + maxSurge pods.
    p.change.replica_target = max(0, min(desired, desired + t.spec.rollout.max_surge - old_pods))
    p.change.swap = Swap(Phase.DRAINING, predecessor=predecessor)
    p.progressing.append(Progress.MOVED_SERVICE)


def finish(p: Pass) -> list[Action]:
    """After both sets' steps (plan.py runs the one beside the serving set): its actions wrapped for
    act, then the Services' move (surging) or the predecessor's deletion (draining)."""
    acts: list[Action] = []
    swap = p.change.swap
    beside = swap.beside
    if beside.actions:
        wrap = OnSuccessor if swap.phase == Phase.SURGING else OnPredecessor
        acts.append(wrap(tuple(beside.actions)))
        beside.actions = []
    successor, predecessor = swap.successor, swap.predecessor
    if successor is not None and serves(successor, swap.first):
        joined = sum(1 for r in successor.live(None) if successor.serves(r))
        acts += [SetRole(pods.name(successor.head), pods.uid(successor.head), ROLE_HEAD),
                 SetRole(pods.name(p.head), pods.uid(p.head), ROLE_OLD_HEAD),
                 PostEvent("Normal", Progress.MOVED_SERVICE,
                           f"Services moved from head pod {pods.name(p.head)} to {pods.name(successor.head)} "
                           f"({joined} of its replicas joined); draining {pods.name(p.head)} and its "
                           f"{len(p.live(None))} replicas")]
        p.progressing.append(Progress.MOVED_SERVICE)
    elif predecessor is not None and not predecessor.o.replicas and not pods.terminating(predecessor.head):
        acts.append(p.deletion(
            predecessor.head,
            Progress.RETIRED_HEAD,
            f"deleted head pod {pods.name(predecessor.head)}: the Services moved to "
            f"{pods.name(p.head) if p.head else 'its successor'} and its replicas left",
        ))
    return acts


def serves(successor: Pass, first: int) -> bool:
    """The successor can take the Services: Ready, its cache guarantee held, `first` replicas joined."""
    if not successor.head_talks() or (successor.verdict is not None and not successor.verdict.consistent):
        return False
    return sum(1 for r in successor.live(None) if successor.serves(r)) >= first


def describe(p: Pass) -> Cond | None:
    """RolloutSurge while a head change runs (None: none runs)."""
    bounds = f"maxSurge {p.t.spec.rollout.max_surge}"
    if p.change.in_place is not None:
        reason, why = p.change.in_place
        return Cond(
            Type.ROLLOUT_SURGE,
            False,
            reason,
            f"head pod {pods.name(p.head)} is replaced in place: {why}; "
            "serving stops until the new head and its replicas are up",
        )
    if p.change.swap is None:
        if p.change.keep_head and outdated(p):
            return Cond(Type.ROLLOUT_SURGE, True, Reason.SURGING, "head change: starting a successor beside "
                        f"{pods.name(p.head)}; the Services move to it once it serves ({bounds})")
        return None
    successor, predecessor = p.change.swap.successor, p.change.swap.predecessor
    if successor is not None:
        joined = sum(1 for r in successor.live(None) if successor.serves(r))
        return Cond(
            Type.ROLLOUT_SURGE,
            True,
            Reason.SURGING,
            f"head change: {pods.name(successor.head)} starts beside {pods.name(p.head)} (Ready: "
            f"{pods.ready(successor.head)}, {joined}/{p.change.swap.first} of its first replicas joined); "
            f"the Services move to it once it serves ({bounds})",
        )
    return Cond(
        Type.ROLLOUT_SURGE,
        True,
        Reason.SURGING,
        f"head change: the Services moved to {pods.name(p.head) if p.head else '?'}; its predecessor "
        f"{pods.name(predecessor.head)} drains ({len(predecessor.o.replicas)} replicas left), the new set "
        f"grows into their GPUs ({bounds})",
    )
