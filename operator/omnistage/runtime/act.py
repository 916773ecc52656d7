"""The act step: executes the plan's actions (actions.py), one API or head call each, and decides nothing.
Every object a write returns goes into the watch-fed store (informer.STATE.wrote), so the next
pass does not act again on a change the watch has not delivered yet.

The one thing it does not do inline is a draining `leave`: the head's leave endpoint answers only
when the replica is drained (up to spec.engine.drainTimeoutSeconds), so it runs on the drains'
executor (drains.py, DRAINS). Its outcome is recorded by pod uid and read by the next pass's plan (which then
deletes the pod), and the OmniStage is queued again as soon as the leave returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kubernetes.client.exceptions import ApiException

from .. import api
from ..api.conditions import EventReason, PodReason, Reason
from ..control import actions
from ..control.actions import Action
from ..names import C_JOINED, L_ROLE
from . import credentials, drift, head_client, kube
from .drains import DRAINS, Drains
from .events import EmitFn
from .head_client import HeadClient, HeadRefused, HeadUnreachable
from .informer import STATE

log = logging.getLogger(__name__)


class Acted(NamedTuple):
    """What an act step could not do, for the status the pass writes."""

    problems: list[str]  # membership: joins refused, leaves failed, pods refused (MembershipSynced)
    refused: list[str]  # children the API server refused, each with its words (ReplicaFailure ChildRefused)


# Why a child was deleted and created again (drift.frozen): said with it, as deleting is not restoring.
REPLACED = (": the API server refuses every change to an immutable object, immutable included, so the "
            "operator deleted it and created it as rendered")

# What a condition or an Event quotes of the API server's answer: its message may repeat a whole object.
API_MESSAGE_LIMIT = 300


def bounded(text: str, most: int = API_MESSAGE_LIMIT) -> str:
    return text if len(text) <= most else text[:most - 3] + "..."


def refusal(kind: str, name: str, err: ApiException) -> str:
    """One child the API server refused: which, the status code and the API's message (bounded)."""
    return f"{kind} {name}: {err.status} {bounded(kube.reason_of(err))}"


def namespace_going(err: ApiException) -> bool:
    """A terminating namespace refuses every create: reconcile's to handle (it stops the pass)."""
    return err.status == 403 and "being terminated" in (err.body or "")


# One act step spends at most this long on its head's joins and leaves, and dials no head again that
# did not answer: the rest waits for the next pass (its status says so). So a head that hangs or
# answers each call just within its timeout holds a reconcile worker for a bounded time whatever
# the number of replicas (not a timeout per join), within the pass's deadline (handlers.QUEUE).
HEAD_SECONDS_PER_PASS = 30.0


class HeadTime:
    """One act step's time on one head: `with head_time:` around each call."""

    def __init__(self) -> None:
        self.spent, self.silent = 0.0, None

    def later(self) -> str | None:
        """Why the next call waits for the next pass, else None."""
        if self.silent is not None:
            return f"the head did not answer earlier in this pass ({self.silent})"
        if self.spent >= HEAD_SECONDS_PER_PASS:
            return f"this pass spent its {HEAD_SECONDS_PER_PASS:.0f} s for head calls"
        return None

    def __enter__(self) -> None:
        self._start = time.monotonic()

    def __exit__(self, kind, err, tb) -> None:
        self.spent += time.monotonic() - self._start
        if isinstance(err, HeadUnreachable):
            self.silent = str(err)


def act(namespace: str, planned: list[Action], client: HeadClient | None, emit: EmitFn, owner: str,
        drains: Drains = DRAINS, beside: HeadClient | None = None, token: str | None = None,
        membership: Membership | None = None) -> Acted:
    """Execute in order, each action by its executor (EXECUTORS); return what could not be done that
    status should say. A child the API server refuses (a 422 Invalid, a quota's 403, a 404, a 409)
    is said in a Warning Event and in the result, and the actions after it still run: one refused
    child does not stop the others.
    `client`: the serving head's client. `beside`: during a head change, the client of the head beside
    it (the successor or the predecessor), for the actions its set decided (OnSuccessor, OnPredecessor).
    `token`: the OmniStage's membership token, which each replica or pool pod's credential is
    derived from (written before the pod: credentials.py). `membership`: makes sure of the membership
    Secret before the first pod that mounts it (reconcile.ensure_token, read=True)."""
    run = Run(namespace, owner, client, beside, emit, drains, SecretCheck(membership, token))
    for a in planned:
        executor = EXECUTORS.get(type(a))
        if executor is None:  # pragma: no cover - a programming error (tests/unit/test_act_executors.py)
            raise TypeError(f"no executor for {a!r}")
        executor(run, a)
    return Acted(run.problems, run.children)


