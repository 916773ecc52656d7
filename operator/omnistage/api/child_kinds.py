"""The kinds of an OmniStage's children that the operator keeps as rendered, once: the informer watches
each (runtime/informer.py), the client applies each (runtime/drift.py), the plan ensures each with the
fields it owns (control/plan.py), and the install's ClusterRole grants each (a unit test reads
manifests/base/rbac.yaml against this table). Pods and the membership Secret are not here: the
operator creates and deletes pods one by one, and reads and creates the Secret by name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChildKind:
    kind: str
    #: The API group ("" for core/v1); runtime/kube.py maps it to the kubernetes client's API class.
    group: str
    #: The resource name, as RBAC and the API paths spell it.
    plural: str
    #: The kubernetes client's snake-case name of the kind (list_namespaced_<it>, patch_namespaced_<it>).
    client_name: str
    #: The fields the operator owns whole: compared by runtime/drift.drifted, restored when they drift
    #: (a key someone added to a spec is drift too).
    owned_fields: tuple[str, ...]


CHILD_KINDS = (
    ChildKind("ConfigMap", "", "configmaps", "config_map", ("data", "binaryData")),
    ChildKind("Service", "", "services", "service", ("spec",)),
    ChildKind("NetworkPolicy", "networking.k8s.io", "networkpolicies", "network_policy", ("spec",)),
    ChildKind("PodDisruptionBudget", "policy", "poddisruptionbudgets", "pod_disruption_budget", ("spec",)),
)
BY_KIND = {c.kind: c for c in CHILD_KINDS}
#: The verbs each needs: the informer lists and watches, drift.apply creates a missing one and patches
#: one that differs.
CHILD_VERBS = frozenset({"list", "watch", "create", "patch"})
