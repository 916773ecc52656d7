"""The children step: every child the operator keeps as rendered, ensured each pass, kind by kind
(api/child_kinds.py: which fields of each it owns; render/children.RENDERERS: what it renders)."""

from __future__ import annotations

from ..api.child_kinds import CHILD_KINDS
from ..render.children import RENDERERS
from .actions import Action, EnsureChild
from .state import Pass


def ensure(p: Pass) -> list[Action]:
    running = [f.pool for f in p.pools if f.runs]
    return [EnsureChild(child, kind.owned_fields, kind.synced_reason)
            for kind in CHILD_KINDS for child in RENDERERS[kind.kind](p.t, running)]
