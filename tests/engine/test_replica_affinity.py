"""Cache mode `replica-aware`, patch `replica_affinity`: stage 0 prefers the replica holding the media.

Real (vllm 0.30.0 / vllm-omni 0.30.0 on the CPU), as in test_replica_aware_cache.py: the replica-aware
stage-0 frontend built by `_initialize_stages`, the chat path, vLLM's encoder/decoder and each
replica's `MultiModalReceiverCache`, the head-side `StageEngineCoreClient` class with the plugin's
wrappers; and here, the stage-0 `StagePool`'s real `submit_initial` (the wrapped entry), its real
`pick` (distributed, with vllm-omni's `RoundRobinBalancer`) or `select_replica_id` (legacy round
robin), and its real bindings (`bind`, `_request_bindings`, and `release_binding`, which the
orchestrator calls when a request finishes).

Stood in: the EngineCore processes, ZMQ sockets and the clients' constructors (engine_stack's
`WireReplica`); the coordinator hub of a distributed head (`StandInHub`: every attached replica UP,
queue length 0, as a freshly heartbeating hub shows them); the orchestrator's output processor and
request state, which `submit_initial` only hands on (`StandInOutputProcessor`, `REQ_STATE`); and,
where a test says so, load: requests in flight on a replica are bindings the head holds for them
(what `pick` / `select_replica_id` record for an unfinished request), written with the pool's
`bind` or into `_request_bindings` as `select_replica_id` writes them (`AffinityDeployment.hold`).

Negative control: with `OMNISTAGE_DISABLE_PATCHES=replica_affinity` the tests marked "regression"
fail (nothing is steered: turns spread over the replicas, which receive the media again), and so
do the steering-error test (there is no wrapper to reach the preference) and the in-file control
`control-no-load-bound`, which drops the bound and shows every request piling onto one replica
(only the patch can pile them). The same happens with `replica_aware_cache` disabled: there are no
mirrors to prefer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip(
    "vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)", exc_type=ImportError
)

from omnistage_engine_patches import _patching, contract, report
from omnistage_engine_patches.patches import replica_affinity, replica_aware_cache
from vllm_omni.distributed.omni_coordinator.load_balancer import RoundRobinBalancer
from vllm_omni.engine.stage_pool import StagePool

from tests.support.engine_stack import InertStageClient, StandInOutputProcessor, stand_in_request_state

from .test_replica_aware_cache import SEQUENCE_28, AwareDeployment, assert_clean, aware_deployment

PATCH = replica_affinity.NAME
REQ_STATE = stand_in_request_state()
TURNS = 5


class StandInHub:
    """A distributed head's `OmniCoordClientForHub`: every attached stage-0 replica UP, queue 0."""

    def __init__(self, pool: StagePool) -> None:
        self.pool = pool

    def get_replicas_for_stage(self, stage_id: int) -> Any:
        from vllm_omni.distributed.omni_coordinator.messages import ReplicaInfo, ReplicaList, ReplicaStatus

        addrs = [self.pool.clients[r].client_addresses["input_address"] for r in self.pool.live_replica_ids()]
        return ReplicaList(replicas=[
            ReplicaInfo(input_addr=a, output_addr=a, stage_id=stage_id, status=ReplicaStatus.UP, queue_length=0,
                        last_heartbeat=0.0, registered_at=0.0) for a in addrs], timestamp=0.0)


