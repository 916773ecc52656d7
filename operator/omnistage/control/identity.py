"""Which engine pods are an OmniStage's, what each is, and the labels the operator wrote on it
(pods are found by ownerReference uid, not by label).

A pod is the OmniStage's when its controller ownerReference names the OmniStage's uid
(runtime/informer.py stores pods by that reference, whatever their labels say). A pod that carries
the OmniStage's labels without it is not adopted: never counted, dialled, sent the token or deleted.
What an owned pod is (a head, a stage-0 replica, a pool pod) follows from its name, which the
operator chose and nobody can change: `NAME-head`, `NAME-head-<its template hash's first 6>` (a
successor), `NAME-replica-<index>`, `POOL-<index>`.

Its operator labels (`labels()` in render/common.py: the Services, the PodDisruptionBudgets and the
scale selectors select by them) are **restored** when someone removed or changed them, not replaced:
they follow from the name and the OmniStage alone, a label patch puts the pod back in its Service at
once, and replacing a head would stop serving and roll every replica for a change of labels only.
A head's role label is the state of a head change (control/headswap.py), so a head that lost it
takes the role that state leaves it (restore_head_roles); a replica pod's role says whether it is a
standby (spec.standby), and one that lost it takes the role its joined condition says (replica_role).
A pod the operator cannot place (an owned pod with a name it does not make, or a successor head whose
template hash is not the one its name was made from: its annotation was edited) cannot be trusted and
is deleted, as a pod with an annotation the operator did not write is replaced (pods.malformed).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..api.conditions import EventReason
from ..names import (
    HEAD_POD_ROLES,
    L_COMPONENT,
    L_OMNISTAGE,
    L_POOL,
    L_ROLE,
    OPERATOR_LABELS,
    REPLICA_ROLES,
    ROLE_HEAD,
    ROLE_NEXT_HEAD,
    ROLE_OLD_HEAD,
    ROLE_POOL,
    ROLE_REPLICA,
    ROLE_SPARE_HEAD,
    ROLE_STANDBY,
)
from ..render.common import Target, labels
from ..render.pods import head_pod_name, render_head_pod, replica_pod_name
from . import pods
from .actions import Action, DeletePod, PostEvent, RestoreLabels, Stray

if TYPE_CHECKING:
    from .state import Pass

# Every label the operator writes on an engine pod (render/common.labels); the others are the template's.
OPERATOR_POD_LABELS = (*OPERATOR_LABELS, L_OMNISTAGE, L_COMPONENT, L_ROLE, L_POOL)
HASH_SUFFIX = 6  # render.pods.head_pod_name: a successor head's name ends in its template hash's first 6


def owner_uid(pod: dict[str, Any]) -> str | None:
    """The uid of the pod's controller ownerReference (None: it has none)."""
    ref = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    return ref.get("uid") if ref else None


def sort_out(t: Target, owned: list[dict[str, Any]], pool_names: set[str]
             ) -> tuple[list[dict[str, Any]], tuple[Stray, ...]]:
    """(the owned pods the operator can place, with the labels it wrote; the strays among all of them).
    `owned`: the pods whose controller ownerReference names t.uid; `pool_names`: the OmniStagePools
    that name the OmniStage."""
    placed: list[tuple[dict[str, Any], str, str | None]] = []  # (pod, role, pool)
    strays: list[Stray] = []
    for pod in owned:
        what = _what(t, pod, pool_names)
        if isinstance(what, str):
            strays.append(Stray(pod, None, what))
        else:
            placed.append((pod, *what))
    lost = restore_head_roles(t, [pod for pod, role, _ in placed if role == ROLE_HEAD])
    out = []
    for pod, role, pool in placed:
        if role == ROLE_HEAD:  # a head keeps its place in a head change
            role = lost.get(pods.uid(pod)) or pods.role(pod) or ROLE_HEAD
        elif role == ROLE_REPLICA:  # a replica pod's role is state too: a standby stays one
            role = pods.role(pod) if pods.role(pod) in REPLICA_ROLES else replica_role(t, pod)
        elif role == ROLE_POOL and pods.role(pod) == ROLE_STANDBY:  # a pool's standby, as for stage 0
            role = ROLE_STANDBY
        want = labels(t, role, pool)
        have = pod["metadata"].get("labels") or {}
        fix: dict[str, str | None] = {
            k: want.get(k) for k in OPERATOR_POD_LABELS if have.get(k) != want.get(k)
        }
        if fix:
            said = ", ".join(f"{k}={have[k]!r}" if k in have else f"{k} removed" for k in sorted(fix))
            strays.append(Stray(pod, fix, f"its labels were changed ({said})"))
            theirs = {k: v for k, v in have.items() if k not in OPERATOR_POD_LABELS}
            pod = {**pod, "metadata": {**pod["metadata"], "labels": {**theirs, **want}}}
        out.append(pod)
    return out, tuple(strays)


