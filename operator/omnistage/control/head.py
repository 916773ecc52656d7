"""The head's steps: its pod (created, or replaced when its template changed or it ended), what its
engine reports (the cache guarantee held against it) and whether its membership can be read."""

from __future__ import annotations

from ..api.conditions import EventReason, Progress, Type
from ..api.conditions import get as condition
from . import engine_truth, pods
from .actions import HEAD_NOT_READY, Action, CreatePod, DeletePod, PostEvent
from .state import Pass


def head_pod(p: Pass) -> list[Action]:
    acts: list[Action] = []
    head, want = p.head, p.want_head
    if head is not None and not pods.terminating(head):
        outdated = pods.template_hash(head) != pods.template_hash(want) and not p.change.keep_head
        if outdated or pods.terminal(head):
            # Replicas are bound to one head incarnation (they never re-register), so the head
            # rolls first and its replicas follow; rolling them first would restart them twice.
            why = "its pod template changed" if outdated else f"it is {head['status'].get('phase')}"
            acts += [PostEvent("Normal", Progress.ROLLING_HEAD, f"replacing head pod {pods.name(head)}: "
                               f"{why}"), DeletePod(pods.name(head), pods.uid(head))]
            p.progressing.append(Progress.ROLLING_HEAD)
            # What the old head said no longer counts; its successor is created on a later pass
            # (the name is taken until the old pod is gone).
            p.head_going = True
            p.listing, p.report = None, None
            return acts
    if head is None and p.change.create_head:
        acts.append(CreatePod(want, EventReason.CREATED_HEAD, "created head pod {pod}"))
        p.progressing.append(Progress.CREATING_HEAD)
    return acts


def engine_report(p: Pass) -> list[Action]:
    """Hold the cache guarantee against what the head says it runs."""
    acts: list[Action] = []
    if not p.head_talks():
        why = HEAD_NOT_READY
        p.report = None
    else:
        why = p.o.report_problem
    refused = p.o.answer_refused if why != HEAD_NOT_READY else None
    p.verdict = engine_truth.check(str(p.t.cache.mode), p.t.distributed, p.report, why, refused)
    before = condition(p.previous, Type.CACHE_CONSISTENT)
    if p.verdict.consistent or why == HEAD_NOT_READY:
        if p.verdict.consistent and before.get("status") == "False":
            acts.append(PostEvent("Normal", p.verdict.reason, p.verdict.message))
        return acts
    if before.get("message") != p.verdict.message:
        acts.append(PostEvent("Warning", p.verdict.reason, p.verdict.message))
    return acts


def membership_read(p: Pass) -> list[Action]:
    """Whether the head's membership can be read, for the steps after it: no action of its own."""
    if not p.t.distributed:
        p.listing = None
        return []  # a static single replica: no master, no membership to keep
    # A head whose container restarted runs a new engine, which its replicas never register with
    # again: rollout.retire_stale rolls them, by the restart count each pod recorded when it was
    # made (from the pods, never from status, which an OmniStage editor may write).
    if not p.head_talks():
        p.membership_problem, p.listing = HEAD_NOT_READY, None
        return []
    if p.listing is None:
        p.membership_problem = p.o.answer_refused or f"head unreachable: {p.o.listing_problem}"
    return []
