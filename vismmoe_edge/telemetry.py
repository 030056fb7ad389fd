"""Per-step, per-layer telemetry: routed expert ids plus what the pipeline did, written as JSONL.

The same file trains the predictor later (`vismmoe-edge run --trace-out FILE.jsonl`).
"""

from __future__ import annotations

import torch

from vismmoe_edge.experts.compute import ExpertRuntime
from vismmoe_edge.trace import LayerRecord, TraceWriter


class TraceRecorder:
    """A step observer: collects each MoE layer's routing during a step and writes one record per step."""

    def __init__(
        self,
        runtime: ExpertRuntime,
        writer: TraceWriter,
        *,
        model: str,
        num_experts: int,
        moe_layers: list[int],
        top_k: int,
    ) -> None:
        self.runtime = runtime
        self.writer = writer
        self.request = 0
        self._routes: dict[int, torch.Tensor] = {}
        self._log_start = 0
        self._top_k = top_k
        writer.header(model=model, num_experts=num_experts, moe_layers=moe_layers, top_k=top_k)
        runtime.route_hooks.append(self._on_route)

    def _on_route(self, layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        self._routes[layer] = index.detach().cpu()

    def begin_step(self, phase: str, num_tokens: int) -> None:
        if phase == "prefill":
            self.request += 1
        self._routes = {}
        self._log_start = len(self.runtime.pipeline.layer_log)

    def end_step(self, phase: str, token_index: int) -> None:
        records = []
        for stats in self.runtime.pipeline.layer_log[self._log_start :]:
            experts = self._routes.get(stats.layer)
            if experts is None:
                continue
            records.append(
                LayerRecord(
                    layer=stats.layer,
                    experts=experts.numpy(),
                    hits=stats.hits,
                    misses=stats.misses,
                    stall_ms=stats.stall_s * 1000,
                    compute_ms=stats.compute_s * 1000,
                    bytes_read=stats.bytes_read,
                    prefetched_unused_bytes=stats.wasted_bytes,
                    resident_bytes=stats.resident_bytes,
                )
            )
        self.writer.step(request=self.request, phase=phase, token_index=token_index, layers=records)
