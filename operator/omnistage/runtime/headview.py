"""What a pass knows of a head, and how it asks: one conditional GET per pass (304 at rest: ETags
of the listing and the report), a retry only for a head that answered before, and a backoff for
one that did not. The answers are kept per head incarnation (HEADS) between passes."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

from . import head_client, memory
from .head_client import HeadAnswerRefused, HeadClient, HeadRefused, HeadUnreachable

log = logging.getLogger(__name__)

# A head that did not answer is dialled again after 5, 10, 20, then every 30 s (or when its pod changes):
# a head restarting in place is back within seconds, a dead one costs one dial per 30 s.
UNREACHABLE_RETRY_SECONDS = (5.0, 10.0, 20.0, 30.0)


@dataclass
class HeadView:
    """The last report and listing one head incarnation gave (what head_answers keeps of them), with
    their ETags, and, for a head that did not answer, why and when to dial it again."""

    head_uid: str | None
    report: dict[str, Any] | None = None
    report_etag: str | None = None
    listing: dict[str, Any] | None = None
    listing_etag: str | None = None
    token_refused: bool = False  # 401: the Secret was replaced
    head_rv: str | None = None  # the head pod's resourceVersion when it was last dialled
    unreachable: str | None = None  # the HeadUnreachable message of the last dial
    refused: str | None = None  # ... when it was a HeadAnswerRefused: the answer broke a bound
    failures: int = 0  # dials in a row without an answer
    answered: bool = False  # this head incarnation answered at least once
    retry_at: float = 0.0
    asked: int = 0  # ask_head calls on this view: a probe's answer is kept only if none came between


# The last answers of each OmniStage's head (ask_head keeps them, with their ETags); held here, and
# dropped with the OmniStage through memory.forget.
HEADS: dict[memory.Key, HeadView] = {}


def beside_serving(namespace: str, name: str) -> memory.Key:
    """The HEADS key of the head beside the serving one during a head change (Observed.beside: the
    successor or the predecessor). The serving head's key is (namespace, name)."""
    return namespace, f"{name}/beside-serving"


def _forget(namespace: str, name: str) -> None:
    HEADS.pop((namespace, name), None)
    HEADS.pop(beside_serving(namespace, name), None)


memory.register(_forget)


def view_for(key: memory.Key, head_uid: str | None, head_rv: str | None) -> HeadView:
    """The view of this head incarnation (a new head starts with none); a head pod that changed
    (readiness, IP) is worth a dial at once, backoff or not."""
    view = HEADS.get(key)
    if view is None or view.head_uid != head_uid:
        view = HEADS[key] = HeadView(head_uid)
    if view.head_rv != head_rv:
        view.head_rv, view.retry_at = head_rv, 0.0
    return view


def settled(report: dict[str, Any] | None) -> bool:
    """A report that no longer changes within this boot (the engine and its frontend are built)."""
    return (
        report is not None
        and report.get("distributed") is not None
        and report.get("frontendCache") is not None
    )


