"""`vismmoe-edge calibrate`: the recorded predictor features are consistent with the routing that happened."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import vismmoe_edge
from tests.test_cli import run_cli
from vismmoe_edge.compress.prune import CompressionConfig
from vismmoe_edge.predict.routing_features import FeatureRecorder, routing_shares
from vismmoe_edge.sampling import SamplingConfig


def test_routing_shares() -> None:
    index = torch.tensor([[0, 1], [0, 2], [3, 1]])
    assert routing_shares(index, None, 4).tolist() == pytest.approx([2 / 6, 2 / 6, 1 / 6, 1 / 6])
    rows = torch.tensor([True, False, True])
    assert routing_shares(index, rows, 4).tolist() == [0.25, 0.5, 0.0, 0.25]


def test_recorded_features_are_consistent(checkpoints: dict[str, Path], images: list[Path]) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=2, device="cpu")
    engine.compression = CompressionConfig("affinity", keep_ratio=0.5)
    seen: list[tuple[int, int]] = []  # (layer, rows) of every routing call
    engine.experts.route_hooks.append(lambda layer, hidden, index, w: seen.append((layer, index.shape[0])))
    recorder = FeatureRecorder(engine)
    for n, image in enumerate(images):
        sampling = SamplingConfig(max_new_tokens=3, min_new_tokens=3, seed=n)
        engine.generate_from_inputs(engine.encode("What is it?", [image]), sampling)
    data = recorder.arrays()
    L, E, top_k = int(data["num_layers"]), int(data["num_experts"]), int(data["top_k"])
    steps = len(seen) // L
    assert len(data["layer"]) == steps * L == 2 * 3 * L  # 2 prompts x (prefill + 2 decode steps) x layers
    assert data["layer"].tolist() == list(range(L)) * steps
    assert data["request"].tolist() == [0] * (3 * L) + [1] * (3 * L)
    assert data["phase"].tolist() == ([0] * L + [1] * 2 * L) * 2
    np.testing.assert_allclose(data["history"][:, 0].sum(-1), 1.0, rtol=1e-6)
    # the future of layer i is the history of layers i+1.. in the same step; none beyond the last layer
    for s in range(0, len(data["layer"]), L):
        for i in range(L):
            for w in range(5):
                valid = data["future_valid"][s + i, w]
                assert valid == (i + 1 + w < L)
                if valid:
                    np.testing.assert_array_equal(data["future"][s + i, w], data["history"][s + i + 1 + w, 0])
            if i > 0:
                np.testing.assert_array_equal(data["history"][s + i, 1], data["history"][s + i - 1, 0])
    # decode steps carry one token: its k experts each hold 1/k of the share
    decode = data["history"][data["phase"] == 1, 0]
    assert ((decode > 0).sum(-1) == top_k).all() and np.allclose(decode[decode > 0], 1 / top_k)
    # the visual summary is one vector per request, through prefill and decode
    for r in (0, 1):
        v = data["visual"][data["request"] == r]
        assert np.abs(v).sum() > 0 and (v == v[0]).all()
    assert data["hidden"].shape == (len(data["layer"]), engine.text_config.hidden_size)
    assert E == engine.catalogue.num_experts
    # the next-layer-gate baseline: the next router's top-k mass; k per token (decode: one token), none at the end
    gate = data["next_gate"]
    assert gate.shape == (len(data["layer"]), E)
    assert (gate[data["layer"] == L - 1] == 0).all()
    inner = (data["layer"] < L - 1) & (data["phase"] == 1)
    np.testing.assert_array_equal((gate[inner] > 0).sum(-1), top_k)
    mass = gate[inner].sum(-1)  # one token's top-k probabilities
    assert ((mass > 0) & (mass <= 1 + 1e-5)).all()
    recorder.close()


def test_next_gate_scores_equal_the_next_router_on_the_hidden_state(checkpoints: dict[str, Path]) -> None:
    """Recorded next_gate at layer i equals softmax(W_{i+1} h_i) top-k mass, computed here from the raw weights."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu")
    hidden_seen: dict[int, torch.Tensor] = {}
    engine.experts.route_hooks.append(lambda layer, hidden, index, w: hidden_seen.__setitem__(layer, hidden.clone()))
    recorder = FeatureRecorder(engine)
    engine.generate_from_inputs(engine.encode("Hello there"), SamplingConfig(max_new_tokens=1))
    data = recorder.arrays()
    layers = engine.catalogue.moe_layers
    top_k = int(data["top_k"])
    for i in range(len(layers) - 1):
        weight = engine.language_model.layers[layers[i + 1]].mlp.gate.weight
        probs = torch.softmax(hidden_seen[layers[i]].float() @ weight.float().T, dim=-1)  # the last step: 1 token
        top_p, top_i = probs.topk(top_k, dim=-1)
        expected = torch.zeros(probs.shape[1]).index_add_(0, top_i.flatten(), top_p.flatten())
        last = np.flatnonzero(data["layer"] == i)[-1]
        np.testing.assert_allclose(data["next_gate"][last], expected.numpy(), rtol=1e-5, atol=1e-6)
    recorder.close()


def test_calibrate_command(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cal.npz"
    proc = run_cli(
        "calibrate", "--model", str(checkpoints["v5"]), "--limit", "2", "--max-new-tokens", "2",
        "--memory-budget", "50%", "--pinned-layers", "1", "--tier", "host", "--device", "cpu", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = np.load(out)
    assert set(data["request"].tolist()) == {0, 1}
    assert data["future"].shape[1:] == (5, int(data["num_experts"]))
