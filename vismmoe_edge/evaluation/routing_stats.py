"""How concentrated is expert demand? Activation counts per (MoE layer, expert), gathered from route hooks."""

from __future__ import annotations

import torch

from vismmoe_edge.experts.compute import ExpertRuntime


class RoutingCounter:
    """Counts every token-to-expert activation, per MoE layer, while installed on an ExpertRuntime."""

    def __init__(self, runtime: ExpertRuntime, moe_layers: list[int], num_experts: int) -> None:
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.counts = torch.zeros(len(moe_layers), num_experts, dtype=torch.long)
        runtime.route_hooks.append(self._on_route)

    def _on_route(self, layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        self.counts[self.row[layer]] += torch.bincount(index.flatten().cpu(), minlength=self.counts.shape[1])


def top_share(counts: torch.Tensor, fraction: float = 0.25) -> torch.Tensor:
    """Per layer: the share of activations taken by the most used `fraction` of experts (uniform = fraction)."""
    k = max(1, int(counts.shape[1] * fraction))
    totals = counts.sum(dim=1).clamp(min=1)
    return counts.sort(dim=1, descending=True).values[:, :k].sum(dim=1) / totals


def usage_summary(counts: torch.Tensor) -> dict[str, object]:
    shares = top_share(counts)
    used = (counts > 0).sum(dim=1)
    return {
        "top25_share_per_layer": [round(float(s), 4) for s in shares],
        "top25_share_mean": round(float(shares.mean()), 4) if len(shares) else 0.0,
        "experts_used_per_layer": used.tolist(),
        "activations": int(counts.sum()),
    }
