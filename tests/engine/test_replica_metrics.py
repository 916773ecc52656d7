"""Defect 3: metric series follow stage-0 membership; the frontend multimodal cache is exported.

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU): the head's ``OmniMasterServer`` and
``OmniCoordinator`` (child process), the real ``Orchestrator`` on its own thread and loop with log
stats on (``OmniPrometheusStatLogger`` in prometheus_client's default registry), the real
``MembershipController`` (attach, DOWN / heartbeat-timeout detach) and ``StagePool``; replicas
register and heartbeat through vllm-omni's own client code (``register_stage_with_omni_master``,
``create_stage_coord_client``). The frontend test renders real chat requests with vllm-omni's
stage-0 input processor and renderer for a tiny Qwen2-VL checkpoint (config, tokenizer and
image-processor files, no weights; see tests/support/tiny_models.py).

Stood in (no GPU, no weights): the EngineCore processes. Each replica's head-side client is
``tests.standin.engine.StandinStageClient``, which emits real ``EngineCoreOutputs`` carrying a
``SchedulerStats`` every ``stats_interval`` seconds (or never, to model "before any traffic").
See ``tests/standin/__init__.py``.

Docstrings starting "Regression:" are the tests that fail when the patch is switched off:
    OMNISTAGE_DISABLE_PATCHES=replica_metrics pytest tests/engine/test_replica_metrics.py
    OMNISTAGE_DISABLE_PATCHES=mm_cache_metrics pytest tests/engine/test_replica_metrics.py
"Guard:" tests pin behaviour that must hold either way (they pass with the patch off).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import patches
from omnistage_engine_patches.membership_ops import LiveHead
from omnistage_engine_patches.patches import mm_cache_metrics, replica_metrics
from prometheus_client import REGISTRY

from tests.standin.engine import build_vllm_config, standin_head, wait_quietly
from tests.standin.replica import SimulatedReplica
from tests.support.engine_env import patch_applied
from tests.support.engine_stack import image_data_url
from tests.support.loopback import loopback_ip
from tests.support.tiny_models import build_config_only_model

pytestmark = pytest.mark.engine




@pytest.fixture(scope="module")
def text_config(tmp_path_factory):
    return build_vllm_config(build_config_only_model(tmp_path_factory.mktemp("standin-model")), "tiny")


def replica_samples(replica: str, stage: str = "0") -> dict[tuple[str, tuple], float]:
    """Every sample of the default registry labelled with this (stage, replica)."""
    out = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.labels.get("stage") == stage and s.labels.get("replica") == replica and not s.name.endswith(
                "_created"
            ):
                rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("stage", "replica")))
                out[(s.name, rest)] = s.value
    return out


def replica_label_values(prefix: str = "vllm:") -> set[str]:
    return {
        s.labels["replica"]
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name.startswith(prefix) and "replica" in s.labels
    }


def bookkeeping(engine: Any) -> dict[str, Any]:
    from vllm_omni.metrics import stat_logger as omni_stat_logger

    orch = engine.orchestrator
    sl = orch._stat_logger
    return {
        "orchestrator": dict(orch._stage_replica_to_engine_idx),
        "stat_logger": dict(sl.stage_replica_map),
        "global": dict(omni_stat_logger._ENGINE_INDEX_MAP),
        "engine_indexes": list(sl.engine_indexes),
        "labelvalues": dict(sl.per_engine_labelvalues),
        "table": dict(sl.gauge_scheduler_running),
    }


def join(engine: Any, ip: str, *, seen_up: bool = False) -> SimulatedReplica:
    replica = SimulatedReplica(engine._omni_master_address, engine._omni_master_port, ip).start()
    wait_quietly(f"replica {replica.replica_id}", lambda: replica.replica_id in engine.attached_replica_ids(),
                 10)
    # The pool lists the replica in the middle of the attach's step on the orchestrator's loop (the
    # patch registers its series right after, in the same step): a no-op on that loop waits it out.
    engine.on_loop(lambda: None)
    if seen_up:
        # vllm-omni's watcher detaches an attached replica only once it has seen it UP in the
        # coordinator's list (0.5 s ticks); a replica that vanishes before that stays attached
        # (an upstream race). A live replica has long been seen UP: wait for that state.
        controller = engine.orchestrator._membership
        addr = engine.stage0.clients[replica.replica_id].client_addresses["input_address"]
        wait_quietly("the watcher to see it UP", lambda: (0, addr) in controller._observed_up_attached_addrs,
                     10)
    return replica


def leave(engine: Any, replica_id: int, drain: float = 0.0) -> dict[str, Any]:
    return asyncio.run(LiveHead.locate(engine).leave(0, replica_id=replica_id, drain_timeout=drain))


# ---- series at join ------------------------------------------------------------------------


def test_series_exist_at_join_zero_valued_before_traffic(text_config):
    """Regression: A replica's series exist as soon as the head attaches it, before any stats tick."""
    with standin_head(text_config, loopback_ip(), stats_interval=None) as engine:  # no stats batch, ever
        local = replica_samples("0")
        assert len({name for name, _ in local}) > 30, "the head-local replica has the full vllm:* set"
        replica = join(engine, loopback_ip())
        rid = str(replica.replica_id)
        try:
            samples = replica_samples(rid)
            # The same families and extra labels (finish reasons, token sources, sleep states,
            # histogram buckets) as the replica that has been there since startup...
            assert set(samples) == set(local)
            # ...all zero, except the sleep-state gauge upstream sets to awake=1 at registration.
            nonzero = {k: v for k, v in samples.items() if v != 0}
            assert nonzero == {("vllm:engine_sleep_state", (("model_name", "tiny"), ("sleep_state", "awake"))): 1.0}
            assert engine.attached_replica_ids() == [0, replica.replica_id]
            assert all(c.stats_emitted == 0 for c in engine._runtime.remote_clients), "no traffic, no stats tick"
        finally:
            replica.down()


