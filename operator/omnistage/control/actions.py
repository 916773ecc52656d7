"""The words of a pass: what `reconcile.observe` read (Observed) and what `plan` decides that
`act` executes (the actions, in order). Shared by the three and by the tests; pure data."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..render.common import Target

from .collisions import Named

# Drain states the act step records for a replica pod (by pod uid) while its `leave` runs elsewhere.
DRAIN_RUNNING = "running"  # the head is draining it; the pod stays until the leave returns
DRAIN_DONE = "done"  # the leave returned (drained or timed out): delete the pod
DRAIN_FAILED = "failed"  # the head could not be told; its heartbeat timeout detaches the replica


# ---- actions: what act.py executes, in order ---------------------------------------------------

@dataclass(frozen=True)
class PostEvent:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class EnsureChild:
    """Create the child, or restore it when it differs: the `compare` fields whole (only the API
    server's defaults beside what is rendered), the labels and annotations by containment but for
    Kubernetes' own keys (runtime/drift.py; an Event when it changed)."""
    obj: dict[str, Any]
    compare: tuple[str, ...]
    reason: str  # the Event's when it was created or restored (api/child_kinds.py, per kind)


@dataclass(frozen=True)
class CreatePod:
    obj: dict[str, Any]
    reason: str
    message: str  # "{pod}" is replaced by the created pod's name


@dataclass(frozen=True)
class DeletePod:
    name: str
    uid: str
    reason: str | None = None  # Event after the delete, when set
    message: str = ""


@dataclass(frozen=True)
class Annotate:
    name: str
    annotations: dict[str, str | None]


@dataclass(frozen=True)
class SetRole:
    """Patch an engine pod's role label: what moves the Services from one head to its successor, and
    what turns a standby into a replica (or a replica that never joined into a standby)."""
    name: str
    uid: str
    role: str


@dataclass(frozen=True)
class StartLeave:
    """Tell the head to stop routing to the pod's replicas and drain them; runs off the reconcile
    worker. `leaves` holds one (stage, replica id) per stage the pod runs (a pool pod may run two).
    The pod is deleted by a later pass, once the drain state says every leave returned."""
    pod: str
    uid: str
    leaves: tuple[tuple[int, int], ...]
    drain_seconds: int
    # A standby (control/standby.py): the head drains it and holds it attached, unroutable, instead of
    # detaching it; the pod stays.
    hold: bool = False


@dataclass(frozen=True)
class LeaveDeparted:
    """The head still lists a replica whose pod is gone: leave at once (no drain, nothing to route to)."""
    replica_id: int
    who: str
    stage: int = 0


@dataclass(frozen=True)
class Join:
    """Join the pod's stages the head has not acknowledged, in order, until one fails; then, when
    `mark`, set its joined condition True (MarkJoined), only if every one landed."""
    pod: str
    uid: str
    ip: str
    stages: tuple[int, ...]
    said: str  # the Event per stage joined: "{stage}" and "{replica}" (the id the head gave) filled in
    mark: bool = False


@dataclass(frozen=True)
class MarkJoined:
    """Set the pod's joined condition (names.C_JOINED, its readiness gate): True once the head routes
    to every replica the pod runs, False when it leaves or the head lost it."""
    pod: str
    uid: str
    joined: bool


@dataclass(frozen=True)
class RestoreLabels:
    """Write back the operator's labels on one of its pods (control/identity.py); None removes a key."""
    name: str
    uid: str
    labels: Mapping[str, str | None]


@dataclass(frozen=True)
class BesideServing:
    """During a head change, the set beside the serving one (Observed.beside) decided these: its own
    head answers their membership calls. One of the two below, by that set's role."""
    actions: tuple[Action, ...]


class OnSuccessor(BesideServing):
    """Surging: the successor head's set decided these (its joins go to the successor)."""


class OnPredecessor(BesideServing):
    """Draining: the predecessor head's set decided these (its leaves go to the predecessor)."""


Action = (PostEvent | EnsureChild | CreatePod | DeletePod | Annotate | SetRole | RestoreLabels | StartLeave
          | LeaveDeparted | Join | MarkJoined | OnSuccessor | OnPredecessor)


# ---- observation ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stray:
    """An engine pod the OmniStage owns whose operator labels someone changed (`labels`: the keys to
    write back, None to remove one), or that cannot be trusted (`labels` None: it is deleted)
    (control/identity.py)."""
    pod: dict[str, Any]
    labels: Mapping[str, str | None] | None
    why: str


@dataclass(frozen=True)
class Observed:
    """Everything one pass read. `head_addressable` means a head client could be built (head pod has
    an IP and is not terminating); report/listing are None when not asked or no answer, with why."""
    obj: dict[str, Any]
    head: dict[str, Any] | None = None
    replicas: tuple[dict[str, Any], ...] = ()
    head_addressable: bool = False
    report: dict[str, Any] | None = None
    report_problem: str | None = None
    listing: dict[str, Any] | None = None
    listing_problem: str | None = None
    # The head's answer the operator refused (runtime/head_answers.py), which and why: report and
    # listing are None then, and status says this instead of "unreachable".
    answer_refused: str | None = None
    drains: Mapping[str, str] = field(default_factory=dict)  # pod uid -> DRAIN_* (act's drain executor)
    # What this pass's act step could not do, for its status (plan.plan_with_report): joins refused, ...; and
    # the children the API server refused in that step, with its words.
    problems: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    pools: tuple[dict[str, Any], ...] = ()  # the OmniStagePools whose spec.omniStage names it
    # A head change in progress (control/headswap.py): the set beside the serving one, read like it:
    # the successor head (ROLE_NEXT_HEAD, while surging) or the predecessor (ROLE_OLD_HEAD, while
    # draining) with its own replicas and what it said. `head` above is the serving one (ROLE_HEAD),
    # the one the Services select.
    beside: Observed | None = None
    # Warm spare heads (ROLE_SPARE_HEAD, control/spare.py), the one to keep first: not terminating,
    # then the newest. Nothing is asked of them; their pods say whether one can take over.
    spares: tuple[dict[str, Any], ...] = ()
    # Why the membership Secret is not used (reconcile.ensure_token: a Secret of its name that the
    # OmniStage does not own): nothing is created or deleted until it is fixed.
    secret_refused: str | None = None
    # Its own pods whose labels were changed or that cannot be trusted (control/identity.py): the
    # pods above carry the labels the operator wrote already.
    strays: tuple[Stray, ...] = ()
    # While the spec is invalid (nothing can be rendered from it): the target of the last valid one
    # this operator saw (runtime/memory.py LAST_VALID), whose children are kept as it rendered them.
    last_valid: Target | None = None
    # The other OmniStages and OmniStagePools of the namespace whose names may give a child of this
    # OmniStage's or of its pools' (control/collisions.py): the newer of two is refused.
    neighbours: tuple[Named, ...] = ()


HEAD_NOT_READY = "head pod is not ready"  # why a pass read nothing from the head
