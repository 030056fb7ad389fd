"""The two simple predictors every learned one must beat.

- next-layer gate: apply the next MoE layer's router to the current layer's hidden state (the residual
  stream changes little between layers, so its top experts are a fair guess);
- previous token: the next layers will use what they used for the previous token (temporal locality).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vismmoe_edge.experts.pipeline import ExpertKey


def _following(layers: list[int], layer: int, depth: int) -> list[int]:
    i = layers.index(layer)
    return layers[i + 1 : i + 1 + depth]


def next_gate_demand(hidden: torch.Tensor, gate_weight: torch.Tensor, k: int) -> torch.Tensor:
    """[E] float32 on the CPU: the next router applied to these tokens' hidden states; each token adds its top-k
    probabilities, so an expert's score is the routing mass the next layer would give it."""
    probs = torch.softmax(F.linear(hidden, gate_weight).float(), dim=-1)  # [T, E]
    top_p, top_i = probs.topk(k, dim=-1)
    return torch.zeros(probs.shape[1]).index_add_(0, top_i.flatten().cpu(), top_p.flatten().cpu())


class NextLayerGatePredictor:
    name = "next-layer-gate"
    reads_device_hidden = True  # its GEMM runs where the hidden state is: it cannot run on a host copy

    def __init__(self, gate_weights: dict[int, torch.Tensor], *, top_b: int) -> None:
        self.gate_weights = gate_weights  # MoE layer -> router weight [E, H]; routers are tiny and resident
        self.layers = sorted(gate_weights)
        self.top_b = top_b

    @torch.no_grad()
    def predict(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> list[tuple[ExpertKey, float]]:
        following = _following(self.layers, layer, 1)
        if not following:
            return []
        nxt = following[0]
        demand = next_gate_demand(hidden, self.gate_weights[nxt], top_k_index.shape[1])
        scores, ids = demand.topk(min(self.top_b, int((demand > 0).sum())))
        return [((nxt, int(e)), float(s)) for s, e in zip(scores, ids, strict=True)]


class PreviousTokenPredictor:
    name = "previous-token"

    def __init__(self, moe_layers: list[int], *, depth: int = 1) -> None:
        self.layers = moe_layers
        self.depth = depth
        self.last: dict[int, list[int]] = {}  # MoE layer -> experts the last token used there

    def observe(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> None:
        """A route hook: remember the last token's experts at each layer."""
        self.last[layer] = top_k_index[-1].tolist()

    def predict(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> list[tuple[ExpertKey, float]]:
        requests = []
        for distance, nxt in enumerate(_following(self.layers, layer, self.depth)):
            for expert in self.last.get(nxt, []):
                requests.append(((nxt, expert), 1.0 / (1 + distance)))
        return requests
