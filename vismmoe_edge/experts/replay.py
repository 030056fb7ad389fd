"""Routing-trace replay: routed expert ids come from a recorded trace instead of the model's router.

It lets the pipeline be timed with real routing on a synthetic checkpoint of any size. Each engine step
consumes as many trace rows as it has tokens; MoE layer i reads trace layer i mod (trace layers).
"""

from __future__ import annotations

import numpy as np
import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.trace import RoutingTrace


class TraceReplay:
    def __init__(self, trace: RoutingTrace, moe_layers: list[int], num_experts: int, *, start_token: int = 0) -> None:
        if trace.num_experts > num_experts:
            raise VismmoeError(
                f"trace {trace.source} routes over {trace.num_experts} experts, the model has only {num_experts}"
            )
        self.trace = trace
        self.trace_layer = {layer: i % trace.num_layers for i, layer in enumerate(moe_layers)}
        self.cursor = start_token
        self._rows = np.arange(0)
        k = trace.top_k
        self._weight = 1.0 / k  # replayed routing has no router probabilities: weigh the k experts alike

    def begin_step(self, phase: str, num_tokens: int) -> None:
        self._rows = (self.cursor + np.arange(num_tokens)) % self.trace.num_tokens
        self.cursor += num_tokens

    def end_step(self, phase: str, token_index: int) -> None:
        """Nothing to do: the cursor moved when the step began."""

    def route(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        if num_tokens != len(self._rows):
            raise RuntimeError(f"replay step has {len(self._rows)} rows, layer {layer} sees {num_tokens} tokens")
        ids = torch.from_numpy(self.trace.expert_ids[self._rows, self.trace_layer[layer]].astype(np.int64))
        return ids, torch.full(ids.shape, self._weight)
