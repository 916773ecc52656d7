"""The kinds of an OmniStage's children that the operator keeps as rendered, once: the informer watches
each (runtime/informer.py), the client applies each and knows its server's defaults (runtime/drift.py),
the decision ensures each with the fields it owns (control/children.py, with its renderer), and the
install's ClusterRole grants each (a unit test reads
manifests/base/rbac.yaml against this table). Pods and the membership Secret are not here: the
operator creates and deletes pods one by one, and reads and creates the Secret by name."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .conditions import EventReason


class _Assigned:
    """A value the API server assigns (a Service's clusterIP): any value is the server's."""

    def __repr__(self) -> str:
        return "ASSIGNED"


ASSIGNED = _Assigned()


def _port_of(item: dict[str, Any]) -> Any:
    return item.get("port")


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
    #: Owned fields that, once someone sets them, no write may undo: a ConfigMap made `immutable: true`
    #: refuses every later change, its `immutable` included, for good. drift.apply deletes such a
    #: child and creates it again (Kubernetes allows nothing else), so its kind needs `delete` too.
    frozen_by: tuple[str, ...] = ()
    #: The Event's reason when the operator created or restored one.
    synced_reason: str = EventReason.CHILD_SYNCED
    #: What the API server adds to one the operator renders: the field's path (a list's items "[]")
    #: -> its default, ASSIGNED (any value), or a function of the object holding it (a Service port's
    #: targetPort defaults to its port). Any other field the operator did not render is drift
    #: (runtime/drift.py), and so is one of these with another value: a Service made NodePort,
    #: sessionAffinity ClientIP, a selector or a NetworkPolicy peer with one more key
    #: (`namespaceSelector: {}` admits every namespace). Read from Kubernetes 1.36
    #: (tests/unit/test_kube.py holds its answers); a default a later server adds is restored once,
    #: then left (drift.UNRESTORABLE) and said in a Warning.
    server_defaults: Mapping[tuple[str, ...], Any] = field(default_factory=dict, hash=False)

    @property
    def verbs(self) -> frozenset[str]:
        """What the ClusterRole grants on it: the informer's and drift.apply's."""
        return CHILD_VERBS | ({"delete"} if self.frozen_by else set())


CHILD_KINDS = (
    ChildKind("ConfigMap", "", "configmaps", "config_map", ("data", "binaryData", "immutable"),
              frozen_by=("immutable",), synced_reason=EventReason.CONFIG_RENDERED),
    ChildKind("Service", "", "services", "service", ("spec",), server_defaults={
        ("spec", "type"): "ClusterIP", ("spec", "sessionAffinity"): "None",
        ("spec", "internalTrafficPolicy"): "Cluster",
        ("spec", "clusterIP"): ASSIGNED, ("spec", "clusterIPs"): ASSIGNED,
        ("spec", "ipFamilies"): ASSIGNED, ("spec", "ipFamilyPolicy"): ASSIGNED,
        ("spec", "ports", "[]", "protocol"): "TCP", ("spec", "ports", "[]", "targetPort"): _port_of,
    }),
    ChildKind("NetworkPolicy", "networking.k8s.io", "networkpolicies", "network_policy", ("spec",),
              server_defaults={
                  ("spec", "policyTypes"): ["Ingress"],
                  ("spec", "ingress", "[]", "ports", "[]", "protocol"): "TCP",
              }),
    ChildKind("PodDisruptionBudget", "policy", "poddisruptionbudgets", "pod_disruption_budget", ("spec",)),
)
BY_KIND = {c.kind: c for c in CHILD_KINDS}
#: The verbs each needs: the informer lists and watches, drift.apply creates a missing one and patches
#: one that differs (and deletes one frozen_by a field: ChildKind.verbs).
CHILD_VERBS = frozenset({"list", "watch", "create", "patch"})

#: Label and annotation prefixes Kubernetes reserves for its own components (`kubernetes.io/`,
#: `k8s.io/` and their subdomains): what those components act on. On a child, one the operator did
#: not render is its to remove (drift.drifted): `service.kubernetes.io/service-proxy-name` makes
#: kube-proxy drop a Service (an outage), `service.kubernetes.io/headless` likewise, and
#: `service.kubernetes.io/topology-mode` reroutes it. Other keys are others' (a team's cost label, a
#: ServiceMonitor's selector label): left, as are these two reserved ones that only describe:
#: `app.kubernetes.io/` (the recommended labels, which Helm and Argo CD write) and
#: `kubectl.kubernetes.io/` (kubectl's record of an apply).
RESERVED_DOMAINS = ("kubernetes.io", "k8s.io")
DESCRIPTIVE_DOMAINS = ("app.kubernetes.io", "kubectl.kubernetes.io")


def reserved_key(key: str) -> bool:
    """A label or annotation key in Kubernetes' own prefixes that is not merely descriptive."""
    domain, slash, _ = key.rpartition("/")
    domain = domain.lower()
    return bool(slash) and domain not in DESCRIPTIVE_DOMAINS and any(
        domain == d or domain.endswith("." + d) for d in RESERVED_DOMAINS)
