"""A JSON merge patch applied the way the API server applies one (RFC 7386): a None value removes the
key, a dict merges into a dict, anything else replaces. For tests that build a changed copy of an
object, or carry a status between passes as the API server stores it."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def apply_merge_patch(target: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `target` with `patch` merged in; neither argument changes."""
    out = copy.deepcopy(dict(target))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = apply_merge_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
