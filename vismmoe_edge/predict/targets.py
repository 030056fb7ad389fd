"""What the lookahead predictor learns: decayed hot-set targets (VisMMOE).

The hot set of a layer is its top-B experts by activation share among those with a share > 0 (ties go to the
lower expert index; fewer than B when fewer experts were used). A layer w steps ahead counts gamma^(w-1): the
nearer layer matters more, since its prefetch has the least time to hide behind compute.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Form = Literal["window", "per_layer"]
FORMS: tuple[str, ...] = ("window", "per_layer")


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """[..., k] indices of the k largest scores along the last axis, ties to the lower index."""
    k = min(k, scores.shape[-1])
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def hot_mask(shares: np.ndarray, top_b: int) -> np.ndarray:
    """bool [..., E]: the top-B experts by share among those used (share > 0)."""
    top = top_indices(shares, top_b)
    mask = np.zeros(shares.shape, dtype=bool)
    np.put_along_axis(mask, top, True, axis=-1)
    return mask & (shares > 0)


def decay(window: int, gamma: float) -> np.ndarray:
    """float32 [W]: gamma^(w-1) for w = 1..W."""
    return (gamma ** np.arange(window)).astype(np.float32)


def decayed_targets(
    future: np.ndarray, future_valid: np.ndarray, top_b: int = 20, gamma: float = 0.8, form: Form = "window"
) -> np.ndarray:
    """Soft targets from the next W layers' shares future [N, W, E] and future_valid [N, W].

    window: [N, E], target[e] = max over valid w of gamma^(w-1) * 1[e in hot(i+w)].
    per_layer: [N, W, E], target[w, e] = gamma^(w-1) * 1[e in hot(i+w)], zero where w is invalid
    (the loss masks those rows out).
    """
    if form not in FORMS:
        raise ValueError(f"form {form!r}: use one of {', '.join(FORMS)}")
    hot = hot_mask(future, top_b) & future_valid[..., None]
    per_layer = hot.astype(np.float32) * decay(future.shape[1], gamma)[None, :, None]
    return per_layer if form == "per_layer" else per_layer.max(axis=1)
