"""The expert cache over a real checkpoint: budget, LRU order, the pinned region, clear errors."""

from __future__ import annotations

import random

import pytest
import torch

from vismmoe_edge.checkpoint import read_tensor_table
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.cache import ExpertCache
from vismmoe_edge.experts.store import ExpertStore, ShardFiles
from vismmoe_edge.models import qwen3_vl_moe


@pytest.fixture()
def store(checkpoints) -> ExpertStore:
    model_dir = checkpoints["v5"]
    config = qwen3_vl_moe.read_config(model_dir)
    catalogue = qwen3_vl_moe.catalogue_for(config, read_tensor_table(model_dir))
    return ExpertStore(catalogue, ShardFiles(), torch.float32, torch.device("cpu"))


def test_cache_never_exceeds_budget_and_counts_traffic(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    cache = ExpertCache(store, budget_bytes=5 * per + per // 2, pinned_layers=[])
    rng = random.Random(0)
    for _ in range(300):
        cache.get(rng.randrange(1, 10), rng.randrange(16))
        assert cache.stats.resident_bytes <= 5 * per + per // 2
    assert cache.stats.peak_resident_bytes == 5 * per
    assert cache.stats.hits + cache.stats.misses == 300
    assert cache.stats.bytes_read == cache.stats.misses * store.catalogue.expert_bytes
    assert cache.stats.evictions == cache.stats.misses - 5


def test_lru_evicts_the_least_recently_used(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    cache = ExpertCache(store, budget_bytes=3 * per, pinned_layers=[])
    for e in (0, 1, 2):
        cache.get(5, e)
    cache.get(5, 0)  # 1 is now the oldest
    cache.get(5, 3)
    assert not cache.is_resident(5, 1)
    assert all(cache.is_resident(5, e) for e in (0, 2, 3))
    assert (cache.stats.hits, cache.stats.misses) == (1, 4)


def test_pinned_layers_are_resident_and_outside_the_lru(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    cache = ExpertCache(store, budget_bytes=2 * 16 * per + per, pinned_layers=[0, 1])
    reads_after_load = cache.stats.bytes_read
    assert reads_after_load == 2 * 16 * store.catalogue.expert_bytes
    for e in range(16):
        cache.get(0, e)
        cache.get(1, e)
    assert cache.stats.misses == 0 and cache.stats.bytes_read == reads_after_load
    for e in range(16):
        cache.get(2, e)  # streams through the one free slot
    assert all(cache.is_resident(0, e) and cache.is_resident(1, e) for e in range(16))
    assert cache.stats.resident_bytes == 33 * per


def test_budget_errors_are_actionable(store: ExpertStore) -> None:
    per = store.expert_nbytes()
    with pytest.raises(VismmoeError, match="pinned prefix of 2 layers needs .* lower --pinned-layers"):
        ExpertCache(store, budget_bytes=20 * per, pinned_layers=[0, 1])
    with pytest.raises(VismmoeError, match="less than one expert"):
        ExpertCache(store, budget_bytes=32 * per + 10, pinned_layers=[0, 1])
