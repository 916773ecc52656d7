"""The cache-mode rule, every combination, with its documented outcome (DESIGN.md section 3)."""

import itertools

import pytest
from omnistage.api.cachemode import CacheModeRejected, resolve_cache_mode

REJECT = "rejected"
MEMBERSHIP_REPLICAS = [
    ("static", 1),
    ("static", 2),
    ("static", 8),
    ("dynamic", 1),
    ("dynamic", 2),
    ("dynamic", 8),
]
MODES = ["auto", "processor-only", "replica-aware", "lru", "shm", "disabled"]
KINDS = ["multimodal", "text-only"]

# Only a static single replica keeps a fixed membership: there a sender cache is safe.
STATIC_SINGLE = {
    "multimodal": {
        "auto": "lru",
        "processor-only": "processor-only",
        "replica-aware": "replica-aware",
        "lru": "lru",
        "shm": "shm",
        "disabled": "disabled",
    },
    "text-only": {
        "auto": "not-applicable",
        "processor-only": "not-applicable",
        "replica-aware": "not-applicable",
        "lru": "not-applicable",
        "shm": "not-applicable",
        "disabled": "not-applicable",
    },
}
# Everything else can gain or lose replicas: auto means processor-only (replica-aware stays opt-in
# until it has run on GPUs), replica-aware is allowed, sender caches are refused (for text-only
# models too: the spec is invalid whatever the model).
CHANGING = {
    "multimodal": {
        "auto": "processor-only",
        "processor-only": "processor-only",
        "replica-aware": "replica-aware",
        "lru": REJECT,
        "shm": REJECT,
        "disabled": "disabled",
    },
    "text-only": {
        "auto": "not-applicable",
        "processor-only": "not-applicable",
        "replica-aware": "not-applicable",
        "lru": REJECT,
        "shm": REJECT,
        "disabled": "not-applicable",
    },
}


def expected(membership, replicas, mode, kind):
    table = STATIC_SINGLE if (membership, replicas) == ("static", 1) else CHANGING
    return table[kind][mode]


CASES = list(itertools.product(MEMBERSHIP_REPLICAS, MODES, KINDS))


def test_table_covers_every_combination():
    assert len(CASES) == 2 * 3 * 6 * 2


@pytest.mark.parametrize(
    ("mr", "mode", "kind"), CASES, ids=lambda v: "-".join(map(str, v)) if isinstance(v, tuple) else v
)
def test_cache_mode(mr, mode, kind):
    membership, replicas = mr
    want = expected(membership, replicas, mode, kind)
    if want == REJECT:
        with pytest.raises(CacheModeRejected) as err:
            resolve_cache_mode(mode, membership, replicas, kind)
        assert "spec.cache.mode" in str(err.value) and "auto or processor-only" in str(err.value)
    else:
        decision = resolve_cache_mode(mode, membership, replicas, kind)
        assert decision.mode == want
        assert decision.reason


@pytest.mark.parametrize(("membership", "replicas"), MEMBERSHIP_REPLICAS)
@pytest.mark.parametrize("mode", ["auto", "processor-only", "replica-aware"])
def test_size_zero_is_disabled(membership, replicas, mode):
    """vLLM builds no cache of size 0, so the status must not promise processor-only or lru."""
    decision = resolve_cache_mode(mode, membership, replicas, "multimodal", size_gib=0)
    assert decision.mode == "disabled"
