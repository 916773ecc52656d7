"""A pass's working state: the observation, what the steps decided so far, and the read helpers the
steps share. The steps are functions of it, each in the module named for what it decides (head.py,
membership.py, rollout.py, headswap.py, children.py, stages.py, identity.py, liveness.py); plan.py
runs them in order. Once the steps ran it is the decision that status.py describes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from omnistage_engine_patches import contract

from ..api import OmniStagePoolSpec
from ..names import ROLE_STANDBY
from ..render import render_head_pod, render_replica_pod
from ..render.common import Pool, Target
from ..render.pods import render_pool_pod
from . import collisions, engine_truth, pods, pools
from .actions import Action, DeletePod, Observed

# A pool pod's drain when its pool is gone (the pool's own setting went with it).
DEFAULT_POOL_DRAIN = OmniStagePoolSpec.model_fields["drain_timeout_seconds"].default


class Phase(StrEnum):
    SURGING = "surging"  # the successor starts beside the serving head
    DRAINING = "draining"  # the Services moved; the predecessor's set drains


@dataclass
class Swap:
    """The two sets of a running head change, named by their heads' roles: the pass's own set is the
    serving one; beside it runs the successor's (surging: ROLE_NEXT_HEAD, outside the Services) or the
    predecessor's (draining: ROLE_OLD_HEAD, the Services moved away from it)."""

    phase: Phase
    successor: Pass | None = None  # surging: the successor head's set
    predecessor: Pass | None = None  # draining: the predecessor head's set (ROLE_OLD_HEAD)
    first: int = 0  # replicas the successor gets before the Services move

    @property
    def beside(self) -> Pass:
        """The set beside the serving one: the successor's while surging, the predecessor's while draining."""
        beside = self.successor if self.phase == Phase.SURGING else self.predecessor
        assert beside is not None
        return beside


@dataclass
class HeadChange:
    """What headswap.begin decided for one set while a head change runs (or is said before it runs in
    place); the head and rollout steps and the status read it."""

    keep_head: bool = False  # an outdated head is not deleted by head.head_pod
    create_head: bool = True  # a missing head is created by head.head_pod
    replica_target: int | None = None  # stage-0 replicas this set gets (None: t.replica_pods)
    standby_target: int | None = None  # standbys this set keeps (None: spec.standby)
    # The replicas of the set across the head change (the serving set's for the one beside it, and the
    # other way round): they hold replica names this set does not give out.
    names_held: tuple[dict[str, Any], ...] = ()
    swap: Swap | None = None  # the two sets, while both run
    in_place: tuple[str, str] | None = None  # (reason, why) a head change cannot surge


def outdated(p: Pass) -> bool:
    return p.head is not None and pods.template_hash(p.head) != pods.template_hash(p.want_head)


