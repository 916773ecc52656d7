"""The one mechanism every engine patch goes through.

A patch is an install function that checks the shape of its target and either wraps it or says
why it stays a no-op. `apply_patch` records the outcome (see `contract.OUTCOMES`), so applying
twice is harmless, `OMNISTAGE_DISABLE_PATCHES` switches a patch off (that is how the negative
controls run), and an install that raises, for example because a future vllm-omni renamed the
module it imports, is recorded as skipped instead of escaping into vLLM's plugin loader, which
would stop every head, engine core and worker process.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import contract

logger = logging.getLogger("omnistage_engine_patches")

DISABLE_ENV = contract.DISABLE_PATCHES_ENV  # comma-separated patch names, or "all"

# The marker set on every wrapper we install, so a second apply sees its own work.
PATCHED_ATTR = "__omnistage_patch__"


class UpstreamFixed(str):
    """Returned by an install function instead of a reason: the installed vllm/vllm-omni already
    has the fix, so the patch is not needed (outcome `upstream-fixed`, not `skipped`)."""


@dataclass(frozen=True)
class Outcome:
    name: str
    outcome: str  # one of contract.OUTCOMES
    reason: str

    @property
    def applied(self) -> bool:
        return self.outcome == contract.APPLIED

    @property
    def effective(self) -> bool:
        """The defect this patch fixes is fixed in this process (by us or by upstream)."""
        return self.outcome in contract.EFFECTIVE_OUTCOMES


_outcomes: dict[str, Outcome] = {}


def disabled(name: str) -> bool:
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    return "all" in names or name in names


def _run(install: Callable[[], str | None]) -> tuple[str, str]:
    try:
        reason = install()
    except Exception as err:  # a patch must never take vLLM down with it
        logger.debug("install raised", exc_info=True)
        return contract.SKIPPED, f"install failed ({type(err).__name__}: {err})"
    if reason is None:
        return contract.APPLIED, "applied"
    if isinstance(reason, UpstreamFixed):
        return contract.UPSTREAM_FIXED, str(reason)
    return contract.SKIPPED, str(reason)


def apply_patch(name: str, install: Callable[[], str | None]) -> Outcome:
    """Run `install` once per process. It returns None when it patched, an `UpstreamFixed` when
    upstream has the fix, or the reason it did not patch; an exception counts as a reason.

    `install` must check everything before it changes anything, so that an answer is never
    half-applied.
    """
    if name in _outcomes:
        return _outcomes[name]
    if disabled(name):
        outcome = Outcome(name, contract.DISABLED, f"disabled by {DISABLE_ENV}")
    else:
        outcome = Outcome(name, *_run(install))
    _record(outcome)
    return outcome


def demote(name: str, reason: str) -> None:
    """An applied patch found, at run time, that it did not do its work (e.g. its wrapper was never
    reached): record it as skipped so the report and the operator see it."""
    current = _outcomes.get(name)
    if current is not None and current.applied:
        _record(Outcome(name, contract.SKIPPED, reason))


def _record(outcome: Outcome) -> None:
    level = logging.WARNING if outcome.outcome == contract.SKIPPED else logging.INFO
    logger.log(level, "patch %s: %s: %s", outcome.name, outcome.outcome, outcome.reason)
    _outcomes[outcome.name] = outcome


def outcomes() -> dict[str, Outcome]:
    return dict(_outcomes)


def applied(name: str) -> bool:
    outcome = _outcomes.get(name)
    return bool(outcome and outcome.applied)


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


def argument(fn: Callable, name: str) -> Callable[[tuple, dict], Any] | None:
    """A reader of `fn`'s argument `name` from a wrapper's (args, kwargs) (args without `self`),
    at the position `fn` declares it; None when `fn` cannot take it positionally or by keyword, or
    declares no default for it (the shape check's answer: the wrapper must not guess a position).
    """
    params = list(inspect.signature(fn).parameters.values())
    found = next((p for p in params if p.name == name), None)
    if found is None or found.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD \
            or found.default is inspect.Parameter.empty:
        return None
    position = params.index(found) - 1  # args as a method wrapper sees them: without self
    default = found.default

    def read(args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[position] if len(args) > position else default
    return read

