"""How long the name of an OmniStage or an OmniStagePool may be, and why.

The operator names children after them (NAME-master, NAME-replica-12, POOL-3...) and writes the
names into label values, and the API server refuses any of those past its limit: a 64-character
pool name once gave a PodDisruptionBudget selector the API server refused, and every pass of the
OmniStage failed (issue 27). This module is the one table of every name and label value derived
from either name, with its longest suffix and the limit Kubernetes puts on it; the longest name
allowed is the tightest row's. The CRDs refuse a longer name (a CEL rule on metadata.name, crd.py)
and so does the operator (validation.py; control/pools.py for a pool), with the same message.
A unit test renders every child of names at these maxima and holds each to Kubernetes' rules, so
a new child or a longer suffix in render/ fails it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ..names import MEMBERSHIP_SECRET

LABEL = 63  # a label value; a DNS label: a Service's name (DNS-1035), a pod's hostname
SUBDOMAIN = (
    253  # a DNS-1123 subdomain: the name of a ConfigMap, Secret, NetworkPolicy, PodDisruptionBudget, pod
)
# A pod index at its longest. Indices are the lowest free ones (control/pods.free_indices), so they stay
# below the pods alive at once: spec.replicas + rollout.maxSurge + those still draining (< 1,000).
INDEX = "9999"
HASH = "f" * 6  # a successor head's template-hash suffix (render/pods.head_pod_name)

_SERVICE = "a Service's name is a DNS-1035 label (at most 63 characters)"
_LABEL_VALUE = "a label value holds at most 63 characters"
# The kubelet makes a pod's hostname of its name cut at 63 characters: two pods could share one.
_HOSTNAME = "a pod's hostname is its name, which the kubelet cuts at 63 characters"
_OBJECT = "an object name is a DNS-1123 subdomain (at most 253 characters)"


@dataclass(frozen=True)
class Derived:
    what: str  # the child or label, as the messages and docs name it
    suffix: str  # what follows the name in it, at its longest ("" for the name itself)
    limit: int
    why: str

    @property
    def room(self) -> int:
        """The longest name this row lets through."""
        return self.limit - len(self.suffix)


OMNISTAGE_NAMES = (
    Derived("Service NAME (the OpenAI API)", "", LABEL, _SERVICE),
    Derived("Service NAME-master", "-master", LABEL, _SERVICE),
    Derived("labels app.kubernetes.io/instance and serving.omnistage.io/omnistage", "", LABEL, _LABEL_VALUE),
    Derived("head pod NAME-head-HASH (a head change's successor)", f"-head-{HASH}", LABEL, _HOSTNAME),
    Derived("replica pod NAME-replica-INDEX", f"-replica-{INDEX}", LABEL, _HOSTNAME),
    Derived("ConfigMap NAME-config", "-config", SUBDOMAIN, _OBJECT),
    Derived(f"Secret NAME-{MEMBERSHIP_SECRET}", f"-{MEMBERSHIP_SECRET}", SUBDOMAIN, _OBJECT),
    Derived("NetworkPolicy NAME-head-engine", "-head-engine", SUBDOMAIN, _OBJECT),
    Derived("PodDisruptionBudget NAME-replicas", "-replicas", SUBDOMAIN, _OBJECT),
)

POOL_NAMES = (
    Derived(
        "label serving.omnistage.io/pool (the pool's pods, its PodDisruptionBudget's selector)",
        "",
        LABEL,
        _LABEL_VALUE,
    ),
    Derived("pool pod POOL-INDEX", f"-{INDEX}", LABEL, _HOSTNAME),
    Derived("PodDisruptionBudget POOL-pool", "-pool", SUBDOMAIN, _OBJECT),
)

MAX_OMNISTAGE_NAME = min(d.room for d in OMNISTAGE_NAMES)
MAX_POOL_NAME = min(d.room for d in POOL_NAMES)

# The OmniStage's Service is named NAME: a DNS-1035 label (a letter first, no '.'), stricter than the
# DNS-1123 subdomain the API server asks of every custom resource's name. A pool's name appears only in
# pod and budget names (subdomains) and label values, which a subdomain of MAX_POOL_NAME fits.
DNS_1035 = "^[a-z]([-a-z0-9]*[a-z0-9])?$"


@dataclass(frozen=True)
class NameRule:
    cel: str  # on the object's root, where CEL sees metadata.name
    message: str
    holds: Callable[[str], bool]


def _longest(rows: tuple[Derived, ...], most: int, kind: str) -> str:
    tight = [d for d in rows if d.room == most]
    return (
        f"metadata.name must be at most {most} characters: the operator names the {kind}'s children after "
        "it, and the longest, "
        + "; ".join(
            f"{d.what} ({len(d.suffix)} characters more), must stay within {d.limit} ({d.why})" for d in tight
        )
        + "; choose a shorter name"
    )


OMNISTAGE_NAME_RULES = (
    NameRule(
        f"self.metadata.name.size() <= {MAX_OMNISTAGE_NAME}",
        _longest(OMNISTAGE_NAMES, MAX_OMNISTAGE_NAME, "OmniStage"),
        lambda name: len(name) <= MAX_OMNISTAGE_NAME,
    ),
    NameRule(
        f"self.metadata.name.matches('{DNS_1035}')",
        "metadata.name must start with a lowercase letter and hold only lowercase letters, digits and '-' "
        "(a DNS-1035 label, no '.'): the OmniStage's Service is named after it",
        lambda name: re.fullmatch(DNS_1035, name) is not None,
    ),
)

POOL_NAME_RULES = (
    NameRule(
        f"self.metadata.name.size() <= {MAX_POOL_NAME}",
        _longest(POOL_NAMES, MAX_POOL_NAME, "OmniStagePool"),
        lambda name: len(name) <= MAX_POOL_NAME,
    ),
)


def name_problems(name: str, rules: tuple[NameRule, ...]) -> list[tuple[str, str]]:
    """(field, message) of each rule the name breaks."""
    return [("metadata.name", r.message) for r in rules if not r.holds(name)]
