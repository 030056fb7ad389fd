"""The learned lookahead predictor: targets, training on synthetic routing, metrics, baselines, ONNX export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.quant_sources import one_thread  # noqa: F401 - autouse: tiny batches, one torch thread in this module
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.predict.baselines import (
    current_layer_transfer_scores,
    frequency_scores,
    previous_token_scores,
    random_scores,
)
from vismmoe_edge.predict.calibration import DECODE, CalibrationSet, load_calibration, save_calibration
from vismmoe_edge.predict.from_ids import samples_from_ids
from vismmoe_edge.predict.lookahead import LookaheadMLP, predict_scores, train_predictor
from vismmoe_edge.predict.metrics import hot_recall, wasted_prefetch_share
from vismmoe_edge.predict.onnx_runtime import (
    PREDICTOR_FILENAME,
    PredictorSession,
    TorchPredictorSession,
    check_export,
    export_onnx,
    random_inputs,
    read_metadata,
)
from vismmoe_edge.predict.targets import decayed_targets

L, E, K = 6, 16, 2  # synthetic model: MoE layers, experts, top-k


def synthetic_ids(tokens: int, seed: int, noise: float = 0.02) -> np.ndarray:
    """[T, L, K]: layer 0 random; layer l+1 = a fixed per-layer permutation of layer l's experts, except that with
    probability `noise` one of them is swapped for a random expert."""
    perms = np.random.default_rng(1234).permuted(np.tile(np.arange(E), (L - 1, 1)), axis=1)  # the same every call
    rng = np.random.default_rng(seed)
    ids = np.zeros((tokens, L, K), dtype=np.int64)
    ids[:, 0] = np.stack([rng.choice(E, K, replace=False) for _ in range(tokens)])
    for layer in range(L - 1):
        ids[:, layer + 1] = perms[layer][ids[:, layer]]
        for t in np.flatnonzero(rng.random(tokens) < noise):
            free = np.setdiff1d(np.arange(E), ids[t, layer + 1])
            ids[t, layer + 1, rng.integers(K)] = rng.choice(free)
    return ids


def synthetic_set(tokens: int, seed: int, hidden_dim: int = 0) -> CalibrationSet:
    data = samples_from_ids(synthetic_ids(tokens, seed), np.arange(tokens) // 10, E, window=3, phase=DECODE)
    if hidden_dim:  # uninformative hidden/visual features on a large scale: the baked-in normalisation must cope
        rng = np.random.default_rng(seed + 1)
        data.hidden = rng.normal(50.0, 20.0, (len(data), hidden_dim)).astype(np.float32)
        data.visual = rng.normal(-3.0, 0.1, (len(data), hidden_dim)).astype(np.float32)
    return data


def test_targets_match_hand_computed_example() -> None:
    third = np.float32(1 / 3)
    future = np.array(
        [
            [[0.5, 0.3, 0.2, 0, 0, 0], [0, 0.25, 0.25, 0.5, 0, 0], [0, 0, 0, 0, 0, 1.0]],
            [[0, 0, 0, 0, 0.6, 0.4], [third, third, third, 0, 0, 0], [0, 0, 1.0, 0, 0, 0]],
        ],
        dtype=np.float32,
    )
    valid = np.array([[True, True, True], [True, True, False]])
    # top-2 hot sets: sample 0: {0,1}, {3,1} (1 beats 2 on the tie), {5} (one expert used);
    # sample 1: {4,5}, {0,1} (three-way tie), and w=3 is invalid, so its share does not count
    per_layer = decayed_targets(future, valid, top_b=2, gamma=0.5, form="per_layer")
    expected = np.zeros((2, 3, 6), np.float32)
    expected[0, 0, [0, 1]] = 1.0
    expected[0, 1, [1, 3]] = 0.5
    expected[0, 2, 5] = 0.25
    expected[1, 0, [4, 5]] = 1.0
    expected[1, 1, [0, 1]] = 0.5
    np.testing.assert_array_equal(per_layer, expected)
    window = decayed_targets(future, valid, top_b=2, gamma=0.5, form="window")
    np.testing.assert_array_equal(window, [[1, 1, 0, 0.5, 0, 0.25], [0.5, 0.5, 0, 0, 1, 1]])


def test_metrics_on_hand_example() -> None:
    future = np.zeros((2, 1, 4), np.float32)
    future[0, 0] = [0.5, 0.5, 0, 0]  # hot {0, 1}
    future[1, 0] = [0, 0, 0.5, 0.5]  # invalid below: ignored
    valid = np.array([[True], [False]])
    scores = np.array([[0.9, 0.0, 0.8, 0.1], [1, 1, 1, 1]], np.float32)
    recall = hot_recall(scores, future, valid, ks=(1, 2, 3), top_b=2, layer=np.array([0, 1]))
    assert (recall["recall@1"], recall["recall@2"], recall["recall@3"], recall["samples"]) == (0.5, 0.5, 0.5, 1)
    assert recall["per_layer"]["recall@2"] == {0: 0.5}
    wasted = wasted_prefetch_share(scores, future, valid, ks=(1, 2, 4))
    assert (wasted["wasted@1"], wasted["wasted@2"], wasted["wasted@4"]) == (0.0, 0.5, 0.5)


def test_learned_predictor_finds_structure_and_not_noise() -> None:
    # the window form must also rank layer i+1's experts above those of i+2 (targets 1 vs gamma = 0.8) to reach
    # recall@K, which takes more data or width than the per_layer form needs
    train, test = synthetic_set(600, seed=0), synthetic_set(200, seed=1)
    settings = dict(epochs=25, lr=3e-3, batch_size=64, val_requests=0.1, top_b=K, width=128, progress=False)
    for form in ("window", "per_layer"):
        model, curves = train_predictor(train, form=form, seed=0, **settings)
        assert len(curves.train_loss) == len(curves.val_loss) == len(curves.val_recall20) == 25
        assert curves.train_loss[-1] < curves.train_loss[0]
        recall = hot_recall(predict_scores(model, test), test.future, test.future_valid, ks=(K, 4), top_b=K)
        assert recall[f"recall@{K}"] >= 0.9, (form, recall)

    # the same process with targets permuted across samples: nothing left to learn beyond popularity
    shuffled = train.subset(np.arange(len(train)))
    order = np.random.default_rng(0).permutation(len(train))
    shuffled.future, shuffled.future_valid = train.future[order], train.future_valid[order]
    model, _ = train_predictor(shuffled, form="window", seed=0, **settings)
    recall = hot_recall(predict_scores(model, test), test.future, test.future_valid, ks=(K,), top_b=K)
    assert recall[f"recall@{K}"] < 0.3, recall  # chance is K/E = 0.125


def test_training_is_deterministic_and_uses_hidden_features() -> None:
    data = synthetic_set(60, seed=2, hidden_dim=4)
    a, curves_a = train_predictor(data, epochs=2, seed=5, width=16, progress=False)
    b, curves_b = train_predictor(data, epochs=2, seed=5, width=16, progress=False)
    assert curves_a == curves_b
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    # the normalisation is baked in: the training split's mean/std of the hidden and visual features
    assert a.hidden_mean.shape == (4,) and float(a.hidden_mean.mean()) == pytest.approx(50.0, abs=3.0)
    assert float(a.visual_std.mean()) == pytest.approx(0.1, rel=0.2)


def test_baselines() -> None:
    train, test = synthetic_set(300, seed=3), synthetic_set(100, seed=4)
    transfer = hot_recall(current_layer_transfer_scores(train, test), test.future, test.future_valid, ks=(K,), top_b=K)
    assert transfer[f"recall@{K}"] >= 0.9  # a permutation is exactly what a transition matrix captures
    chance = hot_recall(random_scores(test, np.random.default_rng(0)), test.future, test.future_valid, ks=(K,), top_b=K)
    assert chance[f"recall@{K}"] < 0.3
    freq = frequency_scores(train, test)
    assert freq.shape == (len(test), E) and np.allclose(freq[test.layer < L - 1].sum(axis=1), 1.0)
    # previous token: token t at layer i is scored by token t-1's shares at layer i+1, within one request
    prev = previous_token_scores(test)
    first, second = 10 * L + 2, 11 * L + 2  # layer 2 of tokens 10 and 11 (request 1 starts at token 10)
    np.testing.assert_array_equal(prev[second], test.future[first, 0])
    np.testing.assert_array_equal(prev[first], test.history[first, 0])  # the first token falls back to its layer i
    prefill = test.subset(np.arange(len(test)))
    prefill.phase[:] = 0
    np.testing.assert_array_equal(previous_token_scores(prefill), prefill.history[:, 0])


def test_calibration_round_trip(tmp_path: Path) -> None:
    data = synthetic_set(12, seed=5, hidden_dim=3)
    path = save_calibration(tmp_path / "cal.npz", data)
    back = load_calibration(path)
    for name in ("history", "hidden", "visual", "layer", "future", "future_valid", "request", "phase"):
        np.testing.assert_array_equal(getattr(back, name), getattr(data, name))
    assert (back.num_layers, back.num_experts, back.window, back.top_k) == (L, E, 3, K)
    np.savez(tmp_path / "bad.npz", layer=np.zeros(3))
    with pytest.raises(VismmoeError, match="missing history"):
        load_calibration(tmp_path / "bad.npz")


def _exported(tmp_path: Path, form: str, hidden_dim: int) -> tuple[LookaheadMLP, Path]:
    torch.manual_seed(0)
    model = LookaheadMLP(L, E, hidden_dim, form=form, width=32, top_b=6, gamma=0.7)
    with torch.no_grad():  # non-trivial normalisation and BatchNorm statistics, as after training
        for buffer in model.buffers():
            if buffer.dtype.is_floating_point:
                buffer.copy_(torch.rand_like(buffer) + 0.5)
    return model.eval(), export_onnx(model, tmp_path / f"{form}-{hidden_dim}" / PREDICTOR_FILENAME)


@pytest.mark.parametrize("form", ["window", "per_layer"])
@pytest.mark.parametrize("hidden_dim", [0, 8])
def test_onnx_matches_torch(tmp_path: Path, form: str, hidden_dim: int) -> None:
    model, path = _exported(tmp_path, form, hidden_dim)
    assert check_export(model, path, atol=1e-4, batches=(1, 7)) <= 1e-4
    session = PredictorSession(path, prefer_gpu=True)
    assert session.provider in ("CUDAExecutionProvider", "CPUExecutionProvider")
    inputs = random_inputs(model.metadata(), batch=7, seed=3)
    scores = session.run(*inputs)
    assert scores.shape == ((7, 5, E) if form == "per_layer" else (7, E))
    assert ((scores > 0) & (scores < 1)).all()
    torch_session = TorchPredictorSession(model)
    assert torch_session.provider == "torch"
    np.testing.assert_allclose(torch_session.run(*inputs), scores, atol=1e-4)
    history_3d = inputs[0].reshape(7, 3, E)  # [B, H, E] is accepted too
    np.testing.assert_allclose(session.run(history_3d, *inputs[1:]), scores, atol=0)


def test_metadata_round_trip(tmp_path: Path) -> None:
    model, path = _exported(tmp_path, "per_layer", 8)
    expected = {
        "form": "per_layer", "window": 5, "top_b": 6, "gamma": 0.7, "num_layers": L, "num_experts": E,
        "history": 3, "hidden_dim": 8,
    }  # fmt: skip
    assert read_metadata(path) == expected == model.metadata()
    assert PredictorSession(path, prefer_gpu=False).metadata == expected


def test_broken_predictor_file_is_one_line_error(tmp_path: Path) -> None:
    _, good = _exported(tmp_path, "window", 0)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not an onnx model\n" * 10)
    for path in (truncated, garbage, tmp_path / "missing.onnx"):
        with pytest.raises(VismmoeError) as info:
            PredictorSession(path)
        message = str(info.value)
        assert "\n" not in message and str(path) in message, message
