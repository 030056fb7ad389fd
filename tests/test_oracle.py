"""Belady/MIN against an exhaustive optimum, LRU and the trace-level bound (synthetic traces only)."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Hashable, Sequence
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from vismmoe_edge.experts.oracle import (
    belady,
    expert_access_sequence,
    layer_steps,
    lru,
    next_use,
    oracle_bound,
    popularity,
    split_keys,
)
from vismmoe_edge.trace import RoutingTrace, synthetic_trace


def brute_force_misses(accesses: Sequence[Hashable], capacity: int, pinned: frozenset = frozenset()) -> int:
    """The fewest misses over every sequence of eviction choices (demand loading, no bypass)."""

    @cache
    def best(i: int, cache: frozenset) -> int:
        if i == len(accesses):
            return 0
        item = accesses[i]
        if item in pinned or item in cache:
            return best(i + 1, cache)
        if len(cache) < capacity:
            return 1 + best(i + 1, cache | {item})
        return 1 + min(best(i + 1, (cache - {victim}) | {item}) for victim in cache)

    return best(0, frozenset())


def random_accesses(rng: random.Random) -> list[str]:
    items = "abcdef"[: rng.randint(2, 6)]
    return [rng.choice(items) for _ in range(rng.randint(1, 12))]


def test_belady_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        accesses = random_accesses(rng)
        capacity = rng.randint(1, 4)
        assert belady(accesses, capacity).misses == brute_force_misses(accesses, capacity), (accesses, capacity)


def test_belady_matches_brute_force_with_pinned() -> None:
    rng = random.Random(1)
    for _ in range(200):
        accesses = random_accesses(rng)
        capacity = rng.randint(1, 3)
        pinned = frozenset(rng.sample(sorted(set(accesses)), k=min(1, len(set(accesses)))))
        assert belady(accesses, capacity, pinned).misses == brute_force_misses(accesses, capacity, pinned)


def test_belady_never_worse_than_lru() -> None:
    rng = np.random.default_rng(2)
    for _ in range(100):
        accesses = rng.integers(0, rng.integers(2, 30), size=int(rng.integers(1, 300)))
        capacity = int(rng.integers(1, 12))
        opt, ref = belady(accesses, capacity), lru(accesses, capacity)
        assert opt.misses <= ref.misses
        assert opt.hits + opt.misses == ref.hits + ref.misses == len(accesses)


def test_large_capacity_has_only_compulsory_misses() -> None:
    rng = np.random.default_rng(3)
    accesses = rng.integers(0, 40, size=2000)
    distinct = len(np.unique(accesses))
    for capacity in (distinct, distinct + 5):
        result = belady(accesses, capacity)
        assert (result.misses, result.evictions) == (distinct, 0)
        assert lru(accesses, capacity).misses == distinct


def test_pinned_items_never_miss_and_take_no_capacity() -> None:
    accesses = ["p", "a", "p", "b", "p", "a", "p", "b"]
    # With "p" pinned, one slot alternates a/b: every a/b access misses, every p access hits.
    result = belady(accesses, 1, pinned={"p"})
    assert (result.misses, result.hits) == (4, 4)
    assert lru(accesses, 1, pinned={"p"}).hits == 4
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 20, size=500)
    pinned = {0, 1, 2}
    n_pinned = int(np.isin(keys, list(pinned)).sum())
    for policy in (belady, lru):
        with_pins = policy(keys, 3, pinned)
        without = policy(keys[~np.isin(keys, list(pinned))], 3)
        assert with_pins.misses == without.misses
        assert with_pins.hits == without.hits + n_pinned


def test_generic_and_integer_paths_agree() -> None:
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 15, size=400)
    for capacity in (1, 4, 9):
        assert belady(keys, capacity) == belady([f"k{x}" for x in keys.tolist()], capacity)
        assert lru(keys, capacity) == lru([(x, 0) for x in keys.tolist()], capacity)


def test_next_use() -> None:
    assert next_use(np.array([3, 1, 3, 3, 1])).tolist() == [2, 4, 3, 5, 5]


def test_access_sequence_order_and_duplicates() -> None:
    ids = np.array([[[5, 1], [2, 2]], [[0, 3], [1, 4]]], dtype=np.uint8)  # 2 tokens, 2 layers, k=2
    trace = RoutingTrace(ids, np.array([0]), num_experts=8, layer_ids=[3, 4], source="t")
    keys = expert_access_sequence(trace)
    layers, experts = split_keys(keys, 8)
    assert list(zip(layers.tolist(), experts.tolist(), strict=True)) == [
        (3, 1),
        (3, 5),
        (4, 2),
        (3, 0),
        (3, 3),
        (4, 1),
        (4, 4),
    ]
    # Batched prefill: each layer's union once per prompt.
    batched = split_keys(expert_access_sequence(trace, decode_order=False), 8)
    assert list(zip(*(a.tolist() for a in batched), strict=True)) == [
        (3, 0),
        (3, 1),
        (3, 3),
        (3, 5),
        (4, 1),
        (4, 2),
        (4, 4),
    ]


def test_oracle_bound_figures() -> None:
    trace = synthetic_trace(300, 4, 16, 2, locality=0.5, seed=6, prompts=3)
    keys = expert_access_sequence(trace)
    bound = oracle_bound(
        trace, capacity_experts=20, expert_bytes=1000, bandwidth_bytes_per_s=1e6, compute_seconds_per_token=1e-3
    )
    assert bound["misses"] == belady(keys, 20).misses == int(bound["per_token_misses"].sum())
    assert bound["bytes_total"] == bound["misses"] * 1000
    assert bound["seconds_total"] == pytest.approx(float(np.maximum(bound["per_token_misses"] * 1e-3, 1e-3).sum()))
    assert bound["floor_seconds_total"] <= bound["seconds_total"] + 1e-12
    pinned = oracle_bound(
        trace,
        capacity_experts=20,
        expert_bytes=1000,
        bandwidth_bytes_per_s=1e6,
        compute_seconds_per_token=1e-3,
        pinned_layers=[0, 1],
    )
    assert pinned["misses"] < bound["misses"]
    # Pinned layers cause no misses at all.
    assert pinned["misses"] == belady(keys[split_keys(keys, 16)[0] >= 2], 20).misses


def test_trace_stats_tool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).parents[1] / "tools" / "analysis" / "trace_stats.py"
    spec = importlib.util.spec_from_file_location("trace_stats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trace = synthetic_trace(120, 3, 8, 2, locality=0.5, seed=7, prompts=4)
    path = tmp_path / "t.npz"
    offsets = np.append(trace.prompt_offsets, trace.num_tokens)
    np.savez(
        path,
        expert_ids=trace.expert_ids,
        prompt_offsets=offsets,
        prompt_ids=np.arange(4),
        moe_layer_ids=np.arange(3),
        num_experts=8,
    )
    assert module.main([str(path), "--capacity-experts", "4,50%", "--expert-mib", "1", "--max-tokens", "100"]) == 0
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(table) == 3 and table[2].startswith("| 12 | 50.0% |")
    assert module.main([str(tmp_path / "missing.npz"), "--capacity-experts", "4", "--expert-bytes", "1"]) == 2


def test_popularity_keeps_the_frequent_expert_lru_drops() -> None:
    # one expert per step; capacity 2: a, a, a, b, c, a. LRU evicts a for c; popularity evicts b (score 1 < 2.97)
    keys = np.array([0, 0, 0, 1, 2, 0])
    steps = np.arange(len(keys))
    assert popularity(keys, steps, 2).misses == 3
    assert lru(keys, 2).misses == 4


def test_popularity_never_evicts_an_expert_of_the_same_step() -> None:
    # b, b, then a and c in ONE step: c cannot take a's slot (a is Required), so it evicts b, which misses again
    keys, together, apart = np.array([1, 1, 0, 2, 1]), np.array([0, 1, 2, 2, 3]), np.arange(5)
    assert popularity(keys, together, 2).misses == 4
    assert popularity(keys, apart, 2).misses == 3  # c in its own step evicts a (score 1 < b's 1.99)


def test_popularity_pinned_and_layer_steps() -> None:
    trace = synthetic_trace(200, 4, 16, 2, locality=0.5, seed=3)
    keys, steps = layer_steps(trace)
    assert np.array_equal(keys, expert_access_sequence(trace))
    assert steps[-1] + 1 == 200 * 4  # one step per (token, layer)
    pinned = [layer * 16 + e for layer in trace.layer_ids[:1] for e in range(16)]
    result = popularity(keys, steps, 16, pinned)
    assert result.accesses == len(keys)
    assert result.misses == popularity(keys[keys >= 16], steps[keys >= 16], 16).misses  # pinned: hits, no room
    with pytest.raises(ValueError, match="cannot hold"):
        popularity(keys, steps, 1)
