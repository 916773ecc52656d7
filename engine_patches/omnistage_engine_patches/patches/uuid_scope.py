"""Defect 2: scoping stage-0 multimodal UUIDs never writes back into the caller's prompt.

vllm-omni 0.30.0's `AsyncOmniEngine._ensure_stage_replica_mm_uuids` does
`prompt["multi_modal_uuids"] = scoped_uuids` on the dict the caller passed to
`add_request` (`_build_add_request_message` hands it over unless a `prompt_transform_func`
copied it). The caller's dict then carries `stage0:repA:<hash of the old media>`, which the next
call reads back as a *user* UUID: a reused template, a retry or a shallow copy with new media is
keyed `stage0:repB:stage0:repA:<old hash>`, and two such requests on one replica share a key, so
the sender cache omits the new tensor and the replica silently serves the old media's features.
`original_prompt` (what later stages see) is the same dict, so they see scoped UUIDs too.

The fix wraps `_build_add_request_message` (the one place both `add_request` and
`add_streaming_update` go through):

* it hands the original a private shallow copy of the prompt (each dict of a list prompt), so
  the scoped UUIDs are written into the copy only, never, not even for a moment, into the
  caller's dict; concurrent callers sharing one template therefore cannot observe them;
* every other top-level change the original makes to its working dict (the
  `additional_information` it injects, the request artifact dirs `add_request` cleans up) is
  mirrored onto the caller's dict, so callers see exactly what they saw before, minus the UUIDs;
* the returned message's `original_prompt` (and `prompt`, where the original returns the input
  unchanged, e.g. a diffusion stage 0) is the caller's object again, so later stages see the
  caller's unscoped UUIDs and `add_request`'s cleanup keeps working on the caller's dict;
* a UUID that this process itself wrote (a scoped key that reached a caller some other way, e.g.
  read back from a request's features, and is sent again) is not a user UUID. It is dropped
  from the private copy when the media item is present, so the item is keyed by a hash of its
  own media and a retry that lands on another replica gets exactly one `stage0:repN:` prefix
  (the original code would produce `stage0:repB:stage0:repA:...`). When the item is None (a
  UUID-only reference to cached media) the prefix is stripped instead, keeping the base key.
  Only values this process wrote are treated so (a bounded record of them): a user's own UUID
  that merely looks like `stage3:rep7:asset-42` is the user's and is kept, as upstream's fix
  keeps it.
"""

from __future__ import annotations

import copy
import inspect
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

from .. import contract
from .._patching import Target, UpstreamFixed, ours, shape_problem, wrap

NAME = contract.UUID_SCOPE
logger = logging.getLogger("omnistage_engine_patches")

UUIDS_KEY = "multi_modal_uuids"
DATA_KEY = "multi_modal_data"
# The shape `_ensure_stage_replica_mm_uuids` writes: f"stage{stage_id}:rep{replica_id}:{base}".
ENGINE_SCOPED_UUID = re.compile(r"^(?:stage\d+:rep\d+:)+")
# The write-back line of 0.30.0; when it is gone upstream has fixed the defect.
_WRITE_BACK = re.compile(r"prompt\[\s*[\"']multi_modal_uuids[\"']\s*\]\s*=")
# Scoped UUIDs this process wrote, newest last; bounded (a retry comes soon after its request).
_MAX_WRITTEN = 65536


class _Written:
    """The scoped UUIDs this process's engine wrote into its private prompt copies."""

    def __init__(self) -> None:
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, uuids: list[str]) -> None:
        with self._lock:
            for uuid in uuids:
                self._keys[uuid] = None
                self._keys.move_to_end(uuid)
            while len(self._keys) > _MAX_WRITTEN:
                self._keys.popitem(last=False)

    def __contains__(self, uuid: object) -> bool:
        with self._lock:
            return uuid in self._keys


WRITTEN = _Written()


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _uuid_strings(uuids: Any) -> set[str]:
    if not isinstance(uuids, dict):
        return set()
    return {u for value in uuids.values() for u in _as_list(value) if isinstance(u, str)}


def _without_engine_scopes(prompt: dict) -> dict | None:
    """The prompt's UUIDs with this process's scopes removed, or None when there are none."""
    uuids = prompt.get(UUIDS_KEY)
    if not isinstance(uuids, dict):
        return None
    mm_data = prompt.get(DATA_KEY)
    changed = False
    cleaned: dict[str, Any] = {}
    for modality, value in uuids.items():
        if value is None:
            cleaned[modality] = None
            continue
        items = _as_list(mm_data.get(modality)) if isinstance(mm_data, dict) else []
        out = []
        for idx, uuid in enumerate(_as_list(value)):
            if isinstance(uuid, str) and ENGINE_SCOPED_UUID.match(uuid) and uuid in WRITTEN:
                changed = True
                item = items[idx] if idx < len(items) else None
                # Media present: key it by its own content. UUID-only reference: keep the base key.
                uuid = None if item is not None else ENGINE_SCOPED_UUID.sub("", uuid)
            out.append(uuid)
        cleaned[modality] = out if isinstance(value, list) else out[0]
    return cleaned if changed else None


