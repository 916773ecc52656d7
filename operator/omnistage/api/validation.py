"""Every rule a valid OmniStage obeys beyond per-field constraints, and the check that runs them.

Each rule is written twice on purpose, once as CEL (the API server enforces it, see crd.py)
and once in Python (`omnistage render` and the reconcile loop enforce it), with one message.
A rule CEL cannot express (cel=None) is enforced by the operator alone: the OmniStage gets
Ready=False, reason InvalidSpec, and its running pods are left alone. The operator's problems name
the exact item or key (spec.engine.extraArgs[2], spec.engine.stageOverrides.runtime.num_replicas).

This module is the table (SPEC_RULES) and the check that runs it (validate_omnistage). What a rule
is: rule.py. Its rows: field_rules.py (the spec's own fields; their longer predicates, what the
operator sets, in owned.py) and template_rules.py (what spec.template must not set; predicates in
template_checks.py); the multi-stage rules, Python only, are pipeline_rules.py's.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .child_names import OMNISTAGE_NAME_RULES, name_problems
from .conditions import Reason
from .field_rules import FIELD_RULES
from .pipeline_rules import multi_stage_problems
from .service_account import service_account_problems
from .specs import OmniStageSpec
from .template_checks import template_schema_problems
from .template_rules import TEMPLATE_RULES

# An object that names no namespace (`omnistage render -f`) is taken to be where kubectl would put it.
DEFAULT_NAMESPACE = "default"

# The order is the CRD's x-kubernetes-validations order and the order problems are named in.
SPEC_RULES = [*FIELD_RULES, *TEMPLATE_RULES]


class InvalidSpec(ValueError):
    """A spec the operator will not act on; `problems` are (field, message) pairs; `reason` is the
    ConfigRendered and Ready reason it sets (InvalidSpec, or ConfigTooLarge: render/target.py)."""

    def __init__(self, problems: list[tuple[str, str]], reason: str = Reason.INVALID_SPEC):
        self.problems, self.reason = problems, reason
        super().__init__("; ".join(f"{f}: {m}" for f, m in problems))


def _pydantic_problems(err: ValidationError) -> list[tuple[str, str]]:
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        extra = (
            f" (got {e['input']!r})" if e["type"] != "missing" and not isinstance(e["input"], dict) else ""
        )
        out.append((f"spec.{path}" if path else "spec", f"{e['msg']}{extra}"))
    return out


def validate_omnistage(obj: dict[str, Any]) -> OmniStageSpec:
    """Parse and check an OmniStage object; raises InvalidSpec naming every offending field."""
    name = (obj.get("metadata") or {}).get("name") or ""
    problems: list[tuple[str, str]] = []
    if not name:
        problems.append(("metadata.name", "is required"))
    else:
        problems += name_problems(name, OMNISTAGE_NAME_RULES)
    try:
        spec = OmniStageSpec.model_validate(obj.get("spec") or {})
    except ValidationError as err:
        raise InvalidSpec(problems + _pydantic_problems(err)) from None
    problems += template_schema_problems(spec)
    problems += [(f"spec{r.field}{part}", r.message) for r in SPEC_RULES for part in r.broken(spec)]
    namespace = (obj.get("metadata") or {}).get("namespace") or DEFAULT_NAMESPACE
    problems += service_account_problems(namespace, spec)
    if not problems:
        problems += multi_stage_problems(spec)
    if problems:
        raise InvalidSpec(problems)
    return spec
