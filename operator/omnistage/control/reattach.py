"""Replicas that outlive their head (engine patch `reattach`): after the head's container restarted,
or the head pod was replaced (deleted, its node lost), a replica whose engine reported the patch
applied is kept, not rolled. Its engine notices the new head process (at the old address, else
through the master Service), registers again and handshakes without loading its model; the new head
lists it as a fresh registration from the pod's address, which membership.sync joins like any
other. Pure.

Three answers for a replica made for another head pod or before the head's last restart (`fate`):
- REJOINED: the new head lists a registration from its address: its `head-uid` and `head-restarts`
  annotations are brought up to date, and from then on it is an ordinary replica (sync joins it);
- WAITING: it reported `reattach: applied` and the head has been Ready (a spare head: serving, since
  it took over) for less than REATTACH_SECONDS: left alone (status Progressing, reason Reattaching);
- ROLL: neither (an older plugin, the patch skipped on another vLLM, a pool pod, or the bound is
  past: a wedged engine): rolled as before.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from omnistage_engine_patches import contract

from ..names import A_HEAD_RESTARTS, A_HEAD_UID, A_REATTACH
from . import pods
from .actions import Action, Annotate, MarkJoined

if TYPE_CHECKING:
    from .state import Pass

#: How long a re-attachable replica may take, from the new head's Ready, to register with it again. Its
#: engine pings the head every second and re-registers within seconds; the margin is for a loaded node.
REATTACH_SECONDS = 60
REJOINED, WAITING, ROLL = "rejoined", "waiting", "roll"


def reported(p: Pass, pod: dict[str, Any]) -> str | None:
    """The `reattach` outcome the pod's stage-0 engine reported in its registration, as listed now."""
    mm = p.member_of(pod) if not pods.pool(pod) else None
    outcome = ((mm or {}).get("patches") or {}).get(contract.REATTACH)
    return outcome if isinstance(outcome, str) else None


def remember(p: Pass, pod: dict[str, Any]) -> list[Action]:
    """Keep on the pod what its engine reported: after a head restart the new head's listing does
    not know the pod until it re-attached, and this is what says whether to wait for it."""
    acts: list[Action] = []
    outcome = reported(p, pod)
    if outcome is not None and outcome != pods.annotation(pod, A_REATTACH):
        acts.append(Annotate(pods.name(pod), {A_REATTACH: outcome}))
    return acts


def fate(p: Pass, pod: dict[str, Any]) -> str:
    if pods.pool(pod) is not None or pods.annotation(pod, A_REATTACH) != contract.APPLIED \
            or p.o.beside is not None:  # a planned head change drains the old set its own way
        return ROLL
    if p.listing is not None and p.member_of(pod) is not None:
        return REJOINED
    ready_since = pods.ready_since(p.head)
    if ready_since is None:
        return WAITING  # the new head's own engine is still loading: nobody can attach yet
    # A spare that took over was Ready long before: its replicas have looked for it since the take-over.
    since = max(t for t in (datetime.fromisoformat(ready_since), pods.serving_since(p.head),
                            datetime.fromisoformat(p.serving_since) if p.serving_since else None) if t)
    waited = (datetime.fromisoformat(p.at) - since).total_seconds()
    return WAITING if waited < REATTACH_SECONDS else ROLL


def wait(p: Pass, pod: dict[str, Any]) -> list[Action]:
    """Not serving until it registered again: NotReady meanwhile, and no join tried (there is no
    registration to join yet)."""
    acts: list[Action] = []
    p.reattaching.add(pods.uid(pod))
    if pods.gated(pod) and pods.joined_condition(pod):
        acts.append(MarkJoined(pods.name(pod), pods.uid(pod), False))
    return acts


def rejoined(p: Pass, pod: dict[str, Any]) -> list[Action]:
    return [Annotate(pods.name(pod), {A_HEAD_RESTARTS: str(pods.restarts(p.head)),
                                      A_HEAD_UID: pods.uid(p.head)})]
