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
        drains: Drains = DRAINS, beside: HeadClient | None = None, token: str | None = None) -> Acted:
    """Execute in order; return what could not be done that status should say. A child the API server
    refuses (a 422 Invalid, a quota's 403, a 404, a 409) is said in a Warning Event and in the result,
    and the actions after it still run: one refused child does not stop the others.
    `client`: the serving head's client. `beside`: during a head change, the client of the head beside
    it (the successor or the predecessor), for the actions its set decided (OnSuccessor, OnPredecessor).
    `token`: the OmniStage's membership token, which each replica or pool pod's credential is
    derived from (written before the pod: credentials.py)."""
    problems: list[str] = []
    children: list[str] = []  # refused by the API server
    refused: set[str] = set()  # pods whose join failed in this run: not marked joined
    head_time = HeadTime()  # this head's calls in this run (the head beside it has its own)
    for a in planned:
        if isinstance(a, actions.PostEvent):
            emit(a.type, a.reason, a.message)
        elif isinstance(a, actions.EnsureChild):
            meta, kind = a.obj["metadata"], a.obj["kind"]
            try:
                done = drift.apply(a.obj, a.compare, STATE.of(kind).get(meta["namespace"], meta["name"]))
            except ApiException as err:
                if namespace_going(err):
                    raise
                why = refusal(kind, meta["name"], err)
                emit("Warning", Reason.CHILD_REFUSED, f"the API server refused {why}")
                children.append(why)
                continue
            if done.result != "unchanged":
                STATE.wrote(done.obj)
                emit(
                    "Normal",
                    EventReason.CONFIG_RENDERED if kind == "ConfigMap" else EventReason.CHILD_SYNCED,
                    f"{kind} {meta['name']} {done.result}" + _differed(done.drift, "it had ")
                    + (REPLACED if done.result == "replaced" else ""),
                )
            if done.left:
                emit(
                    "Warning",
                    EventReason.CHILD_SYNCED,
                    f"{kind} {meta['name']} still differs from what the operator renders after a restore"
                    + _differed(done.left, "")
                    + ": the API server, a mutating webhook or another controller "
                    "writes it; the operator leaves it until it changes again",
                )
        elif isinstance(a, actions.CreatePod):
            why = credentials.ensure(a.obj, token, emit)
            if why is not None:
                problems.append(why)
                continue
            try:
                pod, created = kube.create(a.obj)
            except ApiException as err:
                if namespace_going(err):
                    raise
                # Refused by admission (e.g. Pod Security refusing sameNode's hostPath /dev/shm) or a
                # quota: no later pass will do better until someone acts, so say it where people look.
                why = refusal("Pod", a.obj["metadata"]["name"], err)
                emit("Warning", EventReason.CREATE_REFUSED, f"the API server refused {why}")
                problems.append(why)
                children.append(why)
                continue
            STATE.wrote(pod)
            if created:
                emit("Normal", a.reason, a.message.format(pod=pod["metadata"]["name"]))
        elif isinstance(a, actions.DeletePod):
            STATE.wrote(kube.delete_pod(namespace, a.name, uid=a.uid))
            drains.forget(namespace, owner, a.uid)
            if a.reason:
                emit("Normal", a.reason, a.message)
        elif isinstance(a, actions.Annotate):
            STATE.wrote(kube.patch_pod_annotations(namespace, a.name, a.annotations))
        elif isinstance(a, actions.BesideServing):
            beside_acted = act(namespace, list(a.actions), beside, emit, owner, drains, token=token)
            problems += beside_acted.problems
            children += beside_acted.refused
        elif isinstance(a, actions.SetRole):
            STATE.wrote(kube.patch_pod_labels(namespace, a.name, a.uid, {L_ROLE: a.role}))
        elif isinstance(a, actions.RestoreLabels):
            STATE.wrote(kube.patch_pod_labels(namespace, a.name, a.uid, dict(a.labels)))
        elif isinstance(a, actions.StartLeave):
            if client is not None:
                drains.start(namespace, owner, client, a, emit)
        elif isinstance(a, actions.LeaveDeparted):
            who = f"replica {a.replica_id}" + (f" of stage {a.stage}" if a.stage else "")
            if (later := head_time.later()) is not None:
                problems.append(f"leave for departed {who} waits for the next pass: {later}")
                continue
            try:
                with head_time:
                    head_client.leave(client, a.replica_id, 0, a.stage)
                emit("Normal", EventReason.LEFT, f"{who} ({a.who}) left: its pod is gone")
            except (HeadUnreachable, HeadRefused) as err:
                problems.append(f"leave for departed {who} failed: {err}")
        elif isinstance(a, actions.Join):
            if (later := head_time.later()) is not None:
                refused.add(a.pod)
                problems.append(f"join for {a.pod} waits for the next pass: {later}")
                continue
            try:
                with head_time:
                    ack = head_client.join(client, a.pod, a.ip, a.stage)
                kind = (
                    f"pool pod {a.pod} joined stage {a.stage}"
                    if a.stage
                    else f"replica pod {a.pod} joined the engine"
                )
                emit("Normal", EventReason.JOINED, f"{kind} as replica {ack.get('replicaId')}")
            except HeadRefused as err:
                refused.add(a.pod)
                # Not registered, not attached, or the newest registration from this IP is a detached
                # predecessor (kwok reuses pod IPs): wait. A replica whose engine really died fails
                # its pod, and the failed pod is replaced by a later pass.
                problems.append(f"{a.pod} has not joined yet: {err.explain()}")
            except HeadUnreachable as err:
                refused.add(a.pod)
                problems.append(f"join for {a.pod} failed: {err}")
        elif isinstance(a, actions.MarkJoined):
            if a.joined and a.pod in refused:
                continue
            pod = kube.patch_pod_condition(
                namespace,
                a.pod,
                a.uid,
                C_JOINED,
                a.joined,
                PodReason.JOINED if a.joined else PodReason.NOT_JOINED,
                "the head routes to it" if a.joined else "the head does not route to it",
            )
            if pod is not None:
                STATE.wrote(pod)
        else:  # pragma: no cover - a new action type without an executor is a programming error
            raise TypeError(f"no executor for {a!r}")
    return Acted(problems, children)


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
