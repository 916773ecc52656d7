"""The engine plugin's helpers that need no vLLM: reading a wrapped method's argument where the
method declares it, and removing a replica's series from an orchestrator that has none."""

from __future__ import annotations

import logging
import types

from omnistage_engine_patches import _patching, metric_series


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