# ---- series after leave --------------------------------------------------------------------


@pytest.mark.parametrize("how", ["leave", "down", "heartbeat-timeout"])
def test_series_removed_when_replica_departs(text_config, how):
    """Regression: Every way a replica departs removes its series and its engine-idx bookkeeping; the
    remaining replicas keep theirs and keep recording."""
    # Replicas heartbeat every 5 s (vllm-omni's client), so a timeout must exceed that; 6 s keeps
    # the hard-kill case short.
    timeout = 6.0 if how == "heartbeat-timeout" else 30.0
    with standin_head(text_config, loopback_ip(), stats_interval=0.1, heartbeat_timeout=timeout) as engine:
        replica = join(engine, loopback_ip(), seen_up=True)
        rid = replica.replica_id
        wait_quietly("series of the new replica", lambda: replica_samples(str(rid)), 5)
        local_before = set(replica_samples("0"))
        if how == "leave":
            result = leave(engine, rid)
            assert result["detached"] and result["drained"] and result["metricsRegistered"] is False
            replica.down()
        elif how == "down":
            replica.down()  # graceful: the coordinator publishes it gone, the watcher detaches it
        else:
            # No DOWN: after the heartbeat timeout the head keeps it, silent (engine_liveness), until
            # the operator makes it leave (its pod is gone); that leave removes its series.
            replica.kill()
            controller = engine.orchestrator._membership
            wait_quietly(f"replica {rid} timed out",
                         lambda: any(rep.status == "error" for rep in controller._hub.get_replica_list().replicas),
                         15)
            assert rid in engine.attached_replica_ids()
            leave(engine, rid)
        wait_quietly(f"replica {rid} detached", lambda: rid not in engine.attached_replica_ids(), 15)
        wait_quietly(f"replica {rid}'s series removed", lambda: not replica_samples(str(rid)), 5)
        books = bookkeeping(engine)
        assert (0, rid) not in books["orchestrator"]
        assert ("0", str(rid)) not in books["stat_logger"].values()
        assert ("0", str(rid)) not in books["global"].values()
        assert len(books["engine_indexes"]) == len(books["labelvalues"]) == len(books["table"]) == 1
        assert set(replica_samples("0")) == local_before
        # The head-local replica still records: its gauge follows its stats batches.
        engine._runtime.stage_pools[0].clients[0].reported_running = 4
        wait_quietly("the local replica's gauge to update",
                     lambda: replica_samples("0").get(("vllm:num_requests_running", (("model_name", "tiny"),))) == 4,
                     5)


