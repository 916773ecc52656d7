"""Patch ``registration_report``: headless replicas send their patch outcomes with their
registration, and the head lists them per member (``"patches"`` in the membership listing).

Real here (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU, this project's patches loaded through vLLM's
plugin loader by conftest's ``engine_patches``): a three-stage head's startup (``OmniMasterServer``
with a pre-allocated slot per stage, the stage-init wait ``_initialize_remote_replica`` that unblocks
on a registration with a stage config), dynamic attach through ``on_register`` →
``MembershipController``, the listing (``membership_ops.LiveHead``, what the endpoint serves). Each
replica registers from its own loopback pod IP through vllm-omni's own
``register_stage_with_omni_master`` looked up on ``stage_engine_startup`` at call time, as the
headless launchers (``launch_headless_llm_replica``) do, so the call goes through whatever the
plugin put there. The registering process is this test process: the outcomes a replica sends are
this process's.

Stood in (``tests/standin/multistage.py``): stage planning and the EngineCore processes; the
head-local stage-0 replica registers through the stand-in's import-time binding, as the head's own
``_launch_omni_core_engines`` registers with its planned replica id (never reported either way).

Negative control: the tests marked "regression" fail with the patch off (no member then has
``"patches"``; ``test_without_the_patch_no_member_reports`` runs only in that run and checks it):
    OMNISTAGE_DISABLE_PATCHES=registration_report pytest tests/engine/test_registration_report.py
``test_the_head_attaches_every_reporting_replica`` passes either way (the extra key is harmless, and
it is absent in the disabled run). The unit tests of the wrapper install it under their own label
and pass either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import _patching, contract
from omnistage_engine_patches.membership_ops import LiveHead
from omnistage_engine_patches.patches import registration_report
from vllm_omni.engine import stage_engine_startup

from tests.standin.engine import StandinEngineClient, wait_quietly
from tests.standin.multistage import (
    MultiStageOptions,
    PipelineHead,
    StageReplica,
    qwen3_omni_like,
    stage_vllm_config,
)
from tests.support.engine_env import patch_applied
from tests.support.loopback import loopback_ip
from tests.support.tiny_models import build_config_only_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A three-stage head whose initial stage-1 and stage-2 slots were filled by headless
    replicas, plus one dynamic replica of stage 0 and of stage 1, each attached and UP."""
    model_dir = build_config_only_model(tmp_path_factory.mktemp("registration-report-model"))
    specs = qwen3_omni_like()
    options = MultiStageOptions(specs, [stage_vllm_config(model_dir, s, len(specs), async_chunk=False) for s in specs])
    pipeline = PipelineHead(options, loopback_ip()).start()
    try:
        for stage_id in (1, 2):  # the initial slots: the head's startup waits for these
            replica = StageReplica(pipeline.bind_ip, pipeline.master_port, loopback_ip(), stage_id=stage_id)
            pipeline.replicas.append(replica.register().up())
        engine = pipeline.wait_started(120)
        for stage_id in (0, 1):  # dynamic: auto-assigned past the planned slots, attached by on_register
            replica = StageReplica(pipeline.bind_ip, pipeline.master_port, loopback_ip(), stage_id=stage_id)
            pipeline.replicas.append(replica.register().up())
            rid = replica.replica_id
            wait_quietly(f"stage {stage_id} replica {rid} attach",
                         lambda s=stage_id, r=rid: r in engine.attached_replica_ids(s),
                         15)
        # UP reaches the head's hub through the coordinator a moment after each replica sent it.
        wait_quietly("every replica UP at the head",
                     lambda: all(m["coordinatorStatus"] == "up" for m in members(pipeline).values()),
                     15)
        yield pipeline
    finally:
        pipeline.stop()


def members(pipeline: PipelineHead) -> dict[tuple[int, int], dict[str, Any]]:
    body = asyncio.run(LiveHead.locate(StandinEngineClient(pipeline.engine)).snapshot())
    return {(m["stage"], m["replicaId"]): m for ms in body["stages"].values() for m in ms}


