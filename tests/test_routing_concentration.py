"""tools/analysis/routing_concentration.py on synthetic `--trace-out` files: fixed routing against uniform routing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from analysis import routing_concentration as rc  # noqa: E402

from vismmoe_edge.trace import TraceWriter  # noqa: E402


def write(path: Path, decode_ids: np.ndarray) -> None:
    """decode_ids [D, L, k]; one prefill step of one token first, as a run writes it."""
    tokens, layers, k = decode_ids.shape
    with TraceWriter(path) as w:
        w.header(model="synthetic", num_experts=32, moe_layers=list(range(layers)), top_k=k)
        prefill = [{"layer": i, "experts": [list(range(k))], "hits": 0, "misses": k} for i in range(layers)]
        w.step(request=0, phase="prefill", token_index=0, layers=prefill)
        for t in range(tokens):
            w.step(request=0, phase="decode", token_index=1 + t, layers=[
                {"layer": i, "experts": [decode_ids[t, i].tolist()], "hits": k - 1, "misses": 1}
                for i in range(layers)])  # fmt: skip


def test_fixed_routing_is_concentrated_uniform_is_not(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rng = np.random.default_rng(0)
    uniform = np.stack([np.stack([rng.choice(32, 4, replace=False) for _ in range(2)]) for _ in range(40)])
    fixed = np.broadcast_to(np.array([3, 7, 11, 20]), (40, 2, 4)).copy()
    write(tmp_path / "u.jsonl", uniform)
    write(tmp_path / "f.jsonl", fixed)
    _, ids, cache = rc.read_decode(tmp_path / "f.jsonl")
    assert ids.shape == (40, 2, 4) and cache[..., 1].sum() == 40 * 2  # the prefill step is left out
    r = np.random.default_rng(1)
    same, spread = rc.layer_stats(ids[:, 0], 32, r), rc.layer_stats(uniform[:, 0], 32, r)
    assert same["distinct"] == 4 and same["overlap"] == 1.0 and same["entropy"] == pytest.approx(2.0)
    assert spread["distinct"] > 28 and spread["overlap"] < 0.3  # uniform: 32 (1 - (7/8)^40) = 31.8, k/E = 0.125
    assert abs(spread["entropy"] - spread["entropy_uniform"]) < 0.1
    rc.main([str(tmp_path / "f.jsonl"), "--bands", "1"])
    assert "engine decode hit rate, all layers: 75.0% (2.0 of 8 experts missed per token)" in capsys.readouterr().out
