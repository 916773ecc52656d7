"""The stages' step: a Warning when StagesCovered or StagesReady turns bad, or says something new
while bad."""

from __future__ import annotations

from ..api.conditions import Reason, Type
from ..api.conditions import get as condition
from . import status
from .actions import Action, PostEvent
from .state import Pass


def announce(p: Pass) -> list[Action]:
    """A Warning when StagesCovered or StagesReady turns bad, or says something new while bad."""
    acts: list[Action] = []
    if not p.t.spec.stages:
        return acts
    covered, stages_ready = status.stage_conditions(p, status.stage_rows(p))
    if not covered.status and covered.message != condition(p.previous, Type.STAGES_COVERED).get(
        "message"
    ):
        acts.append(PostEvent("Warning", Reason.UNCOVERED, covered.message))
    if stages_ready.reason == Reason.PATCH_NOT_APPLIED \
            and stages_ready.message != condition(p.previous, Type.STAGES_READY).get("message"):
        acts.append(PostEvent("Warning", Reason.PATCH_NOT_APPLIED, stages_ready.message))
    return acts
