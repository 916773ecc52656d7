"""The one mechanism every engine patch goes through.

A patch is a function that checks the shape of its target and either wraps it or returns a
reason to stay a no-op. `apply_patch` records the outcome, so applying twice is harmless and
`OMNISTAGE_DISABLE_PATCHES` switches a patch off (that is how the negative controls run).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("omnistage_engine_patches")

DISABLE_ENV = "OMNISTAGE_DISABLE_PATCHES"  # comma-separated patch names, or "all"

# The marker set on every wrapper we install, so a second apply sees its own work.
PATCHED_ATTR = "__omnistage_patch__"


@dataclass(frozen=True)
class Outcome:
    name: str
    applied: bool
    reason: str


_outcomes: dict[str, Outcome] = {}


def disabled(name: str) -> bool:
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    return "all" in names or name in names


def apply_patch(name: str, install: Callable[[], str | None]) -> Outcome:
    """Run `install` once per process. It returns None when it patched, or the reason it did not.

    `install` must check everything before it changes anything, so that a None-or-reason
    answer is never half-applied.
    """
    if name in _outcomes:
        return _outcomes[name]
    if disabled(name):
        outcome = Outcome(name, False, f"disabled by {DISABLE_ENV}")
    else:
        reason = install()
        outcome = Outcome(name, reason is None, reason or "applied")
    level = logging.INFO if outcome.applied or disabled(name) else logging.WARNING
    logger.log(level, "patch %s: %s", name, outcome.reason)
    _outcomes[name] = outcome
    return outcome


def outcomes() -> dict[str, Outcome]:
    return dict(_outcomes)


def is_ours(fn: object, name: str | None = None) -> bool:
    """Whether patch `name`'s wrapper (any of ours, without a name) is `fn` or under it (another
    patch may wrap on top)."""
    for _ in range(16):  # a __wrapped__ chain is short; never loop on a cyclic one
        if fn is None:
            return False
        tag = getattr(fn, "__dict__", {}).get(PATCHED_ATTR)
        if tag and (name is None or tag == name):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def mark(fn: Callable, name: str) -> Callable:
    setattr(fn, PATCHED_ATTR, name)
    return fn