def ask_head(client: HeadClient, view: HeadView, distributed: bool) -> tuple[
        dict[str, Any] | None, dict[str, Any] | None, str | None, str | None]:
    """(report, listing, report_problem, listing_problem). At rest: one conditional GET answered
    304 (the listing's on a distributed head, the report's otherwise); the listing is fetched when
    the epoch or boot id moved, the report when the boot id moved or it was not settled yet. A head
    that did not answer is not dialled again before its backoff (UNREACHABLE_RETRY_SECONDS) unless
    its pod changed: until then a pass says so at once instead of waiting out a timeout, and it is
    then dialled once, without a retry."""
    if view.unreachable is not None and time.monotonic() < view.retry_at:
        return None, None, f"head unreachable: {view.unreachable}", view.unreachable
    # Retry only a head that answered last time (a blip). Any other is dialled once:
    # - its backoff dials it again in 5 s anyway;
    # - after an operator restart, a hanging head then holds a worker 3 s, not 6.
    attempts = 2 if view.answered and view.unreachable is None else 1
    report_problem = listing_problem = None
    view.token_refused, view.asked = False, view.asked + 1
    try:
        if distributed:
            try:
                fresh, view.listing_etag = head_client.listing_if_changed(client, view.listing_etag, attempts)
                view.listing = fresh if fresh is not None else view.listing
            except HeadRefused as err:
                view.listing, view.listing_etag = None, None
                view.token_refused = err.status == 401
                listing_problem = str(err)
            boot = (view.listing or {}).get("bootId")
            if view.listing is not None and settled(view.report) and view.report.get("bootId") == boot:
                view.unreachable, view.refused, view.failures, view.answered = None, None, 0, True
                return view.report, view.listing, None, None
        try:
            fresh, view.report_etag = head_client.report_if_changed(client, view.report_etag, attempts)
            view.report = fresh if fresh is not None else view.report
        except HeadRefused as err:
            view.report, view.report_etag = None, None
            view.token_refused = view.token_refused or err.status == 401
            report_problem = f"the head refused the report: {err.explain()}"
    except HeadUnreachable as err:
        view.report = view.listing = view.report_etag = view.listing_etag = None
        view.refused = str(err) if isinstance(err, HeadAnswerRefused) else None
        view.failures += 1
        if view.failures == 1:
            log.info("head unreachable: %s; dialled again after %s s", err, "/".join(
                f"{s:.0f}" for s in UNREACHABLE_RETRY_SECONDS))
        backoff = UNREACHABLE_RETRY_SECONDS[min(view.failures, len(UNREACHABLE_RETRY_SECONDS)) - 1]
        view.unreachable, view.retry_at = str(err), time.monotonic() + backoff
        return None, None, f"head unreachable: {err}", str(err)
    view.unreachable, view.refused, view.failures, view.answered = None, None, 0, True
    return view.report, (view.listing if distributed and listing_problem is None else None), \
        report_problem, listing_problem


def said(view: HeadView | None, report: Any, listing: Any, report_problem: str | None,
         listing_problem: str | None) -> tuple[Any, ...]:
    """What the head said, as far as a pass depends on it (the last element of a fingerprint)."""
    return (view and view.listing_etag, view and view.report_etag, report is None, listing is None,
            report_problem, listing_problem)


def probe(namespace: str, name: str) -> bool:
    """For the resync: True when the OmniStage needs a full pass. One the last pass found at rest
    only has its head asked (one conditional GET, 304 at rest), off the reconcile workers: its pods,
    children and spec changes arrive as watch events, which queue a pass themselves.

    No lock is held while the head is asked (a hanging head would hold it for a read timeout, and
    the OmniStage's next pass, on a reconcile worker, would wait for it): the view is copied under
    the lock, the copy asked, and the answer kept under the lock again only if nothing asked the
    head in between and the head is the same (else a pass read it, or its new head's events queue
    one): dropped, and no pass queued for it."""
    key = (namespace, name)
    rest, view = memory.RESTING.get(key), HEADS.get(key)
    if rest is None:
        return True
    if rest.client is None or view is None:
        return False  # no head to ask; its pod's events will queue a pass
    lock = memory.lock(namespace, name)
    if not lock.acquire(blocking=False):
        return False  # a pass is running: it asks the head itself
    try:
        mine = copy.copy(view)  # ask_head replaces the answers it holds, never edits them
    finally:
        lock.release()
    answers = ask_head(rest.client, mine, rest.distributed)
    if not lock.acquire(blocking=False):
        return False  # a pass runs now: it asks the head itself
    try:
        if (HEADS.get(key) is not view or view.asked + 1 != mine.asked
                or memory.RESTING.get(key) is not rest):
            return False
        HEADS[key] = mine
    finally:
        lock.release()
    return said(mine, *answers) != rest.fingerprint[-1]
