"""A pass decides once (issue 43): observe -> decide -> act -> describe, its status the decision's told
what act could not do. What only a new read can show (a created pod's uid, the replica id a join got)
is the next pass's, which the changed pods start anyway. Before, a pass that wrote pods or a head's
membership observed and decided again to describe, and one whose pod was about to mount the
membership Secret decided twice more: up to three decisions. No API server, no head: the pass's
reads and act are monkeypatched."""

from __future__ import annotations

from dataclasses import replace

import pytest
from omnistage.control.actions import CreatePod, Join
from omnistage.runtime import memory, reconcile
from omnistage.runtime.act import Acted

from .test_plan import member, of, replica, situation


@pytest.fixture
def pass_of(monkeypatch):
    """Runs one pass on an observation; returns (decisions made, the actions act was given)."""
    monkeypatch.setattr(memory, "RESTING", {})
    monkeypatch.setattr(memory, "LAST_VALID", {})
    monkeypatch.setattr(reconcile, "_neighbours", lambda obj: ())
    monkeypatch.setattr(reconcile, "_fingerprint",
                        lambda o, t: ("read", o.obj["metadata"].get("resourceVersion")))
    monkeypatch.setattr(reconcile, "ensure_token", lambda t, emit, read=False: ("token", None))
    monkeypatch.setattr(reconcile.credentials, "ensure_mounting", lambda pods, token, emit: [])
    monkeypatch.setattr(reconcile.act_step, "write_pool_statuses", lambda namespace, statuses: None)

    def run(o):
        decisions, given = [], []
        decide = reconcile.decision

        def counted(*args, **kw):
            decisions.append(1)
            return decide(*args, **kw)

        monkeypatch.setattr(reconcile, "decision", counted)
        monkeypatch.setattr(reconcile, "observe", lambda obj, t, token, refused=None: (o, (None, None)))
        monkeypatch.setattr(reconcile.act_step, "act",
                            lambda ns, actions, *a, **kw: given.extend(actions) or Acted([], []))
        run.status = reconcile._reconcile(o.obj, lambda *e: None)
        return len(decisions), given
    return run


def test_a_pass_that_creates_and_joins_decides_once(pass_of):
    # replica 3 to create, replica 2 to join
    _, o = situation(4, pods_=lambda t: [replica(t, 1), replica(t, 2)], members=lambda rs: [member(rs[0], 1)])
    decisions, given = pass_of(o)
    assert of(given, CreatePod) and of(given, Join)
    assert decisions == 1


def test_a_pass_with_a_pod_mounting_the_secret_decides_once(pass_of):
    starting = lambda t: [replica(t, 1), replica(t, 2, ready=False, phase="Pending")]
    _, o = situation(3, pods_=starting)
    assert reconcile._mounting(o)
    assert pass_of(o)[0] == 1


def test_a_pass_at_rest_decides_nothing(pass_of):
    _, o = situation(3)
    o = replace(o, obj={**o.obj, "metadata": {**o.obj["metadata"], "resourceVersion": "7"}})
    assert pass_of(o)[0] == 1  # the first pass writes the status
    o = replace(o, obj={**o.obj, "status": pass_of.status})
    assert pass_of(o)[0] == 1  # at rest: remembered
    assert pass_of(o)[0] == 0  # the same reading again: the decision is known


def test_each_step_returns_its_actions():
    """The steps return what they decide (plan.decided_pass adds it to the pass in order); the Pass
    holds no helper that adds an action behind a step's back."""
    import inspect

    from omnistage.control import plan as plan_module
    from omnistage.control.state import Pass

    for step in (*plan_module.SERVING_STEPS, *plan_module.BESIDE_SERVING_STEPS, plan_module.headswap.finish):
        returns = inspect.signature(step).return_annotation  # a string: the modules defer annotations
        assert returns == "list[Action]", f"{step.__module__}.{step.__name__} returns {returns}"
    helpers = {name for name, _ in inspect.getmembers(Pass, inspect.isfunction)}
    assert not helpers & {"emit", "delete"}