def replica_role(t: Target, pod: dict[str, Any]) -> str:
    """The role of a replica pod that lost its role label: a replica while its joined condition says
    the head routes to it, else a standby when the OmniStage keeps any (the scale step turns it back
    into a replica with a join if replicas are short, so a wrong guess costs one relabel)."""
    return ROLE_STANDBY if t.spec.standby and not pods.joined_condition(pod) else ROLE_REPLICA


def _what(t: Target, pod: dict[str, Any], pool_names: set[str]) -> tuple[str, str | None] | str:
    """(role, pool) the operator made this pod as, from its name; else why it cannot be placed."""
    name = pods.name(pod)
    if name == head_pod_name(t):
        return ROLE_HEAD, None
    suffix = name.removeprefix(head_pod_name(t) + "-")
    if suffix != name and re.fullmatch(f"[0-9a-f]{{{HASH_SUFFIX}}}", suffix):
        if not (pods.template_hash(pod) or "").startswith(suffix):
            return (
                f"its name {name} was made for a template hash starting {suffix}, and its annotation says "
                f"{(pods.template_hash(pod) or 'none')[:16]!r}: not the head the operator made"
            )
        return ROLE_HEAD, None
    if re.fullmatch(re.escape(replica_pod_name(t, 0).removesuffix("0")) + "[1-9][0-9]{0,8}", name):
        return ROLE_REPLICA, None
    for pool in sorted({pods.pool(pod), *pool_names} - {None}):
        if re.fullmatch(re.escape(pool) + "-[0-9]{1,9}", name):
            return ROLE_POOL, pool
    return f"it is owned by the OmniStage, but {name} is no name the operator gives a pod of it"


def restore_head_roles(t: Target, heads: list[dict[str, Any]]) -> dict[str, str]:
    """Head pod uid -> the role it takes, for heads whose role label is not a head's role. Alone, it
    is the head. During a head change, it takes the role the other head's leaves it: beside a
    successor or a predecessor it is the serving head; beside the serving head it is the successor
    when it runs the template now and the serving one does not, else the predecessor (which drains:
    the safe guess, a successor is started again), or the spare when the OmniStage keeps one and both
    run the template now (control/spare.py). Two without a role: the older first."""
    valid = {pods.uid(h): pods.role(h) for h in heads if pods.role(h) in HEAD_POD_ROLES}
    lost = sorted((h for h in heads if pods.uid(h) not in valid), key=pods.created)
    out: dict[str, str] = {}
    for h in lost:
        others = [(o, valid.get(pods.uid(o)) or out.get(pods.uid(o))) for o in heads if o is not h]
        others = [(o, role) for o, role in others if role is not None and not pods.terminating(o)]
        if not others or all(role != ROLE_HEAD for _, role in others):
            out[pods.uid(h)] = ROLE_HEAD
        else:
            serving = next(o for o, role in others if role == ROLE_HEAD)
            want_hash = pods.template_hash(render_head_pod(t))
            current = pods.template_hash(h) == want_hash != pods.template_hash(serving)
            spare = (t.spec.head.standby and pods.template_hash(h) == want_hash == pods.template_hash(serving)
                     and all(role != ROLE_SPARE_HEAD for _, role in others))
            out[pods.uid(h)] = ROLE_NEXT_HEAD if current else ROLE_SPARE_HEAD if spare else ROLE_OLD_HEAD
    return out


def restore(p: Pass) -> list[Action]:
    """The plan's first step on pods: the strays' labels written back (before anything this pass
    selects by them), the untrusted deleted. Said once: the written pod goes into the store."""
    acts: list[Action] = []
    for stray in p.o.strays:
        name = pods.name(stray.pod)
        if stray.labels is not None:
            acts.append(RestoreLabels(name, pods.uid(stray.pod), stray.labels))
            acts.append(PostEvent("Warning", EventReason.LABELS_RESTORED,
                                  f"pod {name}: {stray.why}; the operator's labels are written back (its "
                                  "Services and disruption budgets select by them)"))
        elif not pods.terminating(stray.pod):
            acts.append(PostEvent("Warning", EventReason.STRAY_POD, f"deleted pod {name}: {stray.why}"))
            acts.append(DeletePod(name, pods.uid(stray.pod)))
    return acts
