"""The children step: every child the operator keeps as rendered (api/child_kinds.py says which
fields of each it owns), ensured each pass."""

from __future__ import annotations

from ..api.child_kinds import BY_KIND
from ..render import (
    render_api_service,
    render_configmap,
    render_disruption_budget,
    render_master_service,
    render_network_policy,
)
from .actions import Action, EnsureChild
from .state import Pass


def ensure(p: Pass) -> list[Action]:
    acts: list[Action] = []
    t = p.t
    budgets = [
        render_disruption_budget(t),
        *(render_disruption_budget(t, f.pool) for f in p.pools if f.runs),
    ]
    for child in (render_configmap(t), render_api_service(t), render_master_service(t),
                  render_network_policy(t), *budgets):
        kind = BY_KIND[child["kind"]]
        acts.append(EnsureChild(child, kind.owned_fields, kind.synced_reason))
    return acts