Membership = Callable[[], tuple[str | None, str | None]]  # -> (the token, why the Secret is refused)


@dataclass
class SecretCheck:
    """The membership Secret, made sure of once per act step, before the first pod that mounts it:
    (reconcile.ensure_token, read=True): re-created when it was deleted, refused when it is not the
    OmniStage's. Shared by the serving set's run and the one beside it."""

    ensure: Membership | None
    token: str | None
    refused: str | None = None
    done: bool = False

    def before_mounting(self) -> str | None:
        """Why no pod may be created, else None."""
        if self.ensure is not None and not self.done:
            self.done = True
            token, self.refused = self.ensure()
            self.token = token if token is not None else self.token
        return self.refused


@dataclass
class Run:
    """One act step on one head: what its executors need, and what they could not do."""

    namespace: str
    owner: str  # the OmniStage's name
    client: HeadClient | None
    beside: HeadClient | None
    emit: EmitFn
    drains: Drains
    secret: SecretCheck
    problems: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)  # refused by the API server
    head_time: HeadTime = field(default_factory=lambda: HeadTime())

    def refuse(self, kind: str, name: str, err: ApiException) -> str:
        """The API server refused a child: said in the result; a terminating namespace stops the pass."""
        if namespace_going(err):
            raise err
        why = refusal(kind, name, err)
        self.children.append(why)
        return why


def _post_event(run: Run, a: actions.PostEvent) -> None:
    run.emit(a.type, a.reason, a.message)


def _ensure_child(run: Run, a: actions.EnsureChild) -> None:
    meta, kind = a.obj["metadata"], a.obj["kind"]
    try:
        done = drift.apply(a.obj, a.compare, STATE.of(kind).get(meta["namespace"], meta["name"]))
    except ApiException as err:
        why = run.refuse(kind, meta["name"], err)
        run.emit("Warning", Reason.CHILD_REFUSED, f"the API server refused {why}")
        return
    if done.result != "unchanged":
        STATE.wrote(done.obj)
        run.emit("Normal", a.reason, f"{kind} {meta['name']} {done.result}" + _differed(done.drift, "it had ")
                 + (REPLACED if done.result == "replaced" else ""))
    if done.left:
        run.emit(
            "Warning",
            EventReason.CHILD_SYNCED,
            f"{kind} {meta['name']} still differs from what the operator renders after a restore"
            + _differed(done.left, "")
            + ": the API server, a mutating webhook or another controller "
            "writes it; the operator leaves it until it changes again",
        )


def _create_pod(run: Run, a: actions.CreatePod) -> None:
    why = run.secret.before_mounting()
    if why is not None:
        run.problems.append(f"pod {a.obj['metadata']['name']} not created: {why}")
        return
    why = credentials.ensure(a.obj, run.secret.token, run.emit)
    if why is not None:
        run.problems.append(why)
        return
    try:
        pod, created = kube.create(a.obj)
    except ApiException as err:
        # Refused by admission (e.g. Pod Security refusing sameNode's hostPath /dev/shm) or a quota:
        # no later pass will do better until someone acts, so say it where people look.
        why = run.refuse("Pod", a.obj["metadata"]["name"], err)
        run.emit("Warning", EventReason.CREATE_REFUSED, f"the API server refused {why}")
        run.problems.append(why)
        return
    STATE.wrote(pod)
    if created:
        run.emit("Normal", a.reason, a.message.format(pod=pod["metadata"]["name"]))


def _delete_pod(run: Run, a: actions.DeletePod) -> None:
    STATE.wrote(kube.delete_pod(run.namespace, a.name, uid=a.uid))
    run.drains.forget(run.namespace, run.owner, a.uid)
    if a.reason:
        run.emit("Normal", a.reason, a.message)


def _annotate(run: Run, a: actions.Annotate) -> None:
    STATE.wrote(kube.patch_pod_annotations(run.namespace, a.name, a.annotations))


def _set_role(run: Run, a: actions.SetRole) -> None:
    STATE.wrote(kube.patch_pod_labels(run.namespace, a.name, a.uid, {L_ROLE: a.role}))


