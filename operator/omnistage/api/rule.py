"""What a cross-field rule of the OmniStage spec is: one CEL expression (the API server's check, None
when CEL cannot express it), one Python predicate (the operator's) and the one message both answer with.
The rows are field_rules.py's and template_rules.py's; validation.py runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .specs import OmniStageSpec


@dataclass(frozen=True)
class Rule:
    field: str  # relative to spec, as the API server's fieldPath
    cel: str | None
    message: str
    # The parts of `field` that break the rule, relative to it ("" for the field as a whole,
    # "[2]" for an item, ".runtime.num_replicas" for a nested key); empty when the rule holds.
    broken: Callable[[OmniStageSpec], list[str]]


def unless(holds: Callable[[OmniStageSpec], bool]) -> Callable[[OmniStageSpec], list[str]]:
    """For rules about a field as a whole."""
    return lambda s: [] if holds(s) else [""]

