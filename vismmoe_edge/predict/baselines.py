"""Baselines for the next layer's experts, as scores [N, E] in the metrics' shape (higher = more likely at i+1).

All of them need only expert ids (shares), no hidden states or gate weights, so they run on a pure routing trace.
A next-layer-gate baseline (the next router applied to this layer's hidden state) lives in simple.py: it needs
the model's gate weights, which calibration data does not carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vismmoe_edge.predict.calibration import DECODE, CalibrationSet


def random_scores(data: CalibrationSet, generator: np.random.Generator) -> np.ndarray:
    """Uniform random scores: what chance looks like (recall@k = k/E in expectation)."""
    return generator.random((len(data), data.num_experts), dtype=np.float32)


def layer_frequency(train: CalibrationSet) -> np.ndarray:
    """float32 [L, E]: each expert's mean activation share at each MoE layer over the training samples."""
    freq = np.zeros((train.num_layers, train.num_experts), dtype=np.float64)
    counts = np.bincount(train.layer, minlength=train.num_layers)
    np.add.at(freq, train.layer, train.history[:, 0])
    return (freq / np.maximum(counts, 1)[:, None]).astype(np.float32)


def frequency_scores(train: CalibrationSet, test: CalibrationSet) -> np.ndarray:
    """Static popularity: layer i+1's expert frequencies from the training data, whatever the input."""
    freq = np.concatenate([layer_frequency(train), np.zeros((1, train.num_experts), np.float32)])
    return freq[np.minimum(test.layer + 1, train.num_layers)]  # the row of zeros past the last layer


def previous_token_scores(data: CalibrationSet, per_token_phases: Sequence[int] = (DECODE,)) -> np.ndarray:
    """Temporal locality: what the previous token of the same request used at layer i+1.

    Applies to samples of one token (decode; pass (PREFILL, DECODE) for a per-token prefill trace): the previous
    sample of the same request, phase and layer, in storage order, is the previous token. Other samples (a
    prefill summary, or the first token) fall back to the current layer's shares, history[:, 0].
    """
    scores = data.history[:, 0].copy()
    order = np.lexsort((np.arange(len(data)), data.layer, data.phase, data.request))
    key = np.stack([data.request, data.phase, data.layer], axis=1)[order]
    same = np.zeros(len(data), dtype=bool)
    same[1:] = (key[1:] == key[:-1]).all(axis=1)
    current, previous = order[same], order[np.flatnonzero(same) - 1]
    per_token = np.isin(data.phase[current], np.asarray(per_token_phases))
    current, previous = current[per_token], previous[per_token]
    scores[current] = data.future[previous, 0]
    return scores


def transfer_matrix(train: CalibrationSet) -> np.ndarray:
    """float32 [L, E, E]: P(expert f at layer i+1 | expert e at layer i), counted on training data.

    Each sample adds the outer product of its shares at i and i+1 (for one token: 1/k^2 per co-activated pair),
    and each row is divided by expert e's total share at i, so rows are proportional to the conditional.
    """
    L, E = train.num_layers, train.num_experts
    counts = np.zeros((L, E, E), dtype=np.float64)
    for i in range(L):
        rows = np.flatnonzero((train.layer == i) & train.future_valid[:, 0])
        if len(rows):
            now, nxt = train.history[rows, 0].astype(np.float64), train.future[rows, 0].astype(np.float64)
            counts[i] = now.T @ nxt
    totals = counts.sum(axis=2, keepdims=True)
    return (counts / np.where(totals > 0, totals, 1.0)).astype(np.float32)


def current_layer_transfer_scores(train: CalibrationSet, test: CalibrationSet) -> np.ndarray:
    """The transfer matrix of layer i applied to the current layer's shares: sum_e share_i(e) * P(f | e)."""
    matrix = transfer_matrix(train)
    scores = np.zeros((len(test), test.num_experts), dtype=np.float32)
    for i in range(train.num_layers):  # per layer: one [n, E] @ [E, E] instead of an [N, E, E] gather
        rows = np.flatnonzero(test.layer == i)
        scores[rows] = test.history[rows, 0] @ matrix[i]
    return scores
