"""Changed copies of an OmniStage document, for tests that vary the committed sample one field at a time."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def with_spec_changes(doc: Mapping[str, Any], changes: Mapping[str, Any], sep: str = ".") -> dict[str, Any]:
    """A deep copy of `doc` with fields below its spec set: each key of `changes` is a path whose
    parts are joined by `sep` ("gpu.product"; "__" where the keys are keyword arguments), and the
    objects on the way are created when missing."""
    out = copy.deepcopy(dict(doc))
    for path, value in changes.items():
        node = out["spec"]
        *parents, last = path.split(sep)
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out
