"""An OmniStagePool's status, from the pass that decides for its pods (state.Pass): its pods and
standbys as the plan leaves them, each pod's membership at the head by stage, and its Ready. Pure, like
status.py, whose builders it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..api import statuses
from ..api.conditions import Cond, Reason, Type, merge, timestamp
from ..api.statuses import MemberState
from ..render.common import Target, pool_selector
from . import pods, pools, standby
from .status import dump, present

if TYPE_CHECKING:
    from .state import Pass


def pool_statuses(p: Pass, at: str) -> dict[str, dict[str, Any]]:
    """The status of each pool whose status changed (the pass that decides for its pods says it)."""
    out = {}
    for f in p.pools:
        live, standbys = standby.split(p, p.staying(f.name))
        status = pool_status(f, p.t, live, p.member_of, at, [(s, standby.state(p, s)) for s in standbys])
        if status != (f.obj.get("status") or {}):
            out[f.name] = status
    return out


def pool_status(f: pools.Fitted, t: Target | None, staying: list[dict[str, Any]],
                member_of: Callable[[dict[str, Any], int], dict[str, Any] | None] = lambda pod, stage: None,
                at: str | None = None, standbys: Sequence[tuple[dict[str, Any], MemberState]] = ()
                ) -> dict[str, Any]:
    """An OmniStagePool's status. `staying`: its pods not on their way out, its standbys apart
    (`standbys`: each with its state, standby.state); `member_of(pod, stage)`: the head's listing
    entry of the pod's replica of that stage."""
    previous = f.obj.get("status") or {}
    generation = f.obj["metadata"].get("generation")
    ids = f.pool.spec.stage_ids if f.pool else []
    members = []
    for r in sorted(staying, key=pods.index):
        listed = {k: member_of(r, k) for k in pods.stage_ids(r)}
        done = all(mm is not None and mm.get("pod") == pods.name(r) for mm in listed.values())
        registered = any(mm is not None for mm in listed.values())
        state = MemberState.JOINED if done else (
            MemberState.JOINING if registered and pods.containers_ready(r) else MemberState.PENDING)
        members.append(statuses.PoolMemberStatus(**present(
            pod=pods.name(r), ip=pods.ip(r), state=str(state),
            replica_ids={str(k): mm["replicaId"] for k, mm in listed.items() if mm is not None})))
    # Ready and joined: the pod's Ready alone may be kwok's start-up word.
    ready_pods = sum(1 for r, m in zip(sorted(staying, key=pods.index), members, strict=True)
                     if pods.ready(r) and m.state == MemberState.JOINED)
    registered = sum(1 for m in members if m.state == MemberState.JOINED)
    for s, state in sorted(standbys, key=lambda ss: pods.index(ss[0])):
        listed = {k: mm for k in pods.stage_ids(s) if (mm := member_of(s, k)) is not None}
        members.append(statuses.PoolMemberStatus(
            pod=pods.name(s), ip=pods.ip(s), state=str(state), standby=True,
            replica_ids={str(k): mm["replicaId"] for k, mm in listed.items()}))
    if f.problem:
        cond = Cond(Type.READY, False, f.problem[0], f.problem[1])
    else:
        desired = f.pool.spec.replicas
        ok = ready_pods == registered == len(staying) == desired
        cond = Cond(Type.READY, ok, Reason.ALL_REPLICAS_SERVING if ok else Reason.WAITING,
                    f"{ready_pods}/{desired} pods ready, {registered} joined on the head for stages "
                    + ", ".join(map(str, ids)))
    return dump(statuses.OmniStagePoolStatus(**present(
        observed_generation=generation,
        replicas=len(staying),
        ready_replicas=ready_pods,
        registered_replicas=registered,
        standby_replicas=len(standbys),
        ready_standby_replicas=sum(1 for _, state in standbys if state == MemberState.STANDBY),
        selector=pool_selector(t, f.name) if t is not None else previous.get("selector", ""),
        members=members,
        conditions=merge(previous.get("conditions", []), [cond], generation, at or timestamp()),
    )))

