"""What the operator keeps of a head's answer, read within a memory budget.

A head's image is the tenant's, so its answers are untrusted. `json.loads` turns a few MiB of small
JSON values into about 25 times as many bytes of Python objects, and the operator keeps each head's
last listing and report (headview.HEADS): before this module, 4 MiB answers from three hostile heads
took the operator past its memory limit. So an answer is

- counted before it is parsed (`Limits`: its quotes, separators and containers, counted at C speed
  on the bytes), which bounds what `json.loads` can build from it;
- parsed one at a time (`_PARSING`: json.loads holds the GIL anyway, so nothing runs in parallel
  that way; serial, one parse's garbage is freed before the next is built);
- and cut down to the fields the operator's decision reads (`listing`, `report`, `small`), each of
  the type the contract gives it and bounded in length. Enumerated values become the contract's own
  strings; an answer whose shape is wrong is refused whole, never read in part.

A refused answer is `Refused(why)`: head_client makes it HeadAnswerRefused, and the OmniStage's
status says which answer was refused and why (Reason.HEAD_ANSWER_REFUSED). The reasons name a
bound or a field, never a value the head sent: a status message carries no text of the head's."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from typing import Any

from omnistage_engine_patches import contract

#: The members a listing may hold over all stages. The CRD allows more in theory (256 replicas per
#: stage, 15 pool stages), but a thousand engines behind one head is far past anything run; a
#: listing over it is refused, and status says so.
MAX_MEMBERS = 1024
MAX_STAGES = 16  # stage 0 and spec.stages' 1..15
_MAX_INT = 2**53  # what the status schema (int64) and a JSON reader elsewhere both hold exactly
_POD = 253  # a pod name is a DNS subdomain
_HOST = 64  # an IPv6 literal is at most 45
_ID = 128  # boot ids (uuid hex), versions, cache class names
_TEXT = 1024  # free text (a patch's reason, an error's message): cut, not refused


@dataclass(frozen=True)
class Limits:
    """What one answer may hold, counted on its bytes before it is parsed. The counts include what
    is inside strings (counting outside them would cost a Python loop or many small objects: the
    memory this is about), so the bounds are generous for the real answers: a member of the
    listing has about 30 keys and values, 85 quotes, 2 objects and up to 7 colons in an IPv6 host."""

    bytes: int
    quotes: int  # '"': two per string, keys included
    values: int  # ',' and ':'
    containers: int  # '{' and '['


REPORT = Limits(64 * 1024, 8192, 4096, 256)  # a real report is about 2 KiB
LISTING = Limits(1024 * 1024, 128 * MAX_MEMBERS, 64 * MAX_MEMBERS, 4 * MAX_MEMBERS + 64)
SMALL = Limits(16 * 1024, 512, 512, 64)  # a join's or leave's answer, an error's body

_PARSING = threading.Lock()


class Refused(Exception):
    """The answer broke its budget or its shape: no answer. str() is why (a bound or a field)."""


def parse(raw: bytes | bytearray, limits: Limits) -> Any:
    """The JSON value of `raw`, counted against `limits` before json.loads builds it: json.loads
    makes at most one object per container and value, so the counts bound what it builds. Nesting
    is bounded by the containers and, while parsing, by the interpreter's recursion limit (about
    1000); the readers below walk the contract's shape alone, 5 deep at most."""
    if len(raw) > limits.bytes:
        raise Refused(f"over {limits.bytes} bytes")
    for count, most, what in (
        (raw.count(b'"'), limits.quotes, "quotes"),
        (raw.count(b",") + raw.count(b":"), limits.values, "values"),
        (raw.count(b"{") + raw.count(b"["), limits.containers, "objects and arrays"),
    ):
        if count > most:
            raise Refused(f"over {most} {what}")
    try:
        return json.loads(raw.decode())  # UTF-8 only, as the head sends it
    except RecursionError:
        raise Refused("nested too deep") from None
    except ValueError:  # UnicodeDecodeError included
        raise Refused("not JSON") from None


def read(raw: bytes | bytearray, limits: Limits, keep: Any) -> dict[str, Any]:
    """`keep(parse(raw, limits))`, one answer at a time (the module's docstring says why)."""
    with _PARSING:
        return keep(parse(raw, limits))


# ---- the fields kept -------------------------------------------------------------------------------

def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Refused(f"{where} is not an object")
    return value


def _ident(obj: dict[str, Any], key: str, most: int, where: str) -> str | None:
    """A string compared for identity (a boot id, a pod, an address): refused when over `most`."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > most:
        raise Refused(f"{where}.{key} is not a string of at most {most} characters")
    return value


def _text(obj: dict[str, Any], key: str, where: str) -> str | None:
    """Free text for a message: cut to _TEXT characters."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise Refused(f"{where}.{key} is not a string")
    return value[:_TEXT]


def _flag(obj: dict[str, Any], key: str, where: str) -> bool | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise Refused(f"{where}.{key} is not a boolean")
    return value


def _count(obj: dict[str, Any], key: str, where: str) -> int | None:
    value = obj.get(key)
    if value is not None and (type(value) is not int or not 0 <= value < _MAX_INT):
        raise Refused(f"{where}.{key} is not an integer from 0 to 2^53")
    return value


