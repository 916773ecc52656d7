"""How long the name of an OmniStage or an OmniStagePool may be, and why.

The operator names children after them (NAME-master, NAME-replica-12, POOL-3...) and writes the
names into label values, and the API server refuses any of those past its limit: a 64-character
pool name would give a PodDisruptionBudget selector the API server refuses, and every pass of the
OmniStage would fail. This module is the one table of every name and label value derived
from either name, with its longest suffix and the limit Kubernetes puts on it; the longest name
allowed is the tightest row's. The CRDs refuse a longer name (a CEL rule on metadata.name, crd.py)
and so does the operator (validation.py; control/pools.py for a pool), with the same message.
A unit test renders every child of names at these maxima and holds each to Kubernetes' rules, so
a new child or a longer suffix in render/ fails it.

The same table says which names two objects of a namespace would both write (collisions): an
OmniStage named X-master would apply X's master Service, one named X-replica-3 the Secret of X's third
replica. control/collisions.py refuses the newer of the two.
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


# Where a derived name holds a pod index or a template hash (Derived.suffix).
INDEX_MARK, HASH_MARK = "{index}", "{hash}"


@dataclass(frozen=True)
class Derived:
    what: str  # the child or label, as the messages and docs name it
    suffix: str  # what follows the name in it, INDEX_MARK and HASH_MARK where they go ("" for the name)
    limit: int
    why: str
    kind: str | None = None  # the kind of object it names (names collide within a kind); None: a label

    @property
    def longest(self) -> str:
        return self.suffix.replace(INDEX_MARK, INDEX).replace(HASH_MARK, HASH)

    @property
    def room(self) -> int:
        """The longest name this row lets through."""
        return self.limit - len(self.longest)


OMNISTAGE_NAMES = (
    Derived("Service NAME (the OpenAI API)", "", LABEL, _SERVICE, "Service"),
    Derived("Service NAME-master", "-master", LABEL, _SERVICE, "Service"),
    Derived("labels app.kubernetes.io/instance and serving.omnistage.io/omnistage", "", LABEL, _LABEL_VALUE),
    Derived("head pod NAME-head", "-head", LABEL, _HOSTNAME, "Pod"),
    Derived("head pod NAME-head-HASH (a head change's successor)", f"-head-{HASH_MARK}", LABEL, _HOSTNAME,
            "Pod"),
    Derived("replica pod NAME-replica-INDEX", f"-replica-{INDEX_MARK}", LABEL, _HOSTNAME, "Pod"),
    Derived("ConfigMap NAME-config", "-config", SUBDOMAIN, _OBJECT, "ConfigMap"),
    Derived(f"Secret NAME-{MEMBERSHIP_SECRET}", f"-{MEMBERSHIP_SECRET}", SUBDOMAIN, _OBJECT, "Secret"),
    Derived(f"Secret NAME-replica-INDEX-{MEMBERSHIP_SECRET} (a replica's credential)",
            f"-replica-{INDEX_MARK}-{MEMBERSHIP_SECRET}", SUBDOMAIN, _OBJECT, "Secret"),
    Derived("NetworkPolicy NAME-head-engine", "-head-engine", SUBDOMAIN, _OBJECT, "NetworkPolicy"),
    Derived("PodDisruptionBudget NAME-replicas", "-replicas", SUBDOMAIN, _OBJECT, "PodDisruptionBudget"),
)

POOL_NAMES = (
    Derived(
        "label serving.omnistage.io/pool (the pool's pods, its PodDisruptionBudget's selector)",
        "",
        LABEL,
        _LABEL_VALUE,
    ),
    Derived("pool pod POOL-INDEX", f"-{INDEX_MARK}", LABEL, _HOSTNAME, "Pod"),
    Derived(f"Secret POOL-INDEX-{MEMBERSHIP_SECRET} (a pool pod's credential)",
            f"-{INDEX_MARK}-{MEMBERSHIP_SECRET}", SUBDOMAIN, _OBJECT, "Secret"),
    Derived("PodDisruptionBudget POOL-pool", "-pool", SUBDOMAIN, _OBJECT, "PodDisruptionBudget"),
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
            f"{d.what} ({len(d.longest)} characters more), must stay within {d.limit} ({d.why})"
            for d in tight
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


# ---- names two objects of a namespace would both write ---------------------------------------------
# Each derived name as one shape per length it can take: a set of characters per position. An index is
# a number without a leading zero, at most len(INDEX) digits (pods.free_indices gives the lowest free);
# a hash is len(HASH) hex digits. Two shapes of one length meet where every position shares a character.
_DIGITS, _HEX = frozenset("0123456789"), frozenset("0123456789abcdef")
Shape = tuple[frozenset[str], ...]


def _fixed(text: str) -> list[frozenset[str]]:
    return [frozenset(c) for c in text]


def _shapes(name: str, suffix: str) -> list[Shape]:
    if INDEX_MARK in suffix:
        pre, post = suffix.split(INDEX_MARK)
        fills = [[_DIGITS]] + [[_DIGITS - {"0"}] + [_DIGITS] * (n - 1) for n in range(2, len(INDEX) + 1)]
    elif HASH_MARK in suffix:
        pre, post = suffix.split(HASH_MARK)
        fills = [[_HEX] * len(HASH)]
    else:
        pre, post, fills = suffix, "", [[]]
    return [tuple(_fixed(name + pre) + fill + _fixed(post)) for fill in fills]


def _meet(a: Shape, b: Shape) -> str | None:
    """A name both shapes take (the smallest), or None."""
    if len(a) != len(b):
        return None
    common = [x & y for x, y in zip(a, b, strict=True)]
    return None if not all(common) else "".join(min(c) for c in common)


def may_collide(name: str, other: str) -> bool:
    """Whether children of these two names can meet at all: one name must begin the other (every
    derived name is the owner's name and a suffix)."""
    return name.startswith(other) or other.startswith(name)


def collisions(
    name: str, rows: tuple[Derived, ...], other: str, other_rows: tuple[Derived, ...]
) -> list[str]:
    """The objects ("Service x-master") that two objects of one namespace would both write: one named
    `name` whose children `rows` names (OMNISTAGE_NAMES or POOL_NAMES), the other `other` with
    `other_rows`. Empty when their children stay apart; only names one of which begins the other can
    meet (may_collide)."""
    if not may_collide(name, other) or (rows is other_rows and name == other):
        return []
    out = []
    for mine in rows:
        for theirs in other_rows:
            if mine.kind is None or mine.kind != theirs.kind:
                continue
            met = {w for a in _shapes(name, mine.suffix) for b in _shapes(other, theirs.suffix)
                   if (w := _meet(a, b)) is not None}
            if met:  # one example of a family (x-replica-0 for every x-replica-N)
                out.append(f"{mine.kind} {min(met, key=lambda w: (len(w), w))}")
    return out
