"""Changed copies of an OmniStage document, for tests that vary the committed sample one field at a time,
and the check that validation refuses a copy for exactly one reason."""

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


def refused_exactly(obj: dict, field: str, words: str) -> None:
    """validate_omnistage finds exactly one problem in `obj`, at `field`, its message holding `words`,
    and names the field where the InvalidSpec condition and Event will."""
    import pytest
    from omnistage.api.validation import InvalidSpec, validate_omnistage

    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(obj)
    assert [f for f, _ in err.value.problems] == [field], err.value.problems
    assert words in err.value.problems[0][1]
    assert field in str(err.value)
