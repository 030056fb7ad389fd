"""The lookahead predictor's inputs, computed the same way at calibration and at run time.

At MoE layer i of one step (a prefill, or one decode token) the predictor sees:
- history: each expert's share of the activations of the tokens of interest at layers i, i-1, ..., i-H+1;
- hidden: the hidden state entering layer i's experts, mean-pooled over the tokens of interest;
- visual: the mean of the kept visual embeddings (zeros for a text-only prompt), reused through decode.
Calibration also records, for evaluation only, what the next-layer-gate baseline would score (`next_gate`: the
next MoE layer's router applied to the same tokens' hidden states), since only the live model has the routers.
Tokens of interest: in prefill the visual tokens still in the sequence (all before the compression cut, the
kept ones after it), or every token of a text-only prompt; in decode the one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from vismmoe_edge.predict.simple import next_gate_demand

HISTORY = 3
WINDOW = 5


def routing_shares(top_k_index: torch.Tensor, rows: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """[E] float32: each expert's share of the activations of the selected rows (sums to 1)."""
    index = top_k_index if rows is None or rows.shape[0] != top_k_index.shape[0] else top_k_index[rows]
    if index.numel() == 0:
        index = top_k_index
    counts = torch.bincount(index.flatten().cpu(), minlength=num_experts).float()
    return counts / counts.sum().clamp(min=1)


def pooled_hidden(hidden: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """[D] float32 mean over the selected rows (all rows when the selection does not apply or is empty)."""
    if rows is not None and rows.shape[0] == hidden.shape[0] and bool(rows.any()):
        hidden = hidden[rows]
    return hidden.float().mean(dim=0).cpu()


def history_matrix(shares: dict[int, torch.Tensor], position: int, num_experts: int, depth: int) -> torch.Tensor:
    """[depth, E]: the shares at MoE positions position, position-1, ...; zeros where there is no such layer."""
    rows = [shares.get(position - h, torch.zeros(num_experts)) for h in range(depth)]
    return torch.stack(rows)


@dataclass
class FeatureRecorder:
    """A route hook plus a step observer on an Engine: one calibration sample per (step, MoE layer)."""

    engine: object
    window: int = WINDOW
    history: int = HISTORY
    samples: dict[str, list] = field(default_factory=lambda: {k: [] for k in _KEYS})
    request: int = -1
    _shares: dict[int, torch.Tensor] = field(default_factory=dict)
    _hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    _next_gate: dict[int, torch.Tensor] = field(default_factory=dict)
    _phase: int = 0

    def __post_init__(self) -> None:
        catalogue = self.engine.catalogue
        self.position = {layer: i for i, layer in enumerate(catalogue.moe_layers)}
        self.num_experts = catalogue.num_experts
        self.engine.experts.route_hooks.append(self._on_route)
        self.engine.observers.append(self)

    def close(self) -> None:
        self.engine.experts.route_hooks.remove(self._on_route)
        self.engine.observers.remove(self)

    def _on_route(self, layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        rows = self.engine.interest_rows
        i = self.position[layer]
        self._shares[i] = routing_shares(index, rows, self.num_experts)
        self._hidden[i] = pooled_hidden(hidden, rows)
        self._next_gate[i] = torch.zeros(self.num_experts)
        layers = self.engine.catalogue.moe_layers
        if i + 1 < len(layers):
            selected = hidden[rows] if rows is not None and rows.shape[0] == hidden.shape[0] and rows.any() else hidden
            gate = self.engine.language_model.layers[layers[i + 1]].mlp.gate.weight
            self._next_gate[i] = next_gate_demand(selected.to(gate.dtype), gate, index.shape[1])

    def begin_step(self, phase: str, num_tokens: int) -> None:
        if phase == "prefill":
            self.request += 1
        self._phase = 0 if phase == "prefill" else 1
        self._shares, self._hidden, self._next_gate = {}, {}, {}

    def end_step(self, phase: str, token_index: int) -> None:
        visual = self.engine.visual_summary
        num_layers = len(self.position)
        for i in sorted(self._shares):
            future = torch.zeros(self.window, self.num_experts)
            valid = torch.zeros(self.window, dtype=torch.bool)
            for w in range(self.window):
                if i + 1 + w < num_layers and (i + 1 + w) in self._shares:
                    future[w], valid[w] = self._shares[i + 1 + w], True
            s = self.samples
            s["history"].append(history_matrix(self._shares, i, self.num_experts, self.history))
            s["hidden"].append(self._hidden[i])
            s["next_gate"].append(self._next_gate[i])
            s["visual"].append(visual.cpu() if visual is not None else torch.zeros_like(self._hidden[i]))
            s["layer"].append(i)
            s["future"].append(future)
            s["future_valid"].append(valid)
            s["request"].append(self.request)
            s["phase"].append(self._phase)

    def arrays(self) -> dict[str, np.ndarray]:
        s = self.samples
        if not s["layer"]:
            raise ValueError("no samples were recorded")
        return {
            "history": torch.stack(s["history"]).numpy().astype(np.float32),
            "hidden": torch.stack(s["hidden"]).numpy().astype(np.float32),
            "visual": torch.stack(s["visual"]).numpy().astype(np.float32),
            "layer": np.asarray(s["layer"], dtype=np.int64),
            "future": torch.stack(s["future"]).numpy().astype(np.float32),
            "future_valid": torch.stack(s["future_valid"]).numpy(),
            "request": np.asarray(s["request"], dtype=np.int64),
            "phase": np.asarray(s["phase"], dtype=np.int64),
            "next_gate": torch.stack(s["next_gate"]).numpy().astype(np.float32),
            "num_layers": np.asarray(len(self.position)),
            "num_experts": np.asarray(self.num_experts),
            "window": np.asarray(self.window),
            "top_k": np.asarray(self.engine.language_model.layers[self.engine.catalogue.moe_layers[0]].mlp.gate.top_k),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **self.arrays())
        return path


_KEYS = ("history", "hidden", "visual", "layer", "future", "future_valid", "request", "phase", "next_gate")