class AffinityDeployment(AwareDeployment):
    """AwareDeployment whose requests enter through the real `StagePool.submit_initial`."""

    def __init__(self, base: AwareDeployment, *, distributed_pick: bool) -> None:
        self.__dict__.update(base.__dict__)
        self.pool._output_processor = StandInOutputProcessor()
        if distributed_pick:
            self.pool.attach_hub(StandInHub(self.pool))
            self.pool.attach_load_balancer(RoundRobinBalancer())

    async def dispatch(self, request_id: str, request: Any, to: int | None = None) -> str:
        if to is not None:  # forced onto one replica (a test's setup), as the base class does
            return await super().dispatch(request_id, request, to)
        self.sent[request_id] = request
        self.routed[request_id] = await self.pool.submit_initial(request_id, REQ_STATE, request)
        return request_id

    async def turn(self, images: list[int]) -> int:
        """One finished request: submitted, served, its binding released (the orchestrator's
        `_release_request_bindings` when a request finishes). Returns the replica it went to."""
        request_id = await self.submit(images)
        await self.settle()
        self.pool.release_binding(request_id)
        return self.routed[request_id]

    def hold(self, rid: int, n: int) -> None:
        """n requests in flight on replica rid: bindings the head holds for unfinished requests."""
        for i in range(n):
            request_id = f"in-flight-{rid}-{i}"
            if self.pool.is_distributed:
                self.pool.bind(request_id, self.pool.clients[rid].client_addresses["input_address"])
            else:
                self.pool._request_bindings[request_id] = rid

    def full_sends(self) -> int:
        return sum(len(r.mm_features) for r in self.sent.values()) - self.omitted()


@pytest.fixture
def affinity(build_stage0_engine, make_vllm_config, monkeypatch):
    def make(*, replicas: int = 2, distributed_pick: bool = False, **kwargs: Any) -> AffinityDeployment:
        base = aware_deployment(build_stage0_engine, make_vllm_config, monkeypatch, replicas=replicas, **kwargs)
        return AffinityDeployment(base, distributed_pick=distributed_pick)

    yield make
    replica_aware_cache.activate(None)


def conversation(c: int, k: int) -> list[int]:
    """Conversation c's turn k (1-based): its k images, the earlier turns' and one new one."""
    return [100 + TURNS * c + j for j in range(k)]


def stats_delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in replica_affinity.STATS.items() if v != before.get(k, 0)}


PICKS = pytest.mark.parametrize("distributed_pick", [False, True], ids=["select_replica_id", "pick-round-robin"])


# ---- the preference ----------------------------------------------------------------------------
@PICKS
def test_regression_a_conversation_stays_on_the_replica_holding_its_media(affinity, distributed_pick):
    """3 conversations x 5 turns, interleaved, over 2 replicas with balanced load (each request
    finishes before the next): every turn after the first goes where turn 1 went, so each image
    is sent in full exactly once. Upstream round robin alone moves them (3 conversations, 2 replicas)."""
    d = affinity(replicas=2, distributed_pick=distributed_pick)
    where: dict[int, list[int]] = {c: [] for c in range(3)}

    async def run() -> None:
        for k in range(1, TURNS + 1):
            for c in range(3):
                where[c].append(await d.turn(conversation(c, k)))

    asyncio.run(run())
    assert_clean(d)
    assert d.misses() == 0
    assert {c: set(w) for c, w in where.items()} == {c: {w[0]} for c, w in where.items()}, where
    assert d.full_sends() == 3 * TURNS  # each distinct image once: one replica's lru floor
    assert {w[0] for w in where.values()} == {0, 1}  # the first turns were spread by round robin


def test_regression_a_holder_within_the_bound_is_chosen_one_beyond_it_is_not(affinity):
    """The bound, at its edge: the holder with 2 more requests in flight than the other replica
    (least 0 + max(2, 0)) still gets the turn; with 3 more it does not, and the least-loaded
    replica takes it (round robin, set to pick the holder next, is not consulted)."""
    d = affinity(replicas=2)

    async def run() -> tuple[int, int, int]:
        holder = await d.turn(conversation(0, 1))
        d.hold(holder, 2)
        at_bound = await d.turn(conversation(0, 2))
        d.hold(holder, 3)  # the same 2 again, plus one more in flight: 3 over the least
        d.pool._next_replica_id = holder  # upstream's next round-robin choice: the busy holder
        before = dict(replica_affinity.STATS)
        over = await d.turn(conversation(0, 3))
        assert stats_delta(before) == {"over_bound": 1}
        return holder, at_bound, over

    holder, at_bound, over = asyncio.run(run())
    assert at_bound == holder
    assert over == 1 - holder
    assert replica_affinity.load_bound(0) == 2


