"""`vismmoe-edge info`: what a checkpoint holds and how its experts fit a memory budget, without loading it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vismmoe_edge.checkpoint import read_tensor_table
from vismmoe_edge.config import parse_budget
from vismmoe_edge.models import qwen3_vl_moe
from vismmoe_edge.units import format_bytes


def describe_checkpoint(model_dir: Path, memory_budget: str = "100%") -> dict[str, Any]:
    """Sizes are as stored in the checkpoint (its dtype); the budget is read against the same bytes."""
    config = qwen3_vl_moe.read_config(model_dir)
    table = read_tensor_table(model_dir)
    catalogue = qwen3_vl_moe.catalogue_for(config, table)
    text = config.text_config
    layer_bytes = catalogue.layer_bytes(catalogue.moe_layers[0])
    total = catalogue.total_bytes
    resident = sum(info.nbytes for name, info in table.items() if name not in catalogue.tensor_names)
    budget = parse_budget(memory_budget, total)
    fits = [
        {"pinned_layers": n, "pinned_bytes": n * layer_bytes, "cache_bytes": budget - n * layer_bytes}
        for n in range(len(catalogue.moe_layers) + 1)
        if n * layer_bytes + (catalogue.expert_bytes if n < len(catalogue.moe_layers) else 0) <= budget
    ]
    return {
        "model_dir": str(model_dir),
        "architecture": qwen3_vl_moe.ARCHITECTURE,
        "expert_layout": catalogue.layout,
        "dtype": catalogue.dtype,
        "layers": text.num_hidden_layers,
        "moe_layers": len(catalogue.moe_layers),
        "experts_per_layer": catalogue.num_experts,
        "top_k": text.num_experts_per_tok,
        "shared_experts": 0,
        "bytes_per_expert": catalogue.expert_bytes,
        "expert_bytes_per_layer": layer_bytes,
        "resident_bytes": resident,
        "total_expert_bytes": total,
        "memory_budget": memory_budget,
        "memory_budget_bytes": budget,
        "pinned_depths_that_fit": fits,
    }


def format_description(d: dict[str, Any]) -> str:
    fits = d["pinned_depths_that_fit"]
    lines = [
        f"model          {d['model_dir']}",
        f"architecture   {d['architecture']} (experts stored {d['expert_layout']}, {d['dtype']})",
        f"layers         {d['layers']} ({d['moe_layers']} MoE)",
        f"experts        {d['experts_per_layer']} per layer, top-{d['top_k']}, {d['shared_experts']} shared",
        f"per expert     {format_bytes(d['bytes_per_expert'])} ({format_bytes(d['expert_bytes_per_layer'])} per layer)",
        f"resident       {format_bytes(d['resident_bytes'])} of non-expert weights (always in memory)",
        f"experts total  {format_bytes(d['total_expert_bytes'])}",
        f"budget         {d['memory_budget']} = {format_bytes(d['memory_budget_bytes'])} of expert memory",
    ]
    if fits:
        deepest = fits[-1]
        lines.append(
            f"pinned prefix  0..{deepest['pinned_layers']} layers fit; at {deepest['pinned_layers']} the cache keeps "
            f"{format_bytes(deepest['cache_bytes'])} for streamed experts"
        )
    else:
        lines.append("pinned prefix  the budget is smaller than one expert: raise --memory-budget")
    return "\n".join(lines)
