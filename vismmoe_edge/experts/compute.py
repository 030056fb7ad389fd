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
from vismmoe_edge.experts.store import ExpertWeights

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
    lock_report: object | None = None  # unified memory: what of the pinned prefix mlock could hold


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
        index_cpu = top_k_index.cpu()  # one sync per layer: the routing decides what to fetch anyway
        experts, counts = torch.unique(index_cpu, return_counts=True)
        order = pipeline.begin_layer(self.layer, experts.tolist(), (counts / index_cpu.shape[0]).tolist())
        if rt.predictor is not None:
            start = time.perf_counter()
            pipeline.prefetch(rt.predictor.predict(self.layer, hidden_states, top_k_index), current_layer=self.layer)
            rt.predict_seconds += time.perf_counter() - start

        start = time.perf_counter()
        stalled_before = pipeline.layer_log[-1].stall_s
        out = torch.zeros_like(hidden_states)
        pool = getattr(pipeline.tier, "pool", None)
        if hidden_states.shape[0] == 1 and pool is not None and self._all_ready(order):
            out = self._decode_from_pool(hidden_states, index_cpu[0], top_k_weights, order, pool)
        elif hidden_states.shape[0] == 1:  # decode: one token, each routed expert once; no index juggling
            slot_of = {int(e): j for j, e in enumerate(index_cpu[0])}
            for expert in order:
                weights = pipeline.acquire(self.layer, expert)
                out += self._expert(hidden_states, weights) * top_k_weights[:, slot_of[expert], None]
                pipeline.finish(self.layer, expert)
        else:
            by_slot = index_cpu.t()  # [k, T]: torch.where then yields (slot, token) pairs as transformers does
            for expert in order:
                slot, token = torch.where(by_slot == expert)
                slot, token = slot.to(out.device), token.to(out.device)
                weights = pipeline.acquire(self.layer, expert)
                y = self._expert(hidden_states[token], weights) * top_k_weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
                pipeline.finish(self.layer, expert)
        stalled = pipeline.layer_log[-1].stall_s - stalled_before
        pipeline.record_compute(time.perf_counter() - start - stalled)
        return out

    def _all_ready(self, order: list[int]) -> bool:
        pipeline = self.runtime.pipeline
        return all(pipeline.is_streamed_and_loaded(self.layer, e) for e in order)

    def _decode_from_pool(
        self, x: torch.Tensor, routed: torch.Tensor, top_k_weights: torch.Tensor, order: list[int], pool
    ) -> torch.Tensor:
        """All k experts of one token sit in GPU slots: gather them and run two batched GEMMs.

        Eight small launches instead of five per expert; on a GPU the per-launch host cost is what limits
        decode (a token's GEMMs move ~75 MB, microseconds of HBM time).
        """
        pipeline = self.runtime.pipeline
        slots = []
        for expert in order:
            pipeline.acquire(self.layer, expert)
            slots.append(pipeline.slot_of(self.layer, expert))
        index = torch.tensor(slots, device=x.device)
        gate_up = pool.gate_up.index_select(0, index)  # [k, 2I, H]
        down = pool.down.index_select(0, index)  # [k, H, I]
        gate, up = torch.matmul(gate_up, x[0]).chunk(2, dim=-1)  # [k, I] each
        y = torch.matmul(down, (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)  # [k, H]
        position = {int(e): j for j, e in enumerate(routed)}
        weights = top_k_weights[0, [position[e] for e in order]]  # [k]
        out = (y * weights[:, None]).sum(0, keepdim=True).to(x.dtype)
        for expert in order:
            pipeline.finish(self.layer, expert)
        return out

    def _expert(self, x: torch.Tensor, weights: ExpertWeights) -> torch.Tensor:
        gate, up = F.linear(x, weights.gate_up).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, weights.down)
