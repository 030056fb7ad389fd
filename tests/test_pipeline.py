"""The expert pipeline: budget, entry states, demand-first order, the speculative cap, stale prefetches."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from vismmoe_edge.checkpoint import read_tensor_table
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.pipeline import ExpertPipeline, State
from vismmoe_edge.experts.runtime import build_runtime
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles
from vismmoe_edge.experts.tier import TierDefaults
from vismmoe_edge.models import qwen3_vl_moe


class RecordingTier(TierDefaults):
    """A tier that records fetch order and can hold fetches back, to test scheduling deterministically."""

    name = "fake"
    slot_bytes = 100

    def __init__(self) -> None:
        self.fetched: list[tuple[int, int]] = []
        self.released: list[tuple[int, int]] = []
        self.gate = threading.Event()
        self.gate.set()

    def fetch(self, key, slot):
        self.gate.wait(5)
        self.fetched.append(key)
        return ExpertWeights(torch.zeros(1), torch.zeros(1))

    def release(self, key, slot):
        self.released.append(key)

    def ready(self, key, slot):
        pass

    def done(self, key, slot):
        pass

    def read_bytes(self, key):
        return 100


def run_layer(pipeline: ExpertPipeline, layer: int, experts: list[int]) -> list[int]:
    order = pipeline.begin_layer(layer, experts)
    for e in order:
        pipeline.acquire(layer, e)
        pipeline.finish(layer, e)
    return order


@pytest.fixture()
def store(checkpoints) -> ExpertStore:
    model_dir = checkpoints["v5"]
    config = qwen3_vl_moe.read_config(model_dir)
    catalogue = qwen3_vl_moe.FAMILY.catalogue_for(config, read_tensor_table(model_dir))
    return ExpertStore(catalogue, ShardFiles(), torch.float32, torch.device("cpu"))


def test_real_slots_never_exceed_budget_and_give_the_right_bytes(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    runtime = build_runtime(store, budget_bytes=5 * per + per // 2, pinned_layers=[])
    pipeline = runtime.pipeline
    assert pipeline.capacity == 5
    rng = random.Random(0)
    for step in range(60):
        layer = rng.randrange(10)
        experts = rng.sample(range(16), 4)
        order = pipeline.begin_layer(layer, experts)
        for e in order:
            w = pipeline.acquire(layer, e)
            expected = store.load(layer, e)
            assert torch.equal(w.gate_up, expected.gate_up) and torch.equal(w.down, expected.down), (step, e)
            pipeline.finish(layer, e)
        assert pipeline.stats.resident_bytes <= 5 * per
    assert pipeline.stats.hits + pipeline.stats.misses == 240
    assert pipeline.stats.bytes_read == pipeline.stats.misses * store.catalogue.expert_bytes
    pipeline.close()


def test_expired_entries_leave_least_recently_used_first() -> None:
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=3)
    for e in (0, 1, 2):
        run_layer(pipeline, 5, [e])
    run_layer(pipeline, 5, [0])  # 1 is now the oldest
    run_layer(pipeline, 5, [3])
    assert tier.released == [(5, 1)]
    assert pipeline.resident_keys() == {(5, 0), (5, 2), (5, 3)}
    assert (pipeline.stats.hits, pipeline.stats.misses) == (1, 4)
    pipeline.close()


def test_required_experts_are_never_evicted() -> None:
    """Capacity 2, a layer routing 4 experts: the ones waiting to be computed keep their slots."""
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=2)
    order = pipeline.begin_layer(0, [0, 1, 2, 3])
    first = pipeline.acquire(0, order[0])
    time.sleep(0.2)  # the I/O thread would like a slot for expert 2, but 0 and 1 are Required
    assert tier.released == []
    assert first is not None
    for e in order:
        if e != order[0]:
            pass
    pipeline.finish(0, order[0])
    for e in order[1:]:
        pipeline.acquire(0, e)
        pipeline.finish(0, e)
    released_while_required = [k for k in tier.released if k in {(0, 2), (0, 3)}]
    assert released_while_required == []
    assert tier.fetched == [(0, 0), (0, 1), (0, 2), (0, 3)]
    pipeline.close()


def test_demand_goes_before_speculation_and_cap_holds() -> None:
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=8, speculative_cap_bytes=3 * tier.slot_bytes)
    tier.gate.clear()  # hold the I/O thread so the queue builds up
    pipeline.begin_layer(0, [9])  # a demand fetch is now blocked inside the tier
    time.sleep(0.05)
    pipeline.prefetch([((1, e), 1.0 - e / 10) for e in range(6)], current_layer=0)  # cap: only 3 queued
    pipeline.begin_layer(0, [7])  # demand arrives after the predictions
    tier.gate.set()
    pipeline.drain()
    assert tier.fetched[:2] == [(0, 9), (0, 7)]
    assert tier.fetched[2:] == [(1, 0), (1, 1), (1, 2)]
    pipeline.close()


def test_stale_and_superseded_prefetches_are_dropped() -> None:
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=8, speculative_cap_bytes=8 * tier.slot_bytes)
    tier.gate.clear()
    pipeline.begin_layer(0, [0])
    time.sleep(0.05)
    pipeline.prefetch([((1, 5), 0.9), ((2, 6), 0.5)], current_layer=0)
    pipeline.prefetch([((2, 7), 0.8), ((1, 1), 0.1)], current_layer=1)  # layer 1 is stale now; (1,5) superseded
    tier.gate.set()
    pipeline.drain()
    assert tier.fetched == [(0, 0), (2, 7)]
    pipeline.close()


def test_prefetched_expert_counts_as_a_prefetch_hit() -> None:
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=4, speculative_cap_bytes=4 * tier.slot_bytes)
    run_layer(pipeline, 0, [1])
    pipeline.prefetch([((1, 3), 1.0), ((1, 2), 0.5)], current_layer=0)
    pipeline.drain()
    run_layer(pipeline, 1, [3])
    assert pipeline.stats.prefetch_hits == 1 and pipeline.stats.misses == 1
    # layer 1 ran without (1, 2): that prediction is now the first to go, before older expired entries
    run_layer(pipeline, 2, [0, 1])
    assert pipeline.stats.wasted_speculative_bytes == 100
    assert pipeline.resident_keys() == {(0, 1), (1, 3), (2, 0), (2, 1)}
    pipeline.close()


def test_a_prediction_protects_a_resident_expert_only_until_its_layer_runs() -> None:
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=3, speculative_cap_bytes=3 * tier.slot_bytes)
    run_layer(pipeline, 1, [5])  # the oldest: evicted first
    run_layer(pipeline, 1, [6])
    pipeline.prefetch([((1, 5), 1.0)], current_layer=0)  # resident: raised, protected from eviction
    run_layer(pipeline, 2, [0])  # the cache is full now
    assert pipeline.resident_keys() == {(1, 5), (1, 6), (2, 0)}
    run_layer(pipeline, 3, [0])  # (1, 5) is protected: (1, 6) goes
    assert pipeline.resident_keys() == {(1, 5), (2, 0), (3, 0)}
    run_layer(pipeline, 1, [7])  # layer 1 runs without (1, 5): back to its old place, the oldest, and evicted
    assert pipeline.resident_keys() == {(1, 7), (2, 0), (3, 0)}
    run_layer(pipeline, 4, [0])  # the order is by age again: (2, 0) goes
    assert pipeline.resident_keys() == {(1, 7), (3, 0), (4, 0)}
    pipeline.close()


def test_state_after_layer_is_expired() -> None:
    tier = RecordingTier()
    pipeline = ExpertPipeline(tier, capacity=2)
    run_layer(pipeline, 4, [1])
    assert pipeline._entries[(4, 1)].state is State.EXPIRED
    pipeline.close()


def test_pinned_layers_are_resident_and_outside_the_slots(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    runtime = build_runtime(store, budget_bytes=2 * 16 * per + per, pinned_layers=[0, 1])
    pipeline = runtime.pipeline
    assert pipeline.capacity == 1 and pipeline.stats.bytes_read == 0
    run_layer(pipeline, 0, list(range(16)))
    run_layer(pipeline, 1, list(range(16)))
    assert pipeline.stats.misses == 0
    run_layer(pipeline, 2, list(range(16)))  # streams through the one slot
    assert pipeline.stats.misses == 16
    assert pipeline.stats.resident_bytes == 33 * per
    pipeline.close()


def test_budget_errors_are_actionable(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    with pytest.raises(VismmoeError, match="pinned prefix of 2 layers needs .* lower --pinned-layers"):
        build_runtime(store, budget_bytes=20 * per, pinned_layers=[0, 1])
    with pytest.raises(VismmoeError, match="less than one expert"):
        build_runtime(store, budget_bytes=32 * per + 10, pinned_layers=[0, 1])


def test_fetch_error_reaches_compute() -> None:
    class FailingTier(RecordingTier):
        def fetch(self, key, slot):
            raise OSError(5, "Input/output error")

    pipeline = ExpertPipeline(FailingTier(), capacity=2)
    order = pipeline.begin_layer(0, [1])
    with pytest.raises(OSError, match="Input/output error"):
        pipeline.acquire(0, order[0])


def test_popularity_policy_keeps_the_expert_most_tokens_used() -> None:
    def steps(pipeline: ExpertPipeline) -> None:
        for layer, experts, shares in [(0, [1, 2], [0.9, 0.1]), (1, [5, 6], [0.5, 0.5]), (2, [7], [1.0])]:
            order = pipeline.begin_layer(layer, experts, shares=shares)
            for e in order:
                pipeline.acquire(layer, e)
                pipeline.finish(layer, e)

    popular = ExpertPipeline(RecordingTier(), capacity=3, policy="popularity")
    steps(popular)  # 90% of the prompt's tokens chose (0, 1): it outlives experts fewer tokens used
    assert popular.resident_keys() == {(0, 1), (1, 6), (2, 7)}
    recent = ExpertPipeline(RecordingTier(), capacity=3, policy="lru")
    steps(recent)  # LRU drops the oldest, however popular
    assert recent.resident_keys() == {(1, 5), (1, 6), (2, 7)}
    popular.close()
    recent.close()
