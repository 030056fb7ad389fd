"""The lookahead predictor's calibration data: one sample per (step, MoE layer), as `vismmoe-edge calibrate`
writes it (see routing_features.py for how each array is measured).

Arrays (N samples, H history layers, W window, E experts, D hidden size, which may be 0):
history [N, H, E], hidden [N, D], visual [N, D], layer [N], future [N, W, E], future_valid [N, W],
request [N], phase [N] (0 prefill, 1 decode); scalars num_layers, num_experts, window, top_k; optionally
next_gate [N, E], the next-layer-gate baseline's scores (evaluation only; files from before it lack it).
Samples of one request and phase at one layer are stored in time order (previous_token_scores relies on it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from vismmoe_edge.errors import VismmoeError

PREFILL, DECODE = 0, 1
_ARRAYS = ("history", "hidden", "visual", "layer", "future", "future_valid", "request", "phase")
_SCALARS = ("num_layers", "num_experts", "window", "top_k")
_DTYPES = {"layer": np.int64, "request": np.int64, "phase": np.int64, "future_valid": np.bool_}


@dataclass
class CalibrationSet:
    history: np.ndarray  # float32 [N, H, E]
    hidden: np.ndarray  # float32 [N, D]
    visual: np.ndarray  # float32 [N, D]
    layer: np.ndarray  # int64 [N]: position i in the model's list of MoE layers
    future: np.ndarray  # float32 [N, W, E]: shares at layers i+1..i+W
    future_valid: np.ndarray  # bool [N, W]
    request: np.ndarray  # int64 [N]
    phase: np.ndarray  # int64 [N]
    num_layers: int
    num_experts: int
    window: int
    top_k: int
    next_gate: np.ndarray | None = None  # float32 [N, E]: the next router on this layer's hidden states

    def __len__(self) -> int:
        return int(self.layer.shape[0])

    @property
    def history_len(self) -> int:
        return int(self.history.shape[1])

    @property
    def hidden_dim(self) -> int:
        return int(self.hidden.shape[1])

    def subset(self, index: np.ndarray) -> CalibrationSet:
        """The samples selected by a boolean mask or an index array (scalars kept)."""
        gate = None if self.next_gate is None else self.next_gate[index]
        return replace(self, next_gate=gate, **{name: getattr(self, name)[index] for name in _ARRAYS})

    @staticmethod
    def concatenate(sets: list[CalibrationSet]) -> CalibrationSet:
        """Several calibration files of one model as one set; request ids are renumbered to stay distinct."""
        first = sets[0]
        shape = (first.num_layers, first.num_experts, first.window)
        for other in sets[1:]:
            if (other.num_layers, other.num_experts, other.window) != shape:
                raise VismmoeError("calibration files come from different models or windows; calibrate them alike")
        offset, requests = 0, []
        for data in sets:
            requests.append(data.request + offset)
            offset += int(data.request.max()) + 1 if len(data) else 0
        arrays = {name: np.concatenate([getattr(d, name) for d in sets]) for name in _ARRAYS if name != "request"}
        gates = [d.next_gate for d in sets]
        gate = None if any(g is None for g in gates) else np.concatenate(gates)
        return replace(first, request=np.concatenate(requests), next_gate=gate, **arrays)

    def validate(self, source: str = "calibration data") -> None:
        """Raise a one-line VismmoeError when the arrays disagree with each other or with the scalars."""
        n, e, w = len(self), self.num_experts, self.window
        expected = {
            "history": (n, None, e),
            "hidden": (n, None),
            "visual": (n, self.hidden_dim),
            "future": (n, w, e),
            "future_valid": (n, w),
            "request": (n,),
            "phase": (n,),
        }
        for name, shape in expected.items():
            got = getattr(self, name).shape
            if len(got) != len(shape) or any(s is not None and g != s for g, s in zip(got, shape, strict=True)):
                want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise VismmoeError(f"{source}: {name} has shape {list(got)}, expected {want}; re-run calibrate")
        if self.next_gate is not None and self.next_gate.shape != (n, e):
            raise VismmoeError(f"{source}: next_gate has shape {list(self.next_gate.shape)}, expected [{n}, {e}]")
        if self.layer.ndim != 1 or (n and (self.layer.min() < 0 or self.layer.max() >= self.num_layers)):
            raise VismmoeError(f"{source}: layer must be 0..{self.num_layers - 1}; re-run calibrate")


def load_calibration(path: str | Path) -> CalibrationSet:
    """Read an .npz written by `vismmoe-edge calibrate` (or save_calibration); one-line VismmoeError if broken."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in _ARRAYS + _SCALARS if k not in npz.files]
            if missing:
                raise VismmoeError(f"{path}: not predictor calibration data (missing {', '.join(missing)})")
            arrays = {k: np.asarray(npz[k], dtype=_DTYPES.get(k, np.float32)) for k in _ARRAYS}
            scalars = {k: int(npz[k]) for k in _SCALARS}
            gate = np.asarray(npz["next_gate"], dtype=np.float32) if "next_gate" in npz.files else None
    except VismmoeError:
        raise
    except (OSError, ValueError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise VismmoeError(f"cannot read calibration data {path}: {reason}") from None
    data = CalibrationSet(**arrays, **scalars, next_gate=gate)
    data.validate(str(path))
    return data


def save_calibration(path: str | Path, data: CalibrationSet) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {f.name: getattr(data, f.name) for f in fields(data) if getattr(data, f.name) is not None}
    np.savez_compressed(path, **{k: np.asarray(v) for k, v in values.items()})
    return path


def split_by_request(
    data: CalibrationSet, val_requests: float | Sequence[int] | np.ndarray, seed: int = 0
) -> tuple[CalibrationSet, CalibrationSet]:
    """(train, validation), split by request so that no prompt is on both sides.

    val_requests: a share of the requests drawn at random from seed, or the explicit request ids to hold out.
    """
    requests = np.unique(data.request)
    if isinstance(val_requests, float | int) and not isinstance(val_requests, bool):
        share = float(val_requests)
        if not 0.0 <= share < 1.0:
            raise VismmoeError(f"validation share {share} must be in [0, 1)")
        count = min(len(requests) - 1, math.ceil(share * len(requests))) if share > 0 else 0
        held = np.random.default_rng(seed).permutation(requests)[:count]
    else:
        held = np.asarray(val_requests, dtype=np.int64)
    is_val = np.isin(data.request, held)
    return data.subset(~is_val), data.subset(is_val)
