"""tools/analysis/orin_projection.py: the measured-bytes projection's arithmetic, worked by hand."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from analysis import orin_projection as op  # noqa: E402

from vismmoe_edge.trace import TraceWriter, synthetic_trace  # noqa: E402

ROW = {
    "profile": "orin-nano-8gb-super--maxn-super",
    "returncode": 0,
    "decode_read_bytes_per_token": 0.5e9,
    "expert_bytes": 2.5e6,
    "plan": {"language_weights_bytes": 0.6e9, "pinned_layers": 3, "cache_bytes": 45 * 128 * 2.5e6 / 4},
}


def test_project_measured_by_hand() -> None:
    r = op.project_measured(ROW, dram=102e9, nvme=3.5e9, efficiency=0.5)
    assert r["touched"] == pytest.approx(384 * 2.5e6)  # top-8 x 48 layers x one record
    assert r["dram_bytes"] == pytest.approx(0.6e9 + 3 * 0.96e9 + 2 * 0.5e9)  # dense + 3x gathered + 2x misses
    assert r["t_nvme"] == pytest.approx(0.5 / 3.5)
    assert r["t_dram"] == pytest.approx(4.48 / 51)
    assert r["serial"] == pytest.approx(1 / (0.5 / 3.5 + 4.48 / 51))  # 4.33 tok/s
    assert r["overlapped"] == pytest.approx(3.5 / 0.5)  # NVMe-bound: 7.0


def test_no_misses_is_dram_bound() -> None:
    r = op.project_measured(ROW | {"decode_read_bytes_per_token": 0}, dram=102.4e9, nvme=6e9, efficiency=0.5)
    assert r["t_nvme"] == 0
    assert r["serial"] == pytest.approx(r["overlapped"]) == pytest.approx(51.2 / 3.48)


def test_uniform_routing_misses_by_hand() -> None:
    hit = 3 / 48 + (45 / 48) * 0.25  # pinned layers always hit; a quarter of the streamed experts cached
    assert op.uniform_miss_bytes(ROW) == pytest.approx((1 - hit) * 384 * 2.5e6)
    whole = ROW | {"plan": ROW["plan"] | {"cache_bytes": 1e12}}
    assert op.uniform_miss_bytes(whole) == pytest.approx(0)


def test_table_rows_per_board_and_failed_runs_left_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    nx = ROW | {"profile": "orin-nx-16gb--maxn", "decode_read_bytes_per_token": 0.1e9}
    failed = ROW | {"returncode": -9}
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"meta": {}, "rows": [ROW, nx, failed]}))
    op.main(["--measured", str(path)])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| Orin")]
    assert [ln.split(" | ")[0] for ln in lines] == [
        "| Orin Nano 8 GB Super (MAXN SUPER)",
        "| Orin Nano 8 GB (no Super)",
        "| Orin NX 16 GB (MAXN)",
    ]
    nano = op.project_measured(ROW, 102e9, 3.5e9)
    assert f"3.5 GB/s: {nano['serial']:.2f}, {nano['overlapped']:.2f}" in lines[0]
    nx_own = op.project_measured(nx, 102.4e9, 6e9)
    assert f"6.0 GB/s: {nx_own['serial']:.2f}" in lines[2]


@pytest.mark.parametrize("policy", ["popularity", "lru"])
def test_trace_replay_same_experts_costs_almost_nothing(policy: str) -> None:
    share = op.cache_share(ROW)  # a quarter of the 45 streamed layers' experts
    assert share == pytest.approx(0.25)
    # every token routes to the same experts: only the cold fill misses, so ~0 bytes per token
    same = op.replay_plan(synthetic_trace(2000, 9, 64, 6, locality=1.0, seed=0), 3, share, policy)
    assert same["capacity"] == 96 and same["of"] == 384  # a quarter of 6 streamed layers x 64
    assert same["misses"] == 6 * 6  # each streamed layer's 6 experts, once
    assert op.trace_miss_bytes(ROW, same["hit"]) < 0.01 * op.uniform_miss_bytes(ROW)
    assert op.trace_miss_bytes(ROW, 0.0) == pytest.approx(384 * 2.5e6 * 45 / 48)  # all 45 streamed layers miss


def test_trace_replay_uniform_routing_gives_the_uniform_figure() -> None:
    trace = synthetic_trace(3000, 9, 64, 6, locality=0.0, skew=0.0, seed=1)  # independent uniform routing
    share = op.cache_share(ROW)
    pop = op.replay_plan(trace, 3, share, "popularity")
    assert pop["hit"] == pytest.approx(share, abs=0.02)  # the engine's default policy: hit rate = cache share
    assert op.trace_miss_bytes(ROW, pop["hit"]) == pytest.approx(op.uniform_miss_bytes(ROW), rel=0.03)
    # a shared LRU visited layer after layer holds least of the layer it is about to read: below the share
    assert 0.15 < op.replay_plan(trace, 3, share, "lru")["hit"] < share - 0.03


def test_trace_table_rows(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "trace.jsonl"
    with TraceWriter(trace) as writer:
        writer.header(model="synthetic", num_experts=16, moe_layers=[0, 1, 2, 3, 4], top_k=2)
        rng = np.random.default_rng(0)
        for t in range(50):
            ids = [[sorted(rng.choice(16, 2, replace=False).tolist())] for _ in range(5)]
            writer.step(request=0, phase="decode", token_index=t, layers=[
                {"layer": layer, "experts": ids[layer]} for layer in range(5)])  # fmt: skip
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"meta": {}, "rows": [ROW]}))
    op.main(["--measured", str(path), "--trace", str(trace)])
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| Orin") and "of 32" in ln]
    assert len(rows) == 2  # the Nano Super and the non-Super Nano, both from the one plan
    assert "| 3; 25.0% | 8 of 32 |" in rows[0]
