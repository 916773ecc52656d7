"""Names another object of the namespace needs (issue 40 item 10): an OmniStage named X-master took
over X's master Service (its own OpenAI Service), one named X-replica-3 created X-replica-3-membership
and X's scale to 4 never landed. The table of derived names (api/child_names.py) says which names two
objects would both write; the decision (control/collisions.py, through plan) refuses the newer one with
a condition and an Event naming both, and the runtime does so before it writes anything, the membership
Secret included. Before, nothing compared two objects' names: every refusal below was a pass that applied
the other object's children (the decision tests fail with the previous code). The cluster tier does it on
an API server: tests/cluster/test_name_collisions.py."""

from __future__ import annotations

import copy

import pytest
from omnistage import api
from omnistage.api.child_names import OMNISTAGE_NAMES, POOL_NAMES, collisions
from omnistage.api.conditions import Reason, Type
from omnistage.control.actions import CreatePod, EnsureChild, Observed, PostEvent
from omnistage.control.collisions import Named
from omnistage.control.plan import plan
from omnistage.control.pools import parse
from omnistage.render import render_children, target_from
from omnistage.render.network import render_pod_credential
from omnistage.render.pods import render_head_pod, render_pool_pod, render_replica_pod
from omnistage.runtime import reconcile as reconcile_module
from omnistage.runtime.act import Acted

from .test_plan import AT, cond, omnistage
from .test_plan_pools import STAGES, observe, pool_obj

O, P = OMNISTAGE_NAMES, POOL_NAMES
EARLY, LATE = "2026-11-01T00:00:00Z", "2026-11-02T00:00:00Z"


@pytest.mark.parametrize(("a", "rows", "b", "other_rows", "shared"), [
    ("x", O, "x-master", O, ["Service x-master"]),  # x's master Service is x-master's OpenAI Service
    ("x", O, "x-replica-3", O, ["Secret x-replica-3-membership"]),  # x's replica 3's credential
    ("x", O, "x-replica", P, ["Pod x-replica-0", "Secret x-replica-0-membership"]),  # a pool's pods
    ("p", P, "p-0", O, ["Secret p-0-membership"]),  # pool pod p-0's credential
    ("x", O, "x-head", O, []),  # x-head-head, x-head-replica-N: x's successor heads end in 6 hex
    ("x", O, "x-replica-03", O, []),  # no index has a leading zero
    ("x", O, "x", P, []),  # a pool may share its OmniStage's name
    ("x", O, "x-head", P, []),  # pool pods x-head-N: at most 4 digits, a hash is 6
    ("x", O, "x-head-engine", O, []),
    ("x", O, "x-replicas", O, []),  # a Service and a PodDisruptionBudget: two kinds
    ("x", O, "x-config", O, []),
    ("p", P, "p-1", P, []),
    ("x", O, "y-master", O, []),
])
def test_the_names_two_objects_would_both_write(a, rows, b, other_rows, shared):
    assert collisions(a, rows, b, other_rows) == shared
    assert sorted(collisions(b, other_rows, a, rows)) == sorted(shared), "the same both ways"


def test_the_table_holds_every_name_the_operator_renders():
    """Every child rendered for an OmniStage and its pool is one the table knows, of the kind it says,
    and every row names something rendered: collisions compares what render/ writes."""
    from omnistage.api.child_names import _meet, _shapes

    obj = omnistage(3, pipeline="qwen3_omni_moe", stages=copy.deepcopy(STAGES))
    obj["metadata"]["name"] = "x"
    t = target_from(obj)
    pool = parse(pool_obj(name="p"))
    replica = render_replica_pod(t, 12, "127.0.0.1", "u")
    pool_pod = render_pool_pod(t, pool, 7, "127.0.0.1", "u")
    rendered = [*render_children(t, "token", "127.0.0.1", "u", [pool]).all(), render_head_pod(t),
                render_head_pod(t, name=f"x-head-{'0a1b2c'}"), replica, pool_pod,
                render_pod_credential(replica, "token"), render_pod_credential(pool_pod, "token")]
    used = set()
    for child in rendered:
        kind, name = child["kind"], child["metadata"]["name"]
        owner, rows = ("p", P) if name.startswith("p-") else ("x", O)
        rows_met = [r for r in rows if r.kind == kind
                    and any(_meet(s, tuple(frozenset(c) for c in name)) for s in _shapes(owner, r.suffix))]
        assert rows_met, f"{kind} {name} is in no row of the table"
        used.update(rows_met)
    assert {r for r in (*O, *P) if r.kind} == used, "a row names nothing the operator renders"


# ---- the decision: the newer object is refused, the older goes on ---------------------------------------

def named(name, created=EARLY):
    return Named(created, api.KIND, name)


def stage(name, created):
    obj = omnistage(2)
    obj["metadata"].update(name=name, creationTimestamp=created)
    obj["status"] = {}
    return obj, target_from(obj)