def test_late_stats_batch_from_departed_replica_does_not_resurrect_series(text_config):
    """Regression: A stats batch that was in flight when its replica was detached is dropped, not recorded
    under a new engine index (upstream would re-register the replica's series)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    with standin_head(text_config, loopback_ip(), stats_interval=None) as engine:
        replica = join(engine, loopback_ip())
        rid = replica.replica_id
        leave(engine, rid)
        replica.down()
        batch = EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats(num_running_reqs=7))
        engine.on_loop(lambda: engine.orchestrator._process_llm_stage_outputs(0, rid, batch, set()))
        assert replica_samples(str(rid)) == {}
        assert (0, rid) not in engine.orchestrator._stage_replica_to_engine_idx
        assert engine.is_alive()


def test_stats_batch_from_a_standby_does_not_resurrect_series(text_config):
    """Regression: a held replica (a standby from a scale-down) stays attached and keeps sending
    idle stats ticks; the hold removed its series, and a tick after that records nowhere (CI saw its
    zero-valued histograms come back between the hold and the next scrape). A join makes them again."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats

    with standin_head(text_config, loopback_ip(), stats_interval=None) as engine:
        replica = join(engine, loopback_ip())
        rid = replica.replica_id
        try:
            live = LiveHead.locate(engine)
            held = asyncio.run(live.hold(0, replica_id=rid, drain_timeout=0))
            assert held["held"] and held["metricsRegistered"] is False, held
            batch = EngineCoreOutputs(outputs=[], scheduler_stats=SchedulerStats(num_running_reqs=0))
            engine.on_loop(lambda: engine.orchestrator._process_llm_stage_outputs(0, rid, batch, set()))
            assert replica_samples(str(rid)) == {}
            assert (0, rid) not in engine.orchestrator._stage_replica_to_engine_idx
            assert rid in engine.attached_replica_ids()
            assert asyncio.run(live.join(0, "replica-b", replica.bind_ip))["held"] is False
            assert replica_samples(str(rid)), "a join makes the series again"
        finally:
            replica.down()


# ---- churn ---------------------------------------------------------------------------------


def test_churn_keeps_label_sets_bounded(text_config):
    """Regression: 50 join/leave cycles (replica ids are never reused) leave only the live
    replicas' series and bookkeeping, while stats are recorded for every attached replica."""
    cycles = 50
    # The legacy polling loop (VLLM_OMNI_EVENT_DRIVEN_ORCH off) reads a new replica at once; the
    # event-driven one only after its 0.5 s reader reconcile.
    with standin_head(text_config, loopback_ip(), stats_interval=0.01, event_driven=False) as engine:
        baseline = len(replica_samples("0"))
        started = time.monotonic()
        ids = []
        for _ in range(cycles):
            replica = join(engine, loopback_ip())
            ids.append(replica.replica_id)
            client = engine.stage0.clients[replica.replica_id]
            # Each replica serves its stats path before it leaves (so its series exist with or
            # without the patch: upstream registers them on the first stats tick).
            wait_quietly("a stats tick", lambda c=client: c.stats_emitted >= 2, 5)
            leave(engine, replica.replica_id)
            replica.down()
        elapsed = time.monotonic() - started
        assert ids == list(range(1, cycles + 1)), "ids are never reused: every cycle is a new label value"
        assert replica_label_values() == {"0"}
        assert sum(len(replica_samples(str(r))) for r in ids) == 0
        assert len(replica_samples("0")) == baseline
        books = bookkeeping(engine)
        assert list(books["orchestrator"]) == [(0, 0)]
        assert len(books["stat_logger"]) == len(books["global"]) == len(books["engine_indexes"]) == 1
        assert engine.is_alive()
        print(f"\n{cycles} join/leave cycles in {elapsed:.1f}s ({elapsed / cycles * 1000:.0f} ms per cycle)")


# ---- KeyError regression (late replicas, stats on) -------------------------------------------


def test_replicas_added_after_start_record_stats_without_error(text_config):
    """Guard: With stats on, replicas that join after startup (and after others left, so upstream's
    len()-based engine index would collide with a live one) get their stats recorded; the
    orchestrator's output processing never raises (0.29's KeyError (0, 1); a ValueError from a
    reused engine index)."""
    gauge = ("vllm:num_requests_running", (("model_name", "tiny"),))
    with standin_head(text_config, loopback_ip(), stats_interval=0.02) as engine:
        first = join(engine, loopback_ip())
        second = join(engine, loopback_ip())
        leave(engine, first.replica_id)
        first.down()
        third = join(engine, loopback_ip())  # joins after a departure
        clients = {c.replica_id: c for c in engine._runtime.remote_clients}
        for n, replica in ((5, second), (6, third)):
            clients[replica.replica_id].reported_running = n
        for n, replica in ((5, second), (6, third)):
            wait_quietly(f"replica {replica.replica_id}'s stats to be recorded",
                         lambda n=n, r=replica: replica_samples(str(r.replica_id)).get(gauge) == n,
                         10)
        idx = engine.orchestrator._stage_replica_to_engine_idx
        assert len(set(idx.values())) == len(idx), "one engine index per live replica"
        assert engine.is_alive(), "the orchestrator thread survived every stats tick"
        second.down()
        third.down()


# ---- the frontend multimodal cache ---------------------------------------------------------