def _restore_labels(run: Run, a: actions.RestoreLabels) -> None:
    STATE.wrote(kube.patch_pod_labels(run.namespace, a.name, a.uid, dict(a.labels)))


def _beside_serving(run: Run, a: actions.BesideServing) -> None:
    """The set beside the serving one: its own head answers its calls, with its own time."""
    beside = Run(run.namespace, run.owner, run.beside, None, run.emit, run.drains, run.secret)
    for b in a.actions:
        EXECUTORS[type(b)](beside, b)
    run.problems += beside.problems
    run.children += beside.children


def _start_leave(run: Run, a: actions.StartLeave) -> None:
    if run.client is not None:
        run.drains.start(run.namespace, run.owner, run.client, a, run.emit)


def _leave_departed(run: Run, a: actions.LeaveDeparted) -> None:
    who = f"replica {a.replica_id}" + (f" of stage {a.stage}" if a.stage else "")
    if (later := run.head_time.later()) is not None:
        run.problems.append(f"leave for departed {who} waits for the next pass: {later}")
        return
    try:
        with run.head_time:
            head_client.leave(run.client, a.replica_id, 0, a.stage)
        run.emit("Normal", EventReason.LEFT, f"{who} ({a.who}) left: its pod is gone")
    except (HeadUnreachable, HeadRefused) as err:
        run.problems.append(f"leave for departed {who} failed: {err}")


def _join(run: Run, a: actions.Join) -> None:
    """Each stage's join in turn; the joined condition True only when every one landed."""
    for stage in a.stages:
        if (later := run.head_time.later()) is not None:
            run.problems.append(f"join for {a.pod} waits for the next pass: {later}")
            return
        try:
            with run.head_time:
                ack = head_client.join(run.client, a.pod, a.ip, stage)
        except HeadRefused as err:
            # Not registered, not attached, or the newest registration from this IP is a detached
            # predecessor (kwok reuses pod IPs): wait. A replica whose engine really died fails its
            # pod, and the failed pod is replaced by a later pass.
            run.problems.append(f"{a.pod} has not joined yet: {err.explain()}")
            return
        except HeadUnreachable as err:
            run.problems.append(f"join for {a.pod} failed: {err}")
            return
        run.emit("Normal", EventReason.JOINED, a.said.format(stage=stage, replica=ack.get("replicaId")))
    if a.mark:
        _mark_joined(run, actions.MarkJoined(a.pod, a.uid, True))


def _mark_joined(run: Run, a: actions.MarkJoined) -> None:
    pod = kube.patch_pod_condition(
        run.namespace, a.pod, a.uid, C_JOINED, a.joined,
        PodReason.JOINED if a.joined else PodReason.NOT_JOINED,
        "the head routes to it" if a.joined else "the head does not route to it",
    )
    if pod is not None:
        STATE.wrote(pod)


# One executor per action type (control/actions.py): a new type without one fails a unit test.
EXECUTORS: dict[type, Callable[[Run, Any], None]] = {
    actions.PostEvent: _post_event,
    actions.EnsureChild: _ensure_child,
    actions.CreatePod: _create_pod,
    actions.DeletePod: _delete_pod,
    actions.Annotate: _annotate,
    actions.SetRole: _set_role,
    actions.RestoreLabels: _restore_labels,
    actions.OnSuccessor: _beside_serving,
    actions.OnPredecessor: _beside_serving,
    actions.StartLeave: _start_leave,
    actions.LeaveDeparted: _leave_departed,
    actions.Join: _join,
    actions.MarkJoined: _mark_joined,
}


def write_pool_statuses(namespace: str, statuses: dict[str, dict[str, Any]]) -> None:
    """Each OmniStagePool's status, by name (the OmniStage's pass decides for its pools)."""
    for name, status in statuses.items():
        pool = STATE.pools.get(namespace, name)
        try:
            STATE.wrote(
                kube.patch_status(namespace, name, status, (pool or {}).get("status"), api.POOL_PLURAL)
            )
        except ApiException as err:
            if err.status != 404:  # deleted since the watch delivered it: nothing to describe
                raise


def _differed(drift: tuple[str, ...], lead: str, most: int = 4) -> str:
    """The first few of drift.drifted()'s lines, for an Event."""
    if not drift:
        return ""
    more = f"; and {len(drift) - most} more" if len(drift) > most else ""
    return f" ({lead}{'; '.join(drift[:most])}{more})"