def test_the_newer_omnistage_is_refused_naming_both_and_writes_nothing():
    obj, t = stage("x-master", LATE)
    actions, status, _ = plan(t, Observed(obj, neighbours=(named("x"),)), AT)
    assert [type(a) for a in actions] == [PostEvent]
    [event] = actions
    assert (event.type, event.reason) == ("Warning", Reason.NAME_COLLISION)
    for ctype in (Type.READY, Type.CONFIG_RENDERED):
        c = cond(status, ctype)
        assert (c["status"], c["reason"]) == ("False", Reason.NAME_COLLISION)
    message = cond(status, Type.READY)["message"]
    assert message.startswith("metadata.name: OmniStage x-master would write Service x-master, which the "
                              "older OmniStage x writes")
    assert "create it under another name" in message and event.message == message


def test_the_older_omnistage_goes_on():
    obj, t = stage("x", EARLY)
    actions, status, _ = plan(t, Observed(obj, neighbours=(named("x-master", LATE),)), AT)
    assert "x-master" in {a.obj["metadata"]["name"] for a in actions if isinstance(a, EnsureChild)}
    assert any(isinstance(a, CreatePod) for a in actions)
    assert cond(status, Type.CONFIG_RENDERED)["reason"] != Reason.NAME_COLLISION


def test_a_replica_name_is_refused_too():
    obj, t = stage("x-replica-3", LATE)
    _, status, _ = plan(t, Observed(obj, neighbours=(named("x"),)), AT)
    assert "Secret x-replica-3-membership" in cond(status, Type.READY)["message"]


def test_a_same_second_tie_is_decided_one_way():
    """Creation times have one-second resolution: kind and name then decide, the same from both sides."""
    a, ta = stage("x", EARLY)
    b, tb = stage("x-master", EARLY)
    refused_a = cond(plan(ta, Observed(a, neighbours=(named("x-master"),)), AT)[1], Type.READY)["reason"]
    refused_b = cond(plan(tb, Observed(b, neighbours=(named("x"),)), AT)[1], Type.READY)["reason"]
    assert sorted([refused_a == Reason.NAME_COLLISION, refused_b == Reason.NAME_COLLISION]) == [False, True]


def test_a_pool_that_would_make_its_omnistages_replica_pods_is_refused_and_runs_nothing():
    obj = omnistage(2, pipeline="qwen3_omni_moe", stages=copy.deepcopy(STAGES))
    obj["metadata"]["creationTimestamp"] = EARLY
    t = target_from(obj)
    pool = pool_obj(name="qwen3-omni-replica", created=LATE)
    o = observe(obj, t, pools=[pool], neighbours=(Named(LATE, api.POOL_KIND, "qwen3-omni-replica"),))
    actions, status, pools = plan(t, o, AT)
    assert not [a for a in actions if isinstance(a, CreatePod) and a.obj["metadata"]["name"].startswith(
        "qwen3-omni-replica-") and a.obj["metadata"]["labels"].get("serving.omnistage.io/pool")]
    ready = next(c for c in pools["qwen3-omni-replica"]["conditions"] if c["type"] == Type.READY)
    assert (ready["status"], ready["reason"]) == ("False", Reason.NAME_COLLISION)
    assert "Pod qwen3-omni-replica-0" in ready["message"]
    assert "the older OmniStage qwen3-omni" in ready["message"]
    assert cond(status, Type.STAGES_COVERED)["status"] == "False"


# ---- the runtime: the refusal comes before the membership Secret ----------------------------------------

class _Informer:
    def __init__(self, objs):
        self.objs = objs

    def all(self):
        return list(self.objs)

    def owned(self, namespace, name):
        return [o for o in self.objs if (o.get("spec") or {}).get("omniStage") == name]


class _State:
    def __init__(self, omnistages, pools=()):
        self.omnistages, self.pools = _Informer(omnistages), _Informer(pools)


def test_the_runtime_refuses_before_it_writes_the_membership_secret(monkeypatch):
    older, _ = stage("x", EARLY)
    newer, _ = stage("x-replica-3", LATE)
    other_namespace, _ = stage("x-master", EARLY)
    other_namespace["metadata"]["namespace"] = "elsewhere"
    monkeypatch.setattr(reconcile_module, "STATE", _State([older, newer, other_namespace]))

    def no_token(*a, **kw):
        raise AssertionError("the membership Secret was read or written")

    monkeypatch.setattr(reconcile_module, "ensure_token", no_token)
    acted = []
    monkeypatch.setattr(reconcile_module.act_step, "act", 
                        lambda ns, actions, *a, **kw: acted.extend(actions) or Acted([], []))
    status = reconcile_module._reconcile(newer, lambda *e: None)
    assert [a.reason for a in acted] == [Reason.NAME_COLLISION]
    assert cond(status, Type.READY)["reason"] == Reason.NAME_COLLISION
    assert reconcile_module._neighbours(newer) == (Named(EARLY, api.KIND, "x"),)
    assert reconcile_module._neighbours(other_namespace) == ()
