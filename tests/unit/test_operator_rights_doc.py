"""docs/security.md says what the operator's own ServiceAccount may do (issue 27, item 8): every resource
of the install's ClusterRole has its row there, with each verb the manifests grant, so a right added to
manifests/base/rbac.yaml without saying why it cannot be narrower fails here."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RBAC = ROOT / "manifests" / "base" / "rbac.yaml"
DOC = ROOT / "docs" / "security.md"
# kopf's own discovery rights (CRDs, namespaces): cluster-scoped reads of no tenant's data.
KOPF = {"customresourcedefinitions", "namespaces"}


def _rights_table() -> dict[str, set[str]]:
    section = DOC.read_text().split("## The operator's own rights", 1)[1].split("\n## ", 1)[0]
    out: dict[str, set[str]] = {}
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        first = row.split("|")[1]
        # "`pods`: get, list; `pods/status`: patch" and "`configmaps`, `services`: list, watch"
        for names, verbs in re.findall(r"((?:`[^`]+`(?:, )?)+)(?:: ([a-z, ]+))?", first):
            for name in re.findall(r"`([^`]+)`", names):
                out.setdefault(name, set()).update(v.strip() for v in (verbs or "").split(",") if v.strip())
    return out


def test_every_right_of_the_cluster_role_is_in_the_security_model():
    role = next(d for d in yaml.safe_load_all(RBAC.read_text()) if d and d["kind"] == "ClusterRole")
    table = _rights_table()
    missing = []
    for rule in role["rules"]:
        for resource in rule["resources"]:
            if resource in KOPF:
                continue
            row = table.get(resource)
            if row is None:
                missing.append(f"{resource} has no row")
            elif row and set(rule["verbs"]) - row:
                missing.append(f"{resource}: {sorted(set(rule['verbs']) - row)} not said")
    assert missing == [], "docs/security.md#the-operators-own-rights: " + "; ".join(missing)
