"""One concept, one table: what several layers need to agree on is written once, and these tests find
a second spelling in the product code, or run the code that must read the table."""

from __future__ import annotations

import re

from tests.support.repo import ROOT, SAMPLE

OPERATOR = ROOT / "operator" / "omnistage"


def _sources(root=OPERATOR):
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(root.rglob("*.py"))}


def test_replica_pods_are_worked_out_once():
    """spec.replicas counts engine pods, head included: Target.replica_pods says how many of them are
    replica pods, and nothing else subtracts the head again."""
    again = re.compile(r"spec\.replicas\s*-\s*1|range\(1,\s*[\w.]*spec\.replicas\)")
    found = [path for path, text in _sources().items()
             if again.search(text) and path != "operator/omnistage/render/common.py"]
    assert found == []


def test_the_cache_modes_are_the_contracts_table():
    """contract.CACHE_MODES is the one table of cache modes: the operator's enums name exactly its rows
    (spec.cache.mode adds auto and leaves out not-applicable, which only text-only models get), and the
    CRD's CEL rule lists exactly its sender modes."""
    from omnistage.api import CacheMode, EffectiveCacheMode
    from omnistage.api.validation import SPEC_RULES
    from omnistage_engine_patches import contract

    assert [str(m) for m in EffectiveCacheMode] == list(contract.CACHE_MODES)
    assert {str(m) for m in CacheMode} == {"auto", *contract.CACHE_MODES} - {contract.CACHE_NOT_APPLICABLE}
    assert contract.SENDER_CACHE_MODES == (contract.CACHE_LRU, contract.CACHE_SHM)
    (rule,) = [r for r in SPEC_RULES if r.field == ".cache.mode"]
    assert "self.cache.mode in ['lru', 'shm']" in rule.cel


def test_every_child_kind_is_granted_watched_applied_and_ensured():
    """api/child_kinds.CHILD_KINDS is the one list of child kinds: the install's ClusterRole grants each
    what the informer and drift.apply do with it, the informer watches exactly these, and the decision
    ensures exactly these, each compared on the fields the table says it owns."""
    import copy

    import yaml
    from omnistage.api.child_kinds import BY_KIND, CHILD_KINDS
    from omnistage.control.actions import EnsureChild, Observed
    from omnistage.control.plan import plan
    from omnistage.render import target_from
    from omnistage.render.children import RENDERERS
    from omnistage.runtime.informer import ClusterState

    role = next(d for d in yaml.safe_load_all((ROOT / "manifests/base/rbac.yaml").read_text())
                if d and d["kind"] == "ClusterRole")
    for c in CHILD_KINDS:
        granted = {v for r in role["rules"] if c.group in r["apiGroups"] and c.plural in r["resources"]
                   for v in r["verbs"]}
        assert c.verbs <= granted, f"{c.plural}: the ClusterRole grants {sorted(granted)}"
    assert list(ClusterState().children) == [c.kind for c in CHILD_KINDS]
    assert list(RENDERERS) == [c.kind for c in CHILD_KINDS]  # each kind renders beside its row
    obj = copy.deepcopy(SAMPLE)
    obj["metadata"].update(namespace="serving", uid="ost-uid", generation=1)
    ensured = [a for a in plan(target_from(obj), Observed(obj=obj)).actions if isinstance(a, EnsureChild)]
    assert {a.obj["kind"] for a in ensured} == set(BY_KIND)
    assert [a.compare for a in ensured] == [BY_KIND[a.obj["kind"]].owned_fields for a in ensured]
    assert [a.reason for a in ensured] == [BY_KIND[a.obj["kind"]].synced_reason for a in ensured]