class Pass:
    """One pass's working state: the observation plus what the steps decided so far. Once decided_pass()
    returns it is the decision that status.py describes.

    Its liveness predicates, each narrower than the one before it:
    - of the head pod: head_staying (not terminating, not deleted by this pass) > head_live (and has
      an IP) > head_talks (and a client exists and it answers: Ready or started; the only head whose
      answers the plan reads) ; head_serves: Ready and, where it keeps a membership, its own engine
      live (head_engine: that engine's member);
    - of a replica or pool pod: live() (the pods not going away) > joined (the head lists it under
      its name) > engine_live (and attached, heartbeats on time) ; serves: Ready and engine_live for
      every stage it runs; standby: its role, as this pass leaves it, says standby;
    - of the set: holds_outdated_head (a head change runs or waits to run in place).
    """

    def __init__(self, t: Target, o: Observed, at: str, want_head: dict[str, Any] | None = None):
        self.t, self.o, self.previous = t, o, o.obj.get("status") or {}
        self.at = at  # now, as plan() was given it (a pod's remaining grace is measured from it)
        self.actions: list[Action] = []
        self.progressing: list[str] = []  # Progress values: what this pass did
        self.head = o.head
        self.head_going = False  # this pass deletes the head (it rolls)
        self.gone: set[str] = set()  # pod uids deleted by this plan
        self.handled: set[str] = set()  # pod uids whose retirement this plan already decided
        self.listing = o.listing
        self.report = o.report
        self.membership_problem: str | None = None
        self.head_restarted = False  # this pass rolls replicas of an earlier engine of this head pod
        self.reattaching: set[str] = set()  # pod uids to register with the restarted head (reattach.py)
        self.serving_since: str | None = None  # when this pass made a spare the head (spare.take_over)
        self.verdict: engine_truth.Verdict | None = None
        self.want_head = want_head or render_head_pod(t)  # rendered once per pass
        self.change = HeadChange()  # set by headswap.begin
        self.scale_held: str | None = None  # why a stage-0 scale-down keeps a pod (liveness.keep_one_live)
        self.roles: dict[str, str] = {}  # pod uid -> the role label this pass gives it (standby.py)
        self._want_replica: dict[int, dict[str, Any]] = {}
        self._want_pool_pod: dict[tuple[str, int], dict[str, Any]] = {}
        self.pools = pools.fit(t, t.name, o.pools, (collisions.named(o.obj), *o.neighbours))
        self.pool_of = {f.name: f for f in self.pools}

    # -- helpers
    def want_replica(self, index: int) -> dict[str, Any]:
        if index not in self._want_replica:
            self._want_replica[index] = render_replica_pod(self.t, index, pods.ip(self.head) or "",
                                                           pods.uid(self.head), pods.restarts(self.head))
        return self._want_replica[index]

    def want_pool_pod(self, pool: Pool, index: int) -> dict[str, Any]:
        key = (pool.name, index)
        if key not in self._want_pool_pod:
            self._want_pool_pod[key] = render_pool_pod(self.t, pool, index, pods.ip(self.head) or "",
                                                       pods.uid(self.head), pods.restarts(self.head))
        return self._want_pool_pod[key]

    def want(self, pod: dict[str, Any]) -> dict[str, Any] | None:
        """The pod as it should be now; None for a pod of a pool that cannot run (it is not rolled)."""
        if pods.pool(pod) is None:
            return self.want_replica(pods.index(pod))
        fitted = self.pool_of.get(pods.pool(pod))
        return (
            self.want_pool_pod(fitted.pool, pods.index(pod)) if fitted is not None and fitted.runs else None
        )

    def drain_of(self, pod: dict[str, Any]) -> int:
        if pods.pool(pod) is None:
            return self.t.spec.engine.drain_timeout_seconds
        fitted = self.pool_of.get(pods.pool(pod))
        return (
            fitted.pool.spec.drain_timeout_seconds
            if fitted is not None and fitted.pool
            else DEFAULT_POOL_DRAIN
        )

    def head_staying(self) -> bool:
        """A head pod that is not on its way out (by an earlier delete or by this pass)."""
        return self.head is not None and not pods.terminating(self.head) and not self.head_going

    def head_live(self) -> bool:
        return self.head_staying() and bool(pods.ip(self.head))

    def head_talks(self) -> bool:
        """A head client exists and the head answers (Ready, or started: pods.answers): the only head
        the plan reads answers from."""
        return self.o.head_addressable and self.head_live() and pods.answers(self.head)

    def live(self, pool: str | None = "*") -> list[dict[str, Any]]:
        """Replica and pool pods not going away; of one pool (None: stage-0 replicas) unless "*"."""
        return [r for r in self.o.replicas if not pods.terminating(r) and pods.uid(r) not in self.gone
                and (pool == "*" or pods.pool(r) == pool)]

    def members(self, stage: int = 0) -> list[contract.Member]:
        return contract.members(self.listing, stage) if self.listing is not None else []

    def member_of(self, pod: dict[str, Any], stage: int = 0) -> dict[str, Any] | None:
        """The member this pod runs: joined under its name from its address, else registered from
        its address. A member joined under its name from another address is an earlier pod of that
        name (names come back after a scale-down or an eviction), not this one."""
        name, ip = pods.name(pod), pods.ip(pod)
        by_host = None
        for mm in self.members(stage):
            same_host = bool(ip) and mm.get("host") == ip
            if mm.get("pod") == name and (same_host or not ip or not mm.get("host")):
                return mm
            if same_host and by_host is None:
                by_host = mm
        return by_host

    def joined(self, pod: dict[str, Any], stage: int) -> bool:
        mm = self.member_of(pod, stage)
        return mm is not None and mm.get("pod") == pods.name(pod)

    def engine_live(self, pod: dict[str, Any], stage: int) -> bool:
        """Joined, and the head can route to its engine now (attached, heartbeats on time)."""
        mm = self.member_of(pod, stage)
        return mm is not None and mm.get("pod") == pods.name(pod) and contract.is_live(mm)

    def serves(self, pod: dict[str, Any], unread: bool = False) -> bool:
        """Ready and live at the head for every stage it runs: the head's word too, not only the
        pod's Ready (which kwok, for one, writes True at start-up), and never a silent or detached
        engine. `unread`: the answer when the membership was not read (a roll drains nothing on a
        guess; status trusts the pod's Ready)."""
        if self.listing is None:
            return unread and pods.ready(pod)
        return pods.ready(pod) and all(self.engine_live(pod, stage) for stage in pods.stage_ids(pod))

    def head_engine(self) -> contract.Member | None:
        """The head's own stage-0 engine as its listing says it (None: static, or not read)."""
        if self.head is None:
            return None
        head_ip = pods.ip(self.head)
        return next((mm for mm in self.members() if contract.is_head_local(mm, head_ip)), None)

    def head_serves(self) -> bool:
        """The head pod is Ready and, where it keeps a membership, its own engine is live: a head
        whose engine is silent or gone is no serving replica, whatever its pod says.
        Unread membership trusts the pod's Ready, as serves(unread=True) does."""
        if not self.head_staying() or not pods.ready(self.head):
            return False
        if not self.t.distributed or self.listing is None:
            return True
        mm = self.head_engine()
        return mm is not None and contract.is_live(mm)

    def replica_desired(self) -> int:
        """Stage-0 replicas this set is scaled to."""
        if self.change.replica_target is not None:
            return self.change.replica_target
        return self.t.replica_pods

    def standby_desired(self, pool: str | None = None) -> int:
        """Standbys this set keeps of stage 0 (spec.standby; none in a static set, which has no replica
        pods) or of a pool (its spec.standby; none while this set is the one a head change replaces)."""
        if pool is not None:
            fitted = self.pool_of.get(pool)
            if fitted is None or fitted.pool is None or not fitted.runs or self.change.standby_target == 0:
                return 0
            return fitted.pool.spec.standby
        if self.change.standby_target is not None:
            return self.change.standby_target
        return self.t.spec.standby if self.t.distributed else 0

    def standby(self, pod: dict[str, Any]) -> bool:
        """A standby pod (ROLE_STANDBY), as this pass leaves its role: kept unjoined, not a replica."""
        return self.roles.get(pods.uid(pod), pods.role(pod)) == ROLE_STANDBY

    def holds_outdated_head(self) -> bool:
        """A head change runs (or waits to run in place): the head stays, its replicas are not rolled."""
        return self.change.keep_head and outdated(self)

    def stage_ids(self) -> list[int]:
        return [0, *(s.id for s in self.t.spec.stages)]

    def deletion(self, pod: dict[str, Any], reason: str | None = None, message: str = "") -> DeletePod:
        """The pod's delete, for the step to return; from now on the pass counts it gone."""
        self.gone.add(pods.uid(pod))
        return DeletePod(pods.name(pod), pods.uid(pod), reason, message)

    def staying(self, pool: str | None) -> list[dict[str, Any]]:
        """Live pods of a pool (None: stage-0 replicas) not on their way out: what its replicas is
        compared with."""
        return [r for r in self.live(pool) if pods.uid(r) not in self.handled]

    def disrupted(self, mm: contract.Member) -> dict[str, Any] | None:
        """The terminating pod, not deleted by this plan, that a joined member of the head runs in:
        someone else (an eviction, a node drain, kubectl delete) is deleting it, or an earlier pass did
        after its drain."""
        return next(
            (r for r in self.o.replicas if pods.terminating(r) and mm.get("pod") == pods.name(r)), None
        )