def test_load_bound_values():
    """least + max(2, ceil(25% of least)): absolute at low load, relative above 8."""
    assert [replica_affinity.load_bound(n) for n in (0, 1, 8, 9, 12, 100)] == [2, 3, 10, 12, 15, 125]


@pytest.mark.parametrize("no_bound", [False, True], ids=["regression", "control-no-load-bound"])
def test_affinity_never_piles_everything_on_one_replica(affinity, monkeypatch, no_bound):
    """12 turns of one conversation in flight at once (none finished): the holder takes them
    until it is over the bound (round robin alone would alternate from the first), then the idle
    replica, which from then on holds the shared image as well: 6/6. The control drops the bound:
    all 12 pile onto the holder."""
    d = affinity(replicas=2)
    if no_bound:
        monkeypatch.setattr(replica_affinity, "load_bound", lambda least: 10**9)

    async def run() -> list[int]:
        routed = [await d.turn(conversation(0, 1))]  # the holder learns the first image
        for k in range(2, 14):
            routed.append(d.routed[await d.submit([100, 200 + k])])  # image 100 + a new one, unfinished
        await d.settle()
        return routed

    holder, *routed = asyncio.run(run())
    assert_clean(d)
    counts = sorted(routed.count(r) for r in (0, 1))
    if no_bound:
        assert counts == [0, 12]
        return
    # The holder takes 3 (loads 0, 1, 2: within 0 + 2); the 4th goes to the idle replica, which then
    # holds image 100 too, and from there on the two share it by load.
    assert routed[:4] == [holder] * 3 + [1 - holder], routed
    assert counts == [6, 6], counts


def test_a_new_conversation_follows_upstreams_pick(affinity):
    """Requests whose media no replica holds are not steered: with a distributed head's round
    robin they alternate exactly as upstream's balancer alone would place them."""
    d = affinity(replicas=3, distributed_pick=True)
    before = dict(replica_affinity.STATS)

    async def run() -> list[int]:
        return [await d.turn(conversation(c, 1)) for c in range(6)]

    assert asyncio.run(run()) == [0, 1, 2, 0, 1, 2]
    assert_clean(d)
    assert replica_affinity.STATS["steered"] == before.get("steered", 0)


@pytest.mark.parametrize("drop", ["leave", "restart", "miss"])
def test_regression_no_preference_once_the_holders_mirror_is_dropped(affinity, drop):
    """The holder leaves (its client shuts down), restarts (a new registration at the same address),
    or reports a miss (its cache was reset): its mirror is gone, so the conversation's next turn is
    not steered anywhere; while the mirror was there, the turn before was steered to the holder."""
    d = affinity(replicas=3)

    async def run() -> dict[str, int]:
        holder = await d.turn(conversation(0, 1))
        assert await d.turn(conversation(0, 2)) == holder  # steered while the mirror is there
        if drop in ("leave", "restart"):
            addr = d.detach(holder)
            if drop == "restart":
                d.attach(holder, addr=addr)
        else:  # the miss comes from another image: its re-send in full refills the mirror with it only
            await d.submit([7], to=holder)
            await d.settle()
            d.replicas[holder].cache.clear_cache()  # behind the head's back
            await d.submit([7], to=holder)  # stripped, misses, mirror dropped, re-sent in full
            await d.settle()
            assert d.replicas[holder].misses
        before = dict(replica_affinity.STATS)
        await d.turn(conversation(0, 3))
        return stats_delta(before)

    delta = asyncio.run(run())
    assert delta == {"no_holder": 1}, delta
    assert d.errors == [] and d.stale() == []


