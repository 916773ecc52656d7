"""The one mechanism every engine patch goes through.

A patch is an install function that checks the shape of its target and either wraps it or says
why it stays a no-op. `apply_patch` records the outcome (see `contract.OUTCOMES`), so applying
twice is harmless, `OMNISTAGE_DISABLE_PATCHES` switches a patch off (that is how the negative
controls run), and an install that raises, for example because a future vllm-omni renamed the
module it imports, is recorded as skipped instead of escaping into vLLM's plugin loader, which
would stop every head, engine core and worker process.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import uuid
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

#: A new value per head process: a changed boot id tells the operator the head restarted, and a
#: replica's engine that its head is a new process (patch reattach). Served by report.py.
BOOT_ID = uuid.uuid4().hex


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


# ---- the shape of an install: check every target, then wrap each ------------------------------------

@dataclass(frozen=True)
class Target:
    """What an install expects of one upstream callable: `owner.attr` exists and, when `params` is
    given, takes exactly those parameters (with `more`, those first), as a coroutine function when
    `coroutine` says so."""

    owner: Any
    attr: str
    params: tuple[str, ...] | None = None
    more: bool = False
    coroutine: bool | None = None

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__name__', self.owner)}.{self.attr}"

    def get(self) -> Any:
        return getattr(self.owner, self.attr, None)

    def problem(self) -> str | None:
        fn = self.get()
        if not callable(fn):
            return f"target changed shape: {self.label} is missing"
        if self.params is None:
            return None
        got = list(inspect.signature(fn).parameters)  # sees through wrappers (__wrapped__)
        fits = (got[:len(self.params)] if self.more else got) == list(self.params)
        if fits and (self.coroutine is None or inspect.iscoroutinefunction(fn) == self.coroutine):
            return None
        return (f"target changed shape: {'async ' if self.coroutine else ''}{self.label}"
                f"({', '.join(self.params)}{', ...' if self.more else ''})")


def shape_problem(*targets: Target) -> str | None:
    """The first target missing, then the first of another shape, as the reason an install stays a
    no-op; None when every target fits. Call it before changing anything."""
    missing = next((t for t in targets if not callable(t.get())), None)
    if missing is not None:
        return missing.problem()
    return next((p for t in targets if (p := t.problem()) is not None), None)


def ours(name: str, *targets: Target) -> bool:
    """Whether patch `name`'s wrappers already sit on any of the targets (applied before in this
    process): a second install then changes nothing."""
    return any(is_ours(t.get(), name) for t in targets)


def wrap(owner: Any, attr: str, name: str) -> Callable[[Callable], Callable]:
    """Decorator: install `fn(original, *args, **kwargs)` as `owner.attr`, marked as patch `name`'s,
    with the original's name, signature and docstring (functools.wraps), async when `fn` is."""
    original = getattr(owner, attr)

    def install(fn: Callable) -> Callable:
        if inspect.iscoroutinefunction(fn):
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                return await fn(original, *args, **kwargs)
        else:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(original, *args, **kwargs)
        setattr(owner, attr, mark(functools.wraps(original)(wrapper), name))
        return fn
    return install


# ---- what the patches keep on upstream objects ----------------------------------------------------
# One list, so that a name used on two kinds of object is seen, and no name is spelled twice.
MEMBERSHIP_STATE = "_omnistage_membership"  # orchestrator: membership's MembershipState
LOOP = "_omnistage_loop"  # orchestrator: its running event loop (membership, read by membership_ops)
NEXT_ENGINE_IDX = "_omnistage_next_engine_idx"  # orchestrator: replica_metrics' engine-idx allocator
ENGINE_REF = "_omnistage_engine_ref"  # orchestrator: weakref to its engine (mm_cache_metrics)
# A weakref to the orchestrator, on two kinds of object: the MembershipController (membership) and
# each StagePool (replica_metrics: the attach hook only sees the controller's pools).
ORCHESTRATOR = "_omnistage_orchestrator"
DRAINING = "_omnistage_draining"  # StagePool.__dict__: replica ids that get no fresh picks (a leave)
HELD = "_omnistage_held"  # StagePool.__dict__: replica ids unroutable until joined
STAGE0_CACHE_DECIDED = "_omnistage_stage0_cache_decided"  # engine: frontend_cache decided stage 0's cache
# MembershipController.__dict__: (stage, addr) -> when it went silent (engine_liveness)
SILENT = "_omnistage_silent"
STASHED = (
    MEMBERSHIP_STATE,
    LOOP,
    NEXT_ENGINE_IDX,
    ENGINE_REF,
    ORCHESTRATOR,
    DRAINING,
    HELD,
    STAGE0_CACHE_DECIDED,
    SILENT,
)


def referent(obj: Any, key: str) -> Any | None:
    """The object behind a weakref stashed on `obj` (None: none stashed, or it is gone)."""
    ref = getattr(obj, key, None)
    return ref() if ref is not None else None
