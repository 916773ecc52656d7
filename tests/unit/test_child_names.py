"""Names that leave room for their suffixes (issue 27, "every pass ends in a condition"): an OmniStage
or OmniStagePool name the children named after it cannot carry is refused, by the operator as by the
API server (tests/cluster/test_api.py), with the field and the maximum; every child rendered from
names at the maxima is one Kubernetes accepts, so the table in api/child_names.py holds what
render/ writes. Before this rule a 64-character pool name gave a PodDisruptionBudget whose
selector the API server refused, and every pass of the OmniStage failed."""

from __future__ import annotations

import copy
import re

import pytest
from omnistage.api.child_names import HASH, INDEX, MAX_OMNISTAGE_NAME, MAX_POOL_NAME
from omnistage.api.conditions import Reason, Type
from omnistage.api.validation import InvalidSpec, validate_omnistage
from omnistage.control.actions import CreatePod, EnsureChild
from omnistage.control.plan import plan
from omnistage.control.pools import parse
from omnistage.render import render_children, target_from
from omnistage.render.pods import render_head_pod, render_pool_pod, render_replica_pod

from .test_plan import AT, cond
from .test_plan_pools import STAGES, observe, pool_obj
from .test_validation import SAMPLE

# Kubernetes' own rules (k8s.io/apimachinery/pkg/util/validation).
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def named(name: str, **spec) -> dict:
    obj = copy.deepcopy(SAMPLE)
    obj["metadata"].update(name=name, namespace="serving", uid="ost-uid", generation=1)
    obj["spec"].update(spec)
    return obj


def refusal(name: str) -> str:
    with pytest.raises(InvalidSpec) as err:
        validate_omnistage(named(name))
    return dict(err.value.problems)["metadata.name"]


def test_the_longest_omnistage_name_passes_and_one_more_character_is_refused_naming_the_maximum():
    validate_omnistage(named("o" * MAX_OMNISTAGE_NAME))
    message = refusal("o" * (MAX_OMNISTAGE_NAME + 1))
    assert f"at most {MAX_OMNISTAGE_NAME} characters" in message and "NAME-replica-INDEX" in message


@pytest.mark.parametrize("name", ["1st-omni", "omni.v2", "omni-"])
def test_an_omnistage_name_its_service_cannot_carry_is_refused(name):
    assert "DNS-1035" in refusal(name)


def _problems(kind: str, name: str, labels: dict[str, str]) -> list[str]:
    out = []
    if kind == "Service" and not (len(name) <= 63 and DNS_1035.fullmatch(name)):
        out.append(f"Service name {name!r} is not a DNS-1035 label")
    if kind == "Pod" and len(name) > 63:
        out.append(f"pod {name!r}: its hostname would be cut")
    if not (len(name) <= 253 and DNS_SUBDOMAIN.fullmatch(name)):
        out.append(f"{kind} name {name!r} is not a DNS subdomain")
    out += [
        f"{kind} {name}: label {k}={v!r}"
        for k, v in labels.items()
        if len(v) > 63 or not LABEL_VALUE.fullmatch(v)
    ]
    return out


def _checked(obj: dict) -> list[str]:
    meta = obj["metadata"]
    selector = ((obj.get("spec") or {}).get("selector") or {})
    labels = {
        **meta.get("labels", {}),
        **selector.get("matchLabels", selector if obj["kind"] == "Service" else {}),
    }
    return _problems(obj["kind"], meta["name"], labels)


def test_every_child_of_names_at_the_maxima_is_one_kubernetes_accepts():
    obj = named("o" * MAX_OMNISTAGE_NAME, pipeline="qwen3_omni_moe", stages=copy.deepcopy(STAGES), replicas=3)
    t = target_from(obj)
    pool = parse(pool_obj(name="p" * MAX_POOL_NAME))
    children = render_children(t, "token", "127.0.0.1", "head-uid", [pool])
    longest = [render_replica_pod(t, int(INDEX), "127.0.0.1", "head-uid"),
               render_pool_pod(t, pool, int(INDEX), "127.0.0.1", "head-uid"),
               render_head_pod(t, name=f"{t.name}-head-{HASH}")]
    assert [p for child in children.all() + longest for p in _checked(child)] == []
    # The table's longest names are the rendered ones.
    assert {c["metadata"]["name"] for c in longest} == {
        f"{t.name}-replica-{INDEX}", f"{pool.name}-{INDEX}", f"{t.name}-head-{HASH}"}
    assert max(len(c["metadata"]["name"]) for c in longest) == 63


def test_a_pool_name_its_children_cannot_carry_is_refused_and_nothing_of_it_is_applied():
    obj = named("qwen3-omni", pipeline="qwen3_omni_moe", stages=copy.deepcopy(STAGES), replicas=1)
    obj["status"] = {}
    t = target_from(obj)
    long_pool = pool_obj(name="p" * 64)
    assert parse(pool_obj(name="p" * MAX_POOL_NAME)).name == "p" * MAX_POOL_NAME
    reason, message = parse(long_pool)
    assert reason == Reason.INVALID_SPEC
    assert message.startswith(f"metadata.name: metadata.name must be at most {MAX_POOL_NAME} characters")
    actions, status, pools = plan(t, observe(obj, t, pools=[long_pool], replicas=()), AT)
    # Every child the pass applies is one the API server accepts: no budget over a 64-character label.
    applied = [a.obj for a in actions if isinstance(a, EnsureChild | CreatePod)]
    assert [p for child in applied for p in _checked(child)] == []
    assert cond(status, Type.STAGES_COVERED)["status"] == "False"
    pool_ready = next(c for c in pools["p" * 64]["conditions"] if c["type"] == Type.READY)
    assert (pool_ready["reason"], pool_ready["status"]) == (Reason.INVALID_SPEC, "False")
    assert f"at most {MAX_POOL_NAME} characters" in pool_ready["message"]