@PICKS
def test_regression_seed_sequence_with_affinity(affinity, distributed_pick):
    """The seed's 28 requests over two replicas through `submit_initial`: 0 misses, 0 errors,
    0 stale features, and each of the 6 images sent in full once (round robin alone: up to 12)."""
    d = affinity(replicas=2, distributed_pick=distributed_pick)

    async def run() -> None:
        for image in SEQUENCE_28:
            await d.turn([image])

    asyncio.run(run())
    assert_clean(d)
    assert d.misses() == 0
    assert d.full_sends() == len(set(SEQUENCE_28))


# ---- what it leaves alone ---------------------------------------------------------------------
def test_other_modes_other_stages_and_bound_requests_are_left_alone(affinity, monkeypatch):
    """unchanged: a processor-only head, a stage-1 pool, a request already bound to a live replica
    (vllm-omni's preselection for scoped keys) and a CFG companion are never steered."""
    d = affinity(replicas=2, mode=contract.CACHE_PROCESSOR_ONLY)
    assert replica_aware_cache.dispatch() is None
    _, request = asyncio.run(d.render([1]))
    assert replica_affinity.steer(d.pool, "po-1", request) is None

    d = affinity(replicas=2)

    async def run() -> None:
        holder = await d.turn([7])
        other = 1 - holder
        _, again = await d.render([7])
        stage1 = StagePool(1, [InertStageClient(0), InertStageClient(1)])
        assert replica_affinity.steer(stage1, "s1", again) is None
        assert stage1.get_bound_replica_id("s1") is None
        d.pool._request_bindings["pre"] = other  # preselected before rendering
        assert replica_affinity.steer(d.pool, "pre", again) is None
        assert await d.pool.submit_initial("pre", REQ_STATE, again) == other
        d.pool._request_bindings["parent"] = other  # a CFG companion follows its parent
        assert await d.pool.submit_initial("cfg", REQ_STATE, again, affinity_request_id="parent") == other
        await d.settle()

    asyncio.run(run())
    assert d.errors == []


def test_a_steering_error_falls_back_to_upstream(affinity, monkeypatch):
    """A failure inside the preference never fails the request: upstream's pick routes it."""
    d = affinity(replicas=2)

    def broken(*_args: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(replica_affinity, "choose", broken)
    before = dict(replica_affinity.STATS)

    async def run() -> None:
        await d.turn([3])
        await d.turn([3])

    asyncio.run(run())
    assert_clean(d)
    assert stats_delta(before) == {"error": 2}  # the wrapper reached the preference, which raised


# ---- the switch and the report ----------------------------------------------------------------
def test_patch_outcome_follows_the_switch_and_is_reported(affinity, engine_patches):
    outcome = engine_patches[PATCH]
    assert outcome.applied is (not _patching.disabled(PATCH)), outcome
    assert _patching.is_ours(StagePool.__dict__["submit_initial"], PATCH) is outcome.applied
    d = affinity(replicas=2)
    assert report.build(d.engine)["patches"][PATCH] == {"outcome": outcome.outcome, "reason": outcome.reason}


def test_changed_pool_shape_makes_it_a_no_op(monkeypatch):
    """An upstream whose legacy pick no longer honours an existing binding is refused, unchanged."""
    def select_replica_id(self, request_id, *, affinity_request_id=None):  # no sticky step
        return self.live_replica_ids()[0]

    original = StagePool.__dict__["submit_initial"]
    monkeypatch.setattr(StagePool, "select_replica_id", select_replica_id)
    if _patching.is_ours(original, PATCH):  # check the shape as a fresh process would see it
        monkeypatch.setattr(StagePool, "submit_initial", original.__wrapped__)
    reason = replica_affinity.install()
    assert reason and "StagePool.select_replica_id changed shape" in reason, reason
    assert not _patching.is_ours(StagePool.__dict__["submit_initial"], PATCH)
