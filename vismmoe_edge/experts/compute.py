"""The routed-experts module that replaces transformers' fused experts: same forward, weights from the pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from vismmoe_edge.experts.pipeline import ExpertKey, ExpertPipeline

RouteHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]  # layer, hidden, index, weights


class Predictor(Protocol):
    name: str

    def predict(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> list[tuple[ExpertKey, float]]:
        """After `layer` has routed: (key, score) of experts of later layers worth fetching now."""
        ...


class Router(Protocol):
    def route(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class ExpertRuntime:
    """What every OffloadedExperts module shares: the pipeline, the predictor, observers, a routing override."""

    pipeline: ExpertPipeline
    predictor: Predictor | None = None
    replay: Router | None = None  # trace replay: routed ids come from a trace, not from the model's router
    route_hooks: list[RouteHook] = field(default_factory=list)
    predict_seconds: float = 0.0


class OffloadedExperts(nn.Module):
    """forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], as transformers' experts.

    Resident experts are computed first, then the missing ones as they arrive, so compute stalls only on
    the one expert it needs next.
    """

    def __init__(self, layer: int, runtime: ExpertRuntime, act_fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.layer = layer
        self.runtime = runtime
        self.act_fn = act_fn

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        rt, pipeline = self.runtime, self.runtime.pipeline
        if rt.replay is not None:
            top_k_index, top_k_weights = rt.replay.route(self.layer, hidden_states.shape[0])
            top_k_index = top_k_index.to(hidden_states.device)
            top_k_weights = top_k_weights.to(hidden_states.device, hidden_states.dtype)
        for hook in rt.route_hooks:
            hook(self.layer, hidden_states, top_k_index, top_k_weights)
        order = pipeline.begin_layer(self.layer, torch.unique(top_k_index).tolist())
        if rt.predictor is not None:
            start = time.perf_counter()
            pipeline.prefetch(rt.predictor.predict(self.layer, hidden_states, top_k_index), current_layer=self.layer)
            rt.predict_seconds += time.perf_counter() - start

        start = time.perf_counter()
        stalled_before = pipeline.layer_log[-1].stall_s
        out = torch.zeros_like(hidden_states)
        index_by_slot = top_k_index.t()  # [k, T]: torch.where then yields (slot, token) pairs as transformers does
        for expert in order:
            slot, token = torch.where(index_by_slot == expert)
            weights = pipeline.acquire(self.layer, expert)
            gate, up = F.linear(hidden_states[token], weights.gate_up).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, weights.down) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
            pipeline.finish(self.layer, expert)
        stalled = pipeline.layer_log[-1].stall_s - stalled_before
        pipeline.record_compute(time.perf_counter() - start - stalled)
        return out