REPORTING = [(1, 0), (2, 0), (0, 1), (1, 1)]  # the initial slots of stages 1, 2; the dynamic ones


def test_regression_headless_replicas_report_their_patches(head):
    """regression: every headless replica of every stage (the initial remote slots and the dynamic
    replicas) is listed with the outcomes its own process sent; the head-local replica, which
    registers with its planned id, has none (its outcomes are the head's engine report)."""
    listed = members(head)
    expected = registration_report.report()
    for key in REPORTING:
        assert listed[key].get("patches") == expected, key
        assert listed[key]["patches"][contract.CONNECTOR_PORTS] == _patching.outcomes()[contract.CONNECTOR_PORTS].outcome
        assert listed[key]["patches"][contract.REGISTRATION_REPORT] == contract.APPLIED
    assert listed[(0, 0)]["local"] and "patches" not in listed[(0, 0)]


def test_regression_all_routes_listing_reports_too(head):
    """regression: ``?all=true`` (every route, paged) builds members the same way."""
    body = asyncio.run(LiveHead.locate(StandinEngineClient(head.engine)).snapshot(include_all=True))
    listed = {(m["stage"], m["replicaId"]): m for ms in body["stages"].values() for m in ms}
    assert {key for key, m in listed.items() if "patches" in m} == set(REPORTING)


def test_the_head_attaches_every_reporting_replica(head):
    """The extra key is harmless: the head's startup went through (the stage-init wait accepted
    the initial slots' registrations), the dynamic replicas were attached through on_register,
    and the stored configs are what the replicas sent, plus the report when the patch is on."""
    engine = head.engine
    assert [sorted(pool.live_replica_ids()) for pool in engine.stage_pools] == [[0, 1], [0, 1], [0]]
    listed = members(head)
    for key in REPORTING:
        assert listed[key]["state"] == contract.ATTACHED and listed[key]["coordinatorStatus"] == "up", key
        stored = dict(engine.master._stage_configs[key])
        sent = {"stage_id": key[0]}
        if patch_applied(contract.REGISTRATION_REPORT):
            sent[contract.REGISTRATION_PATCHES_KEY] = registration_report.report()
        if patch_applied(contract.REATTACH) and key[0] == 0:
            # A headless stage-0 launcher's registration names its process too (patch reattach): a uuid.
            assert len(stored.pop(contract.REATTACH_INSTANCE_KEY, "")) == 32, (key, stored)
        assert stored == sent, key


def test_without_the_patch_no_member_reports(head):
    """The negative control's own check (runs only with the patch off): nothing is reported."""
    if patch_applied(contract.REGISTRATION_REPORT):
        pytest.skip("registration_report is applied in this run; this checks the run with it off")
    assert all("patches" not in m for m in members(head).values())
    configs = head.engine.master._stage_configs
    assert all(contract.REGISTRATION_PATCHES_KEY not in (cfg or {}) for cfg in configs.values())


# ---- the wrapper on its own --------------------------------------------------------------------


def test_wrapper_is_what_the_headless_launchers_call():
    """The launchers resolve the function in ``stage_engine_startup``'s globals at call time: the
    wrapper is what they call (checked on the real functions, without launching anything)."""
    if not patch_applied(contract.REGISTRATION_REPORT):
        pytest.skip(f"registration_report is not applied: {_patching.outcomes().get(contract.REGISTRATION_REPORT)}")
    for caller in registration_report.CALLERS:
        fn = getattr(stage_engine_startup, caller)
        assert registration_report.FUNCTION in fn.__code__.co_names, caller
        assert _patching.is_ours(fn.__globals__[registration_report.FUNCTION], contract.REGISTRATION_REPORT)


