"""A warm spare head (spec.head.standby: 1): a second head pod, loaded and Ready, outside the Services
(role ROLE_SPARE_HEAD), serving nothing. Two steps of the serving set's pass:

- take_over (before the head change and the head's own step): when the serving head's engine is dead
  (its pod gone, deleted or failed, or its container restarted and its engine not started again) and
  the spare is Ready and runs the template now, the spare's role turns ROLE_HEAD and the dead head's
  ROLE_SPARE_HEAD (a restarting container loads its engine again and is the next spare; a pod on its
  way out is replaced by keep once it is gone). The Services follow the labels at once; the replicas'
  engines find the new head through the master Service (patch reattach: after 3 s of silence at the
  old address) and register with it without reloading, and retire_stale re-joins them
  (control/reattach.py, its bound counted from the take-over: A_SERVING_SINCE). The rest of the pass
  decides for the new head, which it has not read yet: the label patch starts the next pass, which
  reads it.
- keep (after the head's step): one spare while spec.head.standby is 1 and no head change runs; a
  spare that is not wanted (spec.head.standby 0, a head change running, another template, a failed
  pod, one too many) is deleted. A head change thus deletes the spare (it runs the old template); the
  pass after the change makes one of the new.

A head's death is read from its pod alone, never from a readiness blip: a head that is only slow to
answer /health keeps its replicas (they ping it and it knows them), and moving the Services away from
it would leave it serving them alone. The spare's name is whichever of NAME-head and NAME-head-<hash>
(render.pods.head_pod_name, the names identity.py places) no head pod holds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..api.conditions import EventReason, Progress
from ..names import A_SERVING_SINCE, ROLE_HEAD, ROLE_SPARE_HEAD
from ..render import render_head_pod
from ..render.pods import head_pod_name
from . import pods
from .actions import Action, Annotate, CreatePod, PostEvent, SetRole
from .state import Pass, outdated


def dead(head: dict[str, Any] | None) -> str | None:
    """Why the head's engine is gone (None: it lives, or may: a NotReady head that did not restart is
    slow, not dead). A restart counts until the new engine started (the startup probe passed)."""
    if head is None:
        return "its pod is gone"
    if pods.terminating(head):
        return "its pod is being deleted"
    if pods.terminal(head):
        return f"its pod is {head['status'].get('phase')}"
    if pods.restarts(head) > 0 and not pods.answers(head):
        return f"its container restarted (restartCount {pods.restarts(head)}) and its engine loads again"
    return None


def usable(p: Pass, spare: dict[str, Any] | None) -> bool:
    """The spare can serve now: Ready, staying, addressable and of the template the head should run."""
    return (spare is not None and pods.ready(spare) and not pods.terminating(spare) and bool(pods.ip(spare))
            and pods.template_hash(spare) == pods.template_hash(p.want_head))


def take_over(p: Pass) -> list[Action]:
    acts: list[Action] = []
    spare, head = (p.o.spares or (None,))[0], p.head
    if p.t.spec.head.standby < 1 or p.o.beside is not None or not usable(p, spare):
        return acts
    why = dead(head)
    if why is None:
        return acts
    assert spare is not None
    # The time first: a pass that sees the spare labelled head sees when it took over too (the watch
    # delivers the two patches in order), so its replicas' bound is never counted from its old Ready.
    acts += [Annotate(pods.name(spare), {A_SERVING_SINCE: p.at}),
                  SetRole(pods.name(spare), pods.uid(spare), ROLE_HEAD)]
    old = "the head pod"
    if head is not None:  # out of the Services even on its way out (two serving heads read as a head change)
        old = pods.name(head)
        acts.append(SetRole(old, pods.uid(head), ROLE_SPARE_HEAD))
    reloads = head is not None and not pods.terminating(head) and not pods.terminal(head)
    acts.append(PostEvent("Warning", Progress.SPARE_TOOK_OVER,
                          f"head pod {old}'s engine died ({why}): the Services moved to the spare head pod "
                          f"{pods.name(spare)}, whose engine was loaded; the replicas re-attach to it "
                          "without reloading"
                          + (f"; {old} is the spare once its engine is loaded again" if reloads else "")))
    p.progressing.append(Progress.SPARE_TOOK_OVER)
    p.head, p.listing, p.report, p.serving_since = spare, None, None, p.at
    rest = tuple(s for s in p.o.spares if s is not spare)
    p.o = replace(p.o, head=spare, spares=((head,) if head is not None else ()) + rest,
                  head_addressable=False, listing=None, report=None, answer_refused=None)
    return acts


def unwanted(p: Pass, spare: dict[str, Any], first: bool) -> str | None:
    """Why this spare pod goes (None: it stays). `first`: the best of the spares observed."""
    if p.t.spec.head.standby < 1:
        return "spec.head.standby is 0"
    if p.o.beside is not None or p.holds_outdated_head():
        return "a head change runs: a spare of the new template is made once it is done"
    if not first:
        return "spec.head.standby is 1 and another spare head pod is kept"
    if pods.terminal(spare):
        return f"its pod is {spare['status'].get('phase')}"
    if pods.template_hash(spare) != pods.template_hash(p.want_head):
        return "its pod template changed"
    return None


def keep(p: Pass) -> list[Action]:
    acts: list[Action] = []
    for i, spare in enumerate(p.o.spares):
        if not pods.terminating(spare) and (why := unwanted(p, spare, i == 0)) is not None:
            acts.append(p.deletion(spare, Progress.SPARE_RETIRED,
                                   f"deleted spare head pod {pods.name(spare)}: {why}"))
    head = p.head
    if (p.t.spec.head.standby < 1 or p.o.spares or head is None or not p.head_staying() or outdated(p)
            or p.o.beside is not None or p.change.swap is not None):
        return acts
    name = next(n for n in (head_pod_name(p.t), head_pod_name(p.t, pods.template_hash(p.want_head)))
                if n != pods.name(head))
    acts.append(CreatePod(render_head_pod(p.t, name, ROLE_SPARE_HEAD), EventReason.CREATED_SPARE_HEAD,
                               "created spare head pod {pod}: loaded and Ready, it takes the Services if "
                               f"head pod {pods.name(head)}'s engine dies"))
    p.progressing.append(Progress.CREATING_SPARE_HEAD)
    return acts