def _one_of(obj: dict[str, Any], key: str, known: dict[str, str], where: str) -> str | None:
    """An enumerated value as the contract spells it (one shared string); another one as "unknown"."""
    value = _ident(obj, key, _ID, where)
    return None if value is None else known.get(value, "unknown")


def _present(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


_STATES = {s: s for s in (contract.PENDING, contract.REGISTERED, contract.ATTACHED, contract.DRAINING,
                          contract.DETACHED, contract.LEFT)}
_COORDS = {s: s for s in (contract.COORD_UP, contract.COORD_SILENT, contract.COORD_ABSENT)}
_OUTCOMES = {s: s for s in contract.OUTCOMES}


def _member_patches(value: Any, where: str) -> dict[str, str] | None:
    """A member's registration report: the outcomes of the patches the operator knows (status and
    StagesReady read those only)."""
    if value is None:
        return None
    report = _object(value, where)
    return {name: outcome for name in contract.PATCHES
            if (outcome := _one_of(report, name, _OUTCOMES, where)) is not None}


def _member(value: Any, where: str) -> dict[str, Any]:
    mm = _object(value, where)
    if _count(mm, "replicaId", where) is None:
        raise Refused(f"{where} has no replicaId")
    silent = mm.get("silentSeconds")
    if silent is not None and (type(silent) not in (int, float) or not math.isfinite(silent)):
        raise Refused(f"{where}.silentSeconds is not a number")
    return _present(
        replicaId=mm["replicaId"], host=_ident(mm, "host", _HOST, where), pod=_ident(mm, "pod", _POD, where),
        local=_flag(mm, "local", where) or None, state=_one_of(mm, "state", _STATES, where),
        coordinatorStatus=_one_of(mm, "coordinatorStatus", _COORDS, where), silentSeconds=silent,
        patches=_member_patches(mm.get("patches"), f"{where}.patches"))


def listing(value: Any) -> dict[str, Any]:
    """The membership listing as the operator reads it (contract.Listing): boot id, epoch, members."""
    top = _object(value, "the listing")
    stages = _object(top.get("stages") or {}, "stages")
    if len(stages) > MAX_STAGES:
        raise Refused(f"over {MAX_STAGES} stages")
    kept: dict[str, list[dict[str, Any]]] = {}
    total = 0
    for stage, members in stages.items():
        if not stage.isdigit() or len(stage) > 2 or not isinstance(members, list):
            raise Refused("stages is not a map of stage ids to lists")
        total += len(members)
        if total > MAX_MEMBERS:
            raise Refused(f"over {MAX_MEMBERS} members")
        kept[stage] = [_member(mm, f"stages.{stage}[{i}]") for i, mm in enumerate(members)]
    return _present(bootId=_ident(top, "bootId", _ID, "the listing"),
                    epoch=_count(top, "epoch", "the listing"),
                    distributed=_flag(top, "distributed", "the listing"), stages=kept)


def _report_patch(value: Any, where: str) -> dict[str, Any]:
    patch = _object(value, where)
    return _present(outcome=_one_of(patch, "outcome", _OUTCOMES, where), reason=_text(patch, "reason", where))


def report(value: Any) -> dict[str, Any]:
    """The engine report as the operator reads it (contract.EngineReport)."""
    top = _object(value, "the report")
    frontend = top.get("frontendCache")
    if frontend is not None:
        frontend = _object(frontend, "frontendCache")
        frontend = {"cacheClass": _ident(frontend, "cacheClass", _ID, "frontendCache"),
                    "mode": _ident(frontend, "mode", _ID, "frontendCache"),
                    "requested": _ident(frontend, "requested", _ID, "frontendCache")}
    patches = _object(top.get("patches") or {}, "patches")
    if len(patches) > 2 * len(contract.PATCHES):
        raise Refused(f"over {2 * len(contract.PATCHES)} patches")
    for name in patches:
        if len(name) > _ID:
            raise Refused(f"a patch name is over {_ID} characters")
    return {
        "bootId": _ident(top, "bootId", _ID, "the report"),
        "pluginVersion": _ident(top, "pluginVersion", _ID, "the report"),
        "vllmVersion": _ident(top, "vllmVersion", _ID, "the report"),
        "vllmOmniVersion": _ident(top, "vllmOmniVersion", _ID, "the report"),
        "distributed": _flag(top, "distributed", "the report"),
        "frontendCache": frontend,
        "patches": {name: _report_patch(p, "a patch of the report") for name, p in patches.items()},
    }


def small(value: Any) -> dict[str, Any]:
    """A join's, leave's or hold's answer, or an error's body: its top-level scalars."""
    top = value if isinstance(value, dict) else {"error": f"unexpected answer {str(value)[:200]}"}
    kept = {}
    for key, item in list(top.items())[:16]:
        if isinstance(item, str):
            kept[key[:_ID]] = item[:_TEXT]
        elif item is None or isinstance(item, bool | int | float) and abs(item) < _MAX_INT:
            kept[key[:_ID]] = item
    return kept