@pytest.fixture(autouse=True)
def own_outcomes(monkeypatch):
    """The unit tests record outcomes under their own labels; keep them out of the process's
    outcomes (the engine report other modules check lists exactly contract.PATCHES)."""
    monkeypatch.setattr(_patching, "_outcomes", dict(_patching._outcomes))


def _fake_register(calls: list[dict[str, Any]]):
    """A stand-in for the target with its 0.30.0 signature (keyword-only), recording its calls."""
    def register_stage_with_omni_master(*, omni_master_address, omni_master_port, omni_stage_id,
                                        omni_stage_config=None, coordinator=None, replica_id=0,
                                        replica_bind_address=None):
        calls.append({"omni_stage_config": omni_stage_config, "replica_id": replica_id})
        return "response"
    return register_stage_with_omni_master


def test_wrapper_adds_the_report_only_to_auto_assigned_registrations(monkeypatch):
    """Installed on a recording stand-in of the target (under its own label, so the process's
    outcome is untouched): a dict config is copied with the key added, a dataclass config is
    serialized by vllm-omni's own ``_serialize_stage_config`` first, ``None`` stays ``None``, and a
    registration with an explicit replica id (the head's own replicas) is passed on as it came."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(stage_engine_startup, registration_report.FUNCTION, _fake_register(calls))
    outcome = _patching.apply_patch("registration_report on a stand-in target", registration_report.install)
    assert outcome.outcome == contract.APPLIED, outcome
    wrapped = getattr(stage_engine_startup, registration_report.FUNCTION)
    assert _patching.is_ours(wrapped, contract.REGISTRATION_REPORT)

    @dataclasses.dataclass
    class TypedStageConfig:
        stage_id: int
        model_stage: str

    base = {"omni_master_address": "127.0.0.1", "omni_master_port": 1, "omni_stage_id": 1}
    config = {"stage_id": 1}
    for stage_config in (config, TypedStageConfig(1, "talker"), None):
        assert wrapped(**base, omni_stage_config=stage_config, replica_id=None) == "response"
    assert wrapped(**base, omni_stage_config=config, replica_id=3) == "response"
    assert wrapped(**base, omni_stage_config=config) == "response"  # replica_id defaults to 0
    report = registration_report.report()
    assert [c["omni_stage_config"] for c in calls] == [
        {"stage_id": 1, contract.REGISTRATION_PATCHES_KEY: report},
        {"stage_id": 1, "model_stage": "talker", contract.REGISTRATION_PATCHES_KEY: report},
        None,
        config,
        config,
    ]
    assert config == {"stage_id": 1}  # the caller's dict is never modified
    assert registration_report.reported(calls[0]["omni_stage_config"]) == report
    assert registration_report.reported({"stage_id": 1}) is None
    assert registration_report.reported({contract.REGISTRATION_PATCHES_KEY: {"x": 1}}) is None


def test_changed_target_signature_is_skipped_and_left_alone(monkeypatch):
    """A future target without the keyword-only ``replica_id``: the install records ``skipped``
    with the reason and changes nothing (the module attribute and the launchers' binding)."""
    def register_stage_with_omni_master(omni_master_address, omni_master_port, omni_stage_id,
                                        omni_stage_config=None, replica_id=0):
        raise AssertionError("never called here")

    monkeypatch.setattr(stage_engine_startup, registration_report.FUNCTION, register_stage_with_omni_master)
    outcome = _patching.apply_patch("registration_report on a changed target", registration_report.install)
    assert outcome.outcome == contract.SKIPPED
    assert "changed shape" in outcome.reason and "omni_stage_config" in outcome.reason, outcome.reason
    assert getattr(stage_engine_startup, registration_report.FUNCTION) is register_stage_with_omni_master
    launcher = stage_engine_startup.launch_headless_llm_replica
    assert launcher.__globals__[registration_report.FUNCTION] is register_stage_with_omni_master
    assert not _patching.is_ours(register_stage_with_omni_master)
    assert "replica_id" in inspect.signature(register_stage_with_omni_master).parameters
