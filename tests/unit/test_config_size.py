"""The rendered deploy config is size-checked with a clear refusal (issue 27): a ConfigMap holds at most
1 MiB, and a 1.1 MB spec.engine.stageOverrides (the OmniStage itself may hold 1.5 MiB) made every pass
fail on the ConfigMap's apply. Now the OmniStage is refused before anything is applied: ConfigRendered
and Ready False, reason ConfigTooLarge, naming the field and the limit, one Warning Event, and no action
on what runs (the cluster tier applies it through the API server: tests/cluster/test_refusals.py)."""

from __future__ import annotations

import copy

import pytest
from omnistage.api.conditions import Reason, Type
from omnistage.api.validation import InvalidSpec
from omnistage.control.actions import Observed, PostEvent
from omnistage.control.plan import plan
from omnistage.render import render_configmap, target_from
from omnistage.render.target import CONFIGMAP_LIMIT, configmap_bytes

from .test_plan import AT, cond, head, omnistage, replica


def with_overrides(size: int) -> dict:
    obj = omnistage(2)
    obj["spec"]["engine"]["stageOverrides"] = {"notes": "x" * size}
    return obj


def test_a_config_over_a_mebibyte_is_refused_naming_the_field_and_the_limit():
    with pytest.raises(InvalidSpec) as err:
        target_from(with_overrides(1_100_000))
    assert err.value.reason == Reason.CONFIG_TOO_LARGE
    [(field, message)] = err.value.problems
    assert field == "spec.engine.stageOverrides"
    assert f"{CONFIGMAP_LIMIT:,} bytes (1 MiB)" in message and "ConfigMap qwen3-omni-config" in message


def test_a_config_just_under_the_limit_renders():
    t = target_from(with_overrides(1_000_000))
    assert CONFIGMAP_LIMIT - 60_000 < configmap_bytes(render_configmap(t)) <= CONFIGMAP_LIMIT


def test_the_refusal_is_a_condition_and_an_event_and_touches_nothing_running():
    good = omnistage(2)
    t = target_from(good)
    obj = with_overrides(1_100_000)
    obj["status"] = copy.deepcopy(good["status"])
    try:
        decided = target_from(obj)
    except InvalidSpec as err:
        decided = err
    actions, status, _ = plan(decided, Observed(obj, head=head(t), replicas=(replica(t, 1),)), AT)
    assert [type(a) for a in actions] == [PostEvent]  # no child applied, no pod created or deleted
    assert (actions[0].type, actions[0].reason) == ("Warning", Reason.CONFIG_TOO_LARGE)
    for ctype in (Type.CONFIG_RENDERED, Type.READY):
        c = cond(status, ctype)
        assert (c["status"], c["reason"]) == ("False", Reason.CONFIG_TOO_LARGE)
        assert "spec.engine.stageOverrides" in c["message"] and "1,048,576 bytes" in c["message"]
