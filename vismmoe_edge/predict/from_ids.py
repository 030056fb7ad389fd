"""Calibration samples from per-token expert ids alone (a routing trace, or a synthetic routing process).

Each token at each MoE layer i gives one sample: history = its own shares at layers i..i-H+1 (one-hot / k), future =
its shares at layers i+1..i+W. There are no hidden states, so D = 0.
"""

from __future__ import annotations

import numpy as np

from vismmoe_edge.predict.calibration import PREFILL, CalibrationSet


def id_shares(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 [T, L, E]: each token's share per expert at each layer, from ids [T, L, k] (1/k per chosen id)."""
    tokens, layers, k = ids.shape
    shares = np.zeros((tokens, layers, num_experts), dtype=np.float32)
    t, layer = np.meshgrid(np.arange(tokens), np.arange(layers), indexing="ij")
    np.add.at(shares, (t[..., None], layer[..., None], ids.astype(np.int64)), 1.0 / k)
    return shares


def samples_from_ids(
    ids: np.ndarray,
    request: np.ndarray,
    num_experts: int,
    *,
    history: int = 3,
    window: int = 5,
    phase: int = PREFILL,
) -> CalibrationSet:
    """One sample per (token, layer), token-major (a token's layers are consecutive; tokens keep their order).

    ids: [T, L, k] expert ids per token and MoE layer; request: [T] which prompt each token belongs to.
    """
    tokens, layers, k = ids.shape
    shares = id_shares(ids, num_experts)
    # pad H-1 empty layers before and W after, so every window is a plain slice of the padded axis
    before = np.zeros((tokens, history - 1, num_experts), np.float32)
    after = np.zeros((tokens, window, num_experts), np.float32)
    padded = np.concatenate([before, shares, after], axis=1)
    i = np.arange(layers)
    back = (i[:, None] + history - 1 - np.arange(history)[None, :]).reshape(-1)  # layers i, i-1, ..
    ahead = (i[:, None] + history + np.arange(window)[None, :]).reshape(-1)  # layers i+1, .., i+W
    n = tokens * layers
    valid = (i[:, None] + 1 + np.arange(window)[None, :]) < layers
    return CalibrationSet(
        history=padded[:, back].reshape(n, history, num_experts),
        hidden=np.zeros((n, 0), np.float32),
        visual=np.zeros((n, 0), np.float32),
        layer=np.tile(i, tokens).astype(np.int64),
        future=padded[:, ahead].reshape(n, window, num_experts),
        future_valid=np.broadcast_to(valid, (tokens, layers, window)).reshape(n, window).copy(),
        request=np.repeat(np.asarray(request, dtype=np.int64), layers),
        phase=np.full(n, phase, dtype=np.int64),
        num_layers=layers,
        num_experts=num_experts,
        window=window,
        top_k=k,
    )
