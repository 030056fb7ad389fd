"""`vismmoe-edge analyze`: the predictability measure, token attribution across the cut, and the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vismmoe_edge
from tests.test_cli import run_cli
from vismmoe_edge.compress.prune import CompressionConfig
from vismmoe_edge.evaluation.analyze import analyze_compressor, normalized_mutual_information
from vismmoe_edge.evaluation.vqa import shapes_vqa_items


def test_nmi() -> None:
    a = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert normalized_mutual_information(a, a) == pytest.approx(1.0)
    assert normalized_mutual_information(a, (a * 7 + 3) % 11) == pytest.approx(1.0)  # relabelled: still a function
    b = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])  # independent of a
    assert normalized_mutual_information(a, b) == pytest.approx(0.0, abs=1e-12)
    assert 0.0 < normalized_mutual_information(a, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])) < 1.0


def test_analyze_attributes_tokens_across_the_cut(checkpoints: dict[str, Path]) -> None:
    items = shapes_vqa_items("test", limit=2)
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=2, device="cpu")
    top_k = engine.language_model.layers[0].mlp.gate.top_k
    plain = analyze_compressor(engine, items, CompressionConfig("none"), progress=False)
    pruned = analyze_compressor(engine, items, CompressionConfig("affinity", keep_ratio=0.5), progress=False)
    # without compression every visual token is kept, in every layer
    assert torch.equal(plain.counts["kept_visual"], plain.counts["visual"])
    visual = sum(plain.visual_tokens)
    assert (plain.counts["visual"].sum(dim=1) == visual * top_k).all()
    # with it: the two prefix layers route every visual token, later layers only the kept ones
    kept = sum(pruned.kept_visual_tokens)
    assert kept < visual
    per_layer = pruned.counts["visual"].sum(dim=1) // top_k
    assert per_layer.tolist() == [visual, visual] + [kept] * (len(per_layer) - 2)
    assert (pruned.counts["kept_visual"].sum(dim=1) == kept * top_k).all()
    # text tokens are never dropped
    assert torch.equal(plain.counts["text"].sum(dim=1), pruned.counts["text"].sum(dim=1))
    assert len(pruned.nmi[0]) == len(per_layer) - 1
    assert sum(pruned.misses) > 0


def test_analyze_command(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "an"
    proc = run_cli(
        "analyze", "--model", str(checkpoints["v5"]), "--limit", "2", "--compressors", "none,saliency,affinity",
        "--keep-ratio", "0.5", "--memory-budget", "25%", "--pinned-layers", "2", "--tier", "host",
        "--device", "cpu", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "analysis.json").read_text())
    assert [c["method"] for c in record["compressors"]] == ["none", "saliency", "affinity"]
    none, saliency, affinity = record["compressors"]
    assert none["kept_visual_tokens_mean"] == none["visual_tokens_mean"]
    assert saliency["kept_visual_tokens_mean"] == affinity["kept_visual_tokens_mean"] < none["visual_tokens_mean"]
    assert len(affinity["unique_experts_per_layer"]) == 10
    for method in ("none", "saliency", "affinity"):
        assert (out / f"heatmap-{method}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| affinity |" in proc.stdout
