"""How good is a lookahead prediction for the next MoE layer (i+1)?

- hot recall@k: of layer i+1's hot set (top-B experts by share among those used), the fraction that is in the
  top-k predicted experts; what a k-slot prefetch would have caught of what matters most.
- wasted prefetch share@k: of the top-k predicted experts, the share that layer i+1 did not use at all; the
  bytes a k-slot prefetch would have read for nothing.
Scores are [N, E] (window form and every baseline) or [N, W, E] (per_layer form: head w = 1 is used).
Only samples whose layer i+1 exists (future_valid[:, 0]) count. Ties in the scores go to the lower index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vismmoe_edge.predict.targets import hot_mask, top_indices


def next_layer(scores: np.ndarray, future: np.ndarray, future_valid: np.ndarray) -> tuple[np.ndarray, ...]:
    """(scores [M, E], shares [M, E], sample index [M]) for the samples that have a layer i+1."""
    scores = np.asarray(scores)
    if scores.ndim == 3:
        scores = scores[:, 0]
    if scores.shape[0] != future.shape[0] or scores.shape[-1] != future.shape[-1]:
        raise ValueError(f"scores {scores.shape} do not match future {future.shape}")
    index = np.flatnonzero(future_valid[:, 0])
    return scores[index], future[index, 0], index


def _per_layer(values: np.ndarray, layer: np.ndarray | None) -> dict[int, float] | None:
    if layer is None:
        return None
    return {int(i): float(values[layer == i].mean()) for i in np.unique(layer)}


def _summarise(name: str, per_sample: dict[int, np.ndarray], layer: np.ndarray | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, values in per_sample.items():
        out[f"{name}@{k}"] = float(values.mean()) if len(values) else float("nan")
    if layer is not None:
        out["per_layer"] = {f"{name}@{k}": _per_layer(v, layer) for k, v in per_sample.items()}
    return out


def hot_recall(
    scores: np.ndarray,
    future: np.ndarray,
    future_valid: np.ndarray,
    ks: Sequence[int] = (10, 20, 30),
    top_b: int = 20,
    layer: np.ndarray | None = None,
) -> dict[str, Any]:
    """{"recall@k": mean over samples, ..., "samples": M, "per_layer": {"recall@k": {i: mean}} when layer given}."""
    pred, shares, index = next_layer(scores, future, future_valid)
    hot = hot_mask(shares, top_b)
    sizes = hot.sum(axis=1)
    keep = sizes > 0  # a valid layer always routes somewhere; this guards against empty rows in hand-made data
    per_sample = {}
    for k in ks:
        picked = np.take_along_axis(hot, top_indices(pred, k), axis=1).sum(axis=1)
        per_sample[k] = picked[keep] / sizes[keep]
    out = _summarise("recall", per_sample, None if layer is None else layer[index][keep])
    out["samples"] = int(keep.sum())
    return out


def wasted_prefetch_share(
    scores: np.ndarray,
    future: np.ndarray,
    future_valid: np.ndarray,
    ks: Sequence[int] = (10, 20, 30),
    layer: np.ndarray | None = None,
) -> dict[str, Any]:
    """{"wasted@k": mean share of the top-k predicted experts with share 0 at layer i+1, ..., "samples": M}."""
    pred, shares, index = next_layer(scores, future, future_valid)
    unused = shares <= 0
    per_sample = {}
    for k in ks:
        top = top_indices(pred, k)
        per_sample[k] = np.take_along_axis(unused, top, axis=1).sum(axis=1) / top.shape[1]
    out = _summarise("wasted", per_sample, None if layer is None else layer[index])
    out["samples"] = len(index)
    return out