def _chat(image: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_url(image)}},
        {"type": "text", "text": "describe the image"},
    ]}]


def test_frontend_mm_cache_hits_and_queries(make_vllm_config):
    """Regression: The stage-0 frontend renderer's cache statistics reach vllm:mm_cache_queries/hits
    (``{stage="0", replica="frontend"}``): zero from startup, then what the chat route did."""
    from vllm.renderers.params import ChatParams
    from vllm_omni.engine.stage_init_utils import build_stage0_input_processor

    vllm_config = make_vllm_config("multimodal", served_model_name="tiny-vl")
    input_processor = build_stage0_input_processor(vllm_config)
    renderer = input_processor.renderer
    assert renderer.mm_processor_cache is not None
    labels = {"model_name": "tiny-vl", "stage": "0", "replica": "frontend"}

    def value(name: str) -> float | None:
        return REGISTRY.get_sample_value(name, labels)

    with standin_head(vllm_config, loopback_ip(), stats_interval=0.02, input_processor=input_processor):
        assert value("vllm:mm_cache_queries_total") == 0.0
        assert value("vllm:mm_cache_hits_total") == 0.0
        for image in (1, 1, 2, 1):  # the chat route: the frontend cache is consulted per item
            asyncio.run(renderer.render_chat_async([_chat(image)], ChatParams()))
        wait_quietly("frontend queries to be exported", lambda: value("vllm:mm_cache_queries_total") == 4.0,
                     10)
        assert value("vllm:mm_cache_hits_total") == 2.0
        # Per-replica mm cache series stay what vLLM records for them (nothing, under omni).
        assert REGISTRY.get_sample_value("vllm:mm_cache_queries_total", {**labels, "replica": "0"}) == 0.0


def test_text_only_frontend_gets_no_frontend_series(text_config):
    """Guard: A head without a multimodal frontend cache exports no frontend series (nothing to count)."""
    with standin_head(text_config, loopback_ip(), stats_interval=0.02):
        time.sleep(0.2)  # several stats ticks
        assert "frontend" not in replica_label_values()


# ---- the patches' own safety ---------------------------------------------------------------


def _targets() -> dict[str, Any]:
    from vllm_omni.engine.membership_controller import MembershipController
    from vllm_omni.engine.omni_engine_base import OmniEngineBase
    from vllm_omni.engine.orchestrator import OrchestratorBase
    from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

    return {
        "init": OrchestratorBase._init_metrics_state,
        "process": OrchestratorBase._process_llm_stage_outputs,
        "removed": OrchestratorBase._remove_stage_replica_waiting,
        "do_register": MembershipController._do_register,
        "record": OmniPrometheusStatLogger.record,
        "bootstrap": OmniEngineBase._bootstrap_orchestrator,
    }


def test_applying_twice_is_harmless(engine_patches):
    """Guard: applying again (even bypassing the outcome cache) adds no second wrapper."""
    if not (patch_applied(replica_metrics.NAME) and patch_applied(mm_cache_metrics.NAME)):
        pytest.skip("the patches are switched off in this run (OMNISTAGE_DISABLE_PATCHES)")
    before = _targets()
    outcomes = [patches.BY_NAME[n].apply() for n in (replica_metrics.NAME, mm_cache_metrics.NAME)]
    assert [o.name for o in outcomes] == [replica_metrics.NAME, mm_cache_metrics.NAME]
    # Even with the outcome cache bypassed, an install sees its own wrappers and changes nothing.
    assert replica_metrics.install() is None
    assert mm_cache_metrics.install() is None
    assert _targets() == before


def test_upstream_fix_makes_it_a_no_op(monkeypatch):
    """Guard: upstream shipping series removal turns the patch into a logged no-op, untouched."""
    from vllm_omni.metrics.stat_logger import OmniPrometheusStatLogger

    monkeypatch.setattr(OmniPrometheusStatLogger, "unregister_replica", lambda self, idx: None, raising=False)
    before = _targets()
    reason = replica_metrics.install()
    assert reason and "upstream" in reason
    assert _targets() == before


def test_changed_shape_makes_it_a_no_op(monkeypatch):
    """Guard: a target with another shape turns the patch into a logged no-op, nothing wrapped."""
    from vllm_omni.engine.orchestrator import OrchestratorBase

    def renamed(self, stage, replica):  # the callback took other parameter names upstream
        return None

    monkeypatch.setattr(OrchestratorBase, "_remove_stage_replica_waiting", renamed)
    before = _targets()
    reason = replica_metrics.install()
    assert reason and "changed shape" in reason
    assert _targets() == before
