"""act is a table of executors keyed by action type (issue 43): every action the decision may give has
one, and the table holds nothing else. A new action type without an executor fails here, not in a
pass on a cluster."""

from __future__ import annotations

import typing

from omnistage.control import actions
from omnistage.runtime.act import EXECUTORS


def test_every_action_type_has_an_executor_and_nothing_else_does():
    assert set(EXECUTORS) == set(typing.get_args(actions.Action))
