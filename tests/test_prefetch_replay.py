"""tools/analysis/prefetch_replay.py: lookahead prefetch replayed on synthetic traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from analysis import orin_projection as op  # noqa: E402
from analysis import prefetch_replay as pr  # noqa: E402

from vismmoe_edge.experts.oracle import layer_steps, popularity  # noqa: E402
from vismmoe_edge.predict import baselines  # noqa: E402
from vismmoe_edge.predict.from_ids import samples_from_ids  # noqa: E402
from vismmoe_edge.trace import RoutingTrace, synthetic_trace  # noqa: E402

E, K, L = 64, 6, 9
CAPACITY = 128  # a quarter of the 8 streamed layers' experts


def chained_ids(tokens: int, seed: int) -> np.ndarray:
    """Layer 0 uniform; layer l's experts are a fixed permutation of layer l-1's: a transfer matrix knows them."""
    rng = np.random.default_rng(seed)
    perms = np.stack([rng.permutation(E) for _ in range(L)])
    ids = np.empty((tokens, L, K), np.uint8)
    ids[:, 0] = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])
    for layer in range(1, L):
        ids[:, layer] = perms[layer][ids[:, layer - 1]]
    return ids


def test_no_prefetch_is_the_engines_popularity_replay() -> None:
    trace = synthetic_trace(1500, L, E, K, locality=0.4, seed=3)
    keys, steps = layer_steps(trace)
    pinned = [layer * E + e for layer in range(1) for e in range(E)]
    ref = popularity(keys, steps, CAPACITY, pinned)
    r = pr.replay(trace.expert_ids, E, 1, CAPACITY, 2 * K, None)
    assert r.demand == ref.misses and r.accesses == ref.accesses - 1500 * K  # pinned layer 0's accesses left out
    assert r.speculative == 0 and r.wasted == 0


def test_perfect_predictions_remove_every_demand_miss_after_warmup() -> None:
    ids = chained_ids(3000, seed=0)
    none = pr.replay(ids, E, 1, CAPACITY, 2 * K, None, count_from=1000)
    assert none.demand_rate > 0.7  # near-uniform routing: hits ~ the cache share
    oracle = pr.replay(ids, E, 1, CAPACITY, 2 * K, pr.make_predictor("oracle", ids, E, 2), count_from=1000)
    assert oracle.demand == 0 and oracle.wasted == 0
    # the misses moved to speculative reads: about as many bytes, none stalling
    assert oracle.speculative_rate == pytest.approx(none.demand_rate, rel=0.1)
    for depth in (1, 2):  # the transfer matrix learnt on the first 1000 tokens names the next layers exactly
        fn = pr.make_predictor("transfer", ids, E, depth, train=ids[:1000])
        learnt = pr.replay(ids, E, 1, CAPACITY, depth * K, fn, count_from=1000)
        assert learnt.demand == 0
        assert learnt.wasted < 0.1  # depth 2's chained guesses for l+2 are mostly right too


def test_random_predictions_on_uniform_routing_buy_hits_at_chance() -> None:
    ids = synthetic_trace(3000, L, E, K, locality=0.0, skew=0.0, seed=1).expert_ids
    none = pr.replay(ids, E, 1, CAPACITY, 2 * K, None, count_from=1000)
    rand = pr.replay(ids, E, 1, CAPACITY, 2 * K, pr.make_predictor("random", ids, E, 2, seed=1), count_from=1000)
    assert 1 - rand.wasted == pytest.approx(K / E, abs=0.02)  # a random guess is routed with chance k/E
    assert rand.wasted > 0.85
    saved = none.demand_rate - rand.demand_rate
    assert 0 < saved < 0.1 * rand.speculative_rate  # each speculative read saves under a tenth of a demand miss
    assert rand.demand_rate + rand.speculative_rate > 2 * none.demand_rate  # so the link carries far more bytes
    row = {"expert_bytes": 2.5e6, "plan": {"language_weights_bytes": 0.6e9}}
    per = 8 * 45 * 2.5e6
    base = pr.time_per_token(row, none.demand_rate * per, 0.0, 102e9, 3.5e9)
    guess = pr.time_per_token(row, rand.demand_rate * per, rand.speculative_rate * per, 102e9, 3.5e9)
    assert guess["prefetch"] < base["serial"]  # even with the speculative reads overlapped: slower than none


def test_time_rule_by_hand() -> None:
    row = {"expert_bytes": 2.5e6, "plan": {"language_weights_bytes": 0.6e9}}
    t = pr.time_per_token(row, 0.2e9, 0.3e9, dram=102e9, nvme=3.5e9, efficiency=0.5)
    t_dram = (0.6e9 + 3 * 384 * 2.5e6 + 2 * 0.5e9) / 51e9
    assert t["t_dram"] == pytest.approx(t_dram)
    assert t["prefetch"] == pytest.approx(1 / max(0.5 / 3.5, t_dram + 0.2 / 3.5))
    assert t["serial"] == pytest.approx(1 / (0.5 / 3.5 + t_dram))
    assert pr.time_per_token(row, 0.5e9, 0.0, 102e9, 3.5e9)["serial"] == pytest.approx(
        op.project_measured(row | {"decode_read_bytes_per_token": 0.5e9}, 102e9, 3.5e9)["serial"]
    )  # no speculation: the --trace column's serial rule


def test_baselines_match_predict_baselines() -> None:
    ids = synthetic_trace(400, 4, 16, 2, locality=0.3, seed=2).expert_ids
    data = samples_from_ids(ids, np.zeros(len(ids), np.int64), 16, history=1, window=1)
    assert np.allclose(pr.layer_frequency(ids, 16), baselines.layer_frequency(data), atol=1e-6)
    assert np.allclose(pr.transfer_matrix(ids, 16)[:-1], baselines.transfer_matrix(data)[:-1], atol=1e-5)


def test_split_train_keeps_duplicates_of_held_out_prompts_out() -> None:
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(0, E, (n, L, K), dtype=np.uint8) for n in (5, 7, 6))
    trace = RoutingTrace(np.concatenate([a, b, c, b]), np.array([0, 5, 12, 18]), E, list(range(L)), "t")
    train, first = pr.split_train(trace, 12)
    assert first == 12
    assert np.array_equal(train, a)  # b reappears after the split: left out of training


def test_prefetch_table_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ids = chained_ids(600, seed=4)
    trace = RoutingTrace(ids, np.arange(0, 600, 50), E, list(range(L)), "chained")
    row = {"profile": "orin-nx-16gb--maxn", "returncode": 0, "decode_read_bytes_per_token": 0.1e9,
           "expert_bytes": 2.5e6, "plan": {"language_weights_bytes": 0.6e9, "pinned_layers": 1,
                                           "cache_bytes": 47 * 128 * 2.5e6 / 4}}  # fmt: skip
    lines = pr.prefetch_table([row], trace, ["previous-token", "oracle"], depth=2, test_from=300, warmup=200)
    body = [ln for ln in lines if ln.startswith("| Orin NX")]
    assert [ln.split(" | ")[1] for ln in body] == ["none", "previous-token", "oracle"]
    assert body[2].split(" | ")[2] == "0.0"  # oracle: no demand misses
    proxy = tmp_path / "proxy.json"
    proxy.write_text(json.dumps({"rows": [row]}))
    path = tmp_path / "trace.npz"
    np.savez(path, expert_ids=ids, prompt_offsets=np.arange(0, 601, 50), moe_layer_ids=np.arange(L), num_experts=E)
    op.main(["--measured", str(proxy), "--trace", str(path), "--prefetch", "oracle", "--test-from", "300"])
    out = capsys.readouterr().out
    assert "| Orin NX 16 GB (MAXN) | oracle | 0.0 |" in out
