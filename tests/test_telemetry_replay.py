"""--trace-out records what the engine routed and what the pipeline did; replay feeds a trace back in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import vismmoe_edge
from vismmoe_edge.sampling import SamplingConfig
from vismmoe_edge.trace import load_trace, synthetic_trace


def test_trace_out_matches_the_router_and_the_counters(checkpoints, images, tmp_path: Path) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=1, predictor="previous-token")
    routed: dict[int, list[np.ndarray]] = {}
    engine.experts.route_hooks.append(lambda layer, h, idx, w: routed.setdefault(layer, []).append(idx.numpy()))
    writer = engine.write_trace(tmp_path / "t.jsonl")
    result = engine.generate("Count the shapes.", [images[0]], SamplingConfig(max_new_tokens=5, min_new_tokens=5))
    writer.close()

    lines = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "header" and lines[0]["num_experts"] == 16 and lines[0]["top_k"] == 4
    steps = lines[1:]
    assert [s["phase"] for s in steps] == ["prefill"] + ["decode"] * 4
    assert steps[1]["token_index"] == len(result.prompt_token_ids)
    for s in steps:
        assert [rec["layer"] for rec in s["layers"]] == list(range(10))
    # the counters add up to the run's totals, and the ids are what the router returned
    assert sum(r["hits"] for s in steps for r in s["layers"]) == result.experts["hits"]
    assert sum(r["misses"] for s in steps for r in s["layers"]) == result.experts["misses"]
    for layer in range(10):
        recorded = np.concatenate([np.array(s["layers"][layer]["experts"]) for s in steps])
        assert np.array_equal(recorded, np.concatenate(routed[layer]))
    trace = load_trace(tmp_path / "t.jsonl")
    assert trace.expert_ids.shape == (len(result.prompt_token_ids) + 4, 10, 4)
    assert int(trace.decode.sum()) == 4


def test_replay_routes_from_the_trace(checkpoints, tmp_path: Path) -> None:
    trace = synthetic_trace(200, 3, 12, 2, locality=0.5, seed=3)
    np.savez(
        tmp_path / "synthetic.npz",
        expert_ids=trace.expert_ids,
        prompt_offsets=np.array([0, 200]),
        moe_layer_ids=np.arange(3, dtype=np.int16),
        num_experts=np.array(12),
    )
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="50%")
    replay = engine.replay_routing(tmp_path / "synthetic.npz")
    seen: dict[int, list[np.ndarray]] = {}
    engine.experts.route_hooks.append(lambda layer, h, idx, w: seen.setdefault(layer, []).append(idx.numpy()))
    result = engine.generate("hello", None, SamplingConfig(max_new_tokens=3, min_new_tokens=3))
    n = len(result.prompt_token_ids) + 2
    assert replay.cursor == n
    for layer in range(10):
        got = np.concatenate(seen[layer])
        assert np.array_equal(got, trace.expert_ids[:n, layer % 3])  # MoE layer i reads trace layer i mod 3
