"""The routed-experts module that replaces transformers' fused experts: same forward, weights from the cache."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from vismmoe_edge.experts.cache import ExpertCache

RouteHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class OffloadedExperts(nn.Module):
    """forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], as transformers' experts.

    Experts are fetched and computed one at a time in ascending id order (the order transformers' eager
    loop uses, so float accumulation matches), which keeps at most one streamed expert in flight.
    """

    def __init__(self, layer: int, cache: ExpertCache, act_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.cache = cache
        self.act_fn = act_fn
        self.route_hooks: list[RouteHook] = []

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        for hook in self.route_hooks:
            hook(self.layer, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        index_by_slot = top_k_index.t()  # [k, T]: torch.where then yields (slot, token) pairs as transformers does
        for expert in torch.unique(top_k_index).tolist():
            slot, token = torch.where(index_by_slot == expert)
            weights = self.cache.get(self.layer, expert)
            gate, up = F.linear(hidden_states[token], weights.gate_up).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, weights.down) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out