def _private_copy(prompt: Any) -> Any:
    """A shallow copy the original may scope in place; the caller's objects stay untouched."""
    if isinstance(prompt, dict):
        private = copy.copy(prompt)
        cleaned = _without_engine_scopes(private)
        if cleaned is not None:
            private[UUIDS_KEY] = cleaned
        return private
    if isinstance(prompt, list):
        return [_private_copy(p) if isinstance(p, dict) else p for p in prompt]
    return prompt


def _mirror(private: dict, caller: dict, before: dict) -> None:
    """Apply to `caller` the top-level changes the original made to `private` (not the UUIDs)."""
    for key in before:
        if key != UUIDS_KEY and key not in private and key in caller:
            del caller[key]
    for key, value in private.items():
        if key == UUIDS_KEY:
            continue
        if key not in before or before[key] is not value:
            caller[key] = value


def upstream_writes_back(engine_cls: type) -> bool | None:
    """Whether upstream's scoping writes the scoped UUIDs into the caller's prompt, found by running it:
    on an engine built without `__init__` (`object.__new__`, as vllm-omni's own unit tests build one)
    and a prompt whose one item is a UUID-only reference (nothing to hash). True: 0.30.0's write-back;
    False: the caller's prompt is left as it was (vllm-omni 0.32 returns a scoped copy); None: it
    could not run (then the source decides)."""
    uuids = {"image": ["omnistage-probe"]}
    prompt = {DATA_KEY: {"image": [None]}, UUIDS_KEY: uuids}
    try:
        probe = object.__new__(engine_cls)
        engine_cls._ensure_stage_replica_mm_uuids(probe, prompt, stage_id=0, replica_id=0)
    except Exception:  # another shape: the source check decides
        logger.debug("running upstream's UUID scoping on a probe failed", exc_info=True)
        return None
    return prompt.get(UUIDS_KEY) is not uuids or uuids != {"image": ["omnistage-probe"]}


def install() -> str | None:
    try:
        from vllm_omni.engine.async_omni_engine import AsyncOmniEngine
        from vllm_omni.engine.messages import StageSubmissionMessage
    except ImportError as e:
        return f"target not importable ({e})"

    build_target = Target(AsyncOmniEngine, "_build_add_request_message", ("self", "request_id", "prompt"),
                          more=True)
    ensure_target = Target(AsyncOmniEngine, "_ensure_stage_replica_mm_uuids")
    problem = shape_problem(build_target, ensure_target)
    if problem:
        return problem
    if ours(NAME, build_target):
        return None  # already in place (e.g. this module was reloaded)
    build, ensure = build_target.get(), ensure_target.get()
    signature = inspect.signature(build)
    if "original_prompt" not in getattr(StageSubmissionMessage, "__struct_fields__", ()):
        return "StageSubmissionMessage has no original_prompt field"
    try:
        ensure_src = inspect.getsource(ensure)
        build_src = inspect.getsource(build)
    except (OSError, TypeError) as e:
        return f"cannot read the target source to check its shape ({e})"
    # Behaviour first: a write-back moved into a helper leaves no line to find in ensure's source.
    writes_back = upstream_writes_back(AsyncOmniEngine)
    if writes_back is False:
        return UpstreamFixed("upstream no longer writes scoped UUIDs back into the prompt dict "
                             "(its scoping, run on a probe, left the caller's prompt as it was)")
    if writes_back is None and not _WRITE_BACK.search(ensure_src):
        return UpstreamFixed("upstream no longer writes scoped UUIDs back into the prompt dict")
    if "_scope_stage0_multimodal_cache_to_replica" not in build_src or "original_prompt" not in build_src:
        return "_build_add_request_message no longer scopes stage-0 UUIDs the way 0.30.0 does"

    @wrap(AsyncOmniEngine, "_build_add_request_message", NAME)
    def _build_add_request_message(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(self, *args, **kwargs)
        caller_prompt = bound.arguments.get("prompt")
        if not isinstance(caller_prompt, (dict, list)):
            return original(*bound.args, **bound.kwargs)
        private_prompt = _private_copy(caller_prompt)
        if isinstance(caller_prompt, dict):
            pairs = [(private_prompt, caller_prompt)]
        else:
            pairs = [(p, c) for p, c in zip(private_prompt, caller_prompt) if isinstance(c, dict)]
        before = [dict(p) for p, _ in pairs]
        bound.arguments["prompt"] = private_prompt
        try:
            msg = original(*bound.args, **bound.kwargs)
        finally:
            # Also on failure: the original mutated its working dict before raising, and
            # add_request's cleanup reads the artifact dirs from the caller's dict.
            for (private, caller), snapshot in zip(pairs, before):
                _mirror(private, caller, snapshot)
                written = _uuid_strings(private.get(UUIDS_KEY)) - _uuid_strings(snapshot.get(UUIDS_KEY))
                if written:
                    WRITTEN.add(sorted(written))
        if getattr(msg, "original_prompt", None) is private_prompt:
            msg.original_prompt = caller_prompt
        if getattr(msg, "prompt", None) is private_prompt:
            msg.prompt = caller_prompt
        return msg

    return None

