"""A preallocated KV cache: per-layer K/V buffers of a fixed capacity, written in place one position at a time."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from vismmoe_edge.kernels.decode_layer import aligned_rows


class StaticCache:
    """Per-layer K/V buffers of a fixed capacity and, per layer, the number of positions filled.

    Layers may hold different lengths: after visual-token compression the layers past the pinned prefix saw
    fewer tokens. `update` is what transformers' attention modules call; it writes the new position in place.
    """

    def __init__(self, like: DynamicCache, capacity: int) -> None:
        first = like.layers[0].keys
        batch, heads, _, dim = first.shape
        self.capacity = capacity
        shape = (batch, heads, capacity, dim)
        self.keys = [torch.zeros(shape, dtype=first.dtype, device=first.device) for _ in like.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.lengths = aligned_rows(len(like.layers), torch.long, first.device)  # filled per layer
        self.positions = torch.arange(capacity, device=first.device)

    def fill(self, prefill: DynamicCache) -> None:
        """Take over the prefill's K/V (the buffers keep their addresses: captured graphs stay valid)."""
        lengths = [layer.keys.shape[2] for layer in prefill.layers]
        if max(lengths) >= self.capacity:
            raise ValueError(f"KV capacity {self.capacity} cannot hold {max(lengths)} prompt positions and a new one")
        for i, layer in enumerate(prefill.layers):
            self.keys[i][:, :, : lengths[i]] = layer.keys
            self.values[i][:, :, : lengths[i]] = layer.values
        self.lengths.copy_(torch.tensor(lengths))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        at = self.lengths[layer_idx : layer_idx + 1]
        self.keys[layer_idx].index_copy_(2, at, key_states)
        self.values[layer_idx].index_copy_(2, at, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def mask(self, layer_idx: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, 1, capacity]: 0 where this layer holds a position (the new one included), -inf elsewhere."""
        visible = self.positions <= self.lengths[layer_idx]
        zeros = torch.zeros(self.capacity, dtype=dtype, device=self.positions.device)
        return zeros.masked_fill(~visible, torch.finfo(dtype).min).view(1, 1, 1, -1)

    def advance(self) -> None:
        self.lengths += 1
