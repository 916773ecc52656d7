"""The engine plugin's helpers that need no vLLM: reading a wrapped method's argument where the
method declares it, the shape checks and wrappers, removing a replica's series from an orchestrator
that has none, and the endpoint's answer without the membership patch."""

from __future__ import annotations

import logging
import types

import pytest
from omnistage_engine_patches import _patching, metric_series
from omnistage_engine_patches.membership_ops import LiveHead, MembershipError


class StatLogger:
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        return engine_idx


def test_an_argument_is_read_at_the_position_the_method_declares():
    read = _patching.argument(StatLogger.record, "engine_idx")
    assert read(("s", "i", None, 3), {}) == 3  # positional: the fourth after self
    assert read(("s", "i"), {"engine_idx": 5}) == 5
    assert read(("s", "i"), {}) == 0  # not passed: the method's default


def test_a_moved_argument_is_followed_not_guessed():
    """vLLM moving engine_idx (a new parameter before it) must not misroute batches."""
    class Moved:
        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, extra=None, engine_idx=0):
            return engine_idx

    assert _patching.argument(Moved.record, "engine_idx")(("s", "i", None, "x", 7), {}) == 7


def test_an_argument_that_cannot_be_read_safely_is_a_changed_shape():
    class KeywordOnly:
        def record(self, scheduler_stats, *, engine_idx=0):
            return engine_idx

    class NoDefault:
        def record(self, scheduler_stats, engine_idx):
            return engine_idx

    class Gone:
        def record(self, scheduler_stats):
            return None

    for cls in (KeywordOnly, NoDefault, Gone):
        assert _patching.argument(cls.record, "engine_idx") is None, cls.__name__


def test_no_engine_idx_map_means_nothing_to_remove(caplog):
    """An orchestrator built without _init_metrics_state (vllm-omni's own tests, stats off) has no
    _stage_replica_to_engine_idx: removing a replica's series is a no-op, not an ERROR traceback."""
    orch = types.SimpleNamespace(_stat_logger=None)
    with caplog.at_level(logging.INFO):
        assert metric_series.remove_replica_series(orch, 0, 1) == 0
        assert not metric_series.series_registered(types.SimpleNamespace(_stat_logger=object()), 0, 1)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class Upstream:
    def method(self, stage_id, replica_id):
        return ("method", stage_id, replica_id)

    async def run(self):
        return "ran"


def test_a_shape_check_names_the_first_target_that_does_not_fit():
    fits = _patching.Target(Upstream, "method", ("self", "stage_id", "replica_id"))
    assert _patching.shape_problem(fits, _patching.Target(Upstream, "run", ("self",), coroutine=True)) is None
    assert _patching.shape_problem(fits, _patching.Target(Upstream, "gone")) == \
        "target changed shape: Upstream.gone is missing"
    assert _patching.shape_problem(_patching.Target(Upstream, "method", ("self", "stage"), more=True)) == \
        "target changed shape: Upstream.method(self, stage, ...)"
    assert _patching.shape_problem(_patching.Target(Upstream, "method", ("self", "stage_id", "replica_id"),
                                                    coroutine=True)) == \
        "target changed shape: async Upstream.method(self, stage_id, replica_id)"


def test_a_wrapper_gets_the_original_keeps_its_signature_and_is_marked(monkeypatch):
    class Owner(Upstream):
        pass

    @_patching.wrap(Owner, "method", "p")
    def method(orig, self, stage_id, replica_id):
        return ("wrapped", *orig(self, stage_id, replica_id))

    @_patching.wrap(Owner, "run", "p")
    async def run(orig, self):
        return "wrapped " + await orig(self)

    import asyncio
    import inspect

    assert Owner().method(0, 1) == ("wrapped", "method", 0, 1)
    assert asyncio.run(Owner().run()) == "wrapped ran"
    assert inspect.iscoroutinefunction(Owner.run)
    assert list(inspect.signature(Owner.method).parameters) == ["self", "stage_id", "replica_id"]
    assert _patching.ours("p", _patching.Target(Owner, "method")) and not _patching.ours(
        "q", _patching.Target(Owner, "run")
    )


def test_the_stashed_names_are_listed_once():
    assert len(set(_patching.STASHED)) == len(_patching.STASHED)
    assert all(name.startswith("_omnistage_") for name in _patching.STASHED)


def test_without_the_membership_patch_the_endpoint_says_so(monkeypatch):
    """The endpoint's answer when the patch is not active in this process: 503 naming it. (`make test`
    runs the engine tier first, in the same process, and that applies the patch: switch it off here.)"""
    from omnistage_engine_patches.patches import membership

    monkeypatch.setattr(membership, "enabled", lambda: False)
    with pytest.raises(MembershipError) as err:
        LiveHead.locate(object())
    assert err.value.status == 503 and "'membership' is not active" in err.value.message


def test_the_join_and_leave_bodies_are_the_contracts_on_both_sides():
    """The operator writes contract.JoinRequest/LeaveRequest; the endpoint's models read exactly those
    keys."""
    pytest.importorskip("fastapi", reason="the endpoint needs fastapi (it comes with vLLM)")
    import typing

    from omnistage_engine_patches import contract, membership_requests

    for model, shape in ((membership_requests.JoinBody, contract.JoinRequest),
                         (membership_requests.LeaveBody, contract.LeaveRequest)):
        keys = {f.alias or name for name, f in model.model_fields.items()}
        assert keys == set(typing.get_type_hints(shape)), model.__name__
