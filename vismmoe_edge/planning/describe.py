"""`vismmoe-edge info`: what a checkpoint holds and how its experts fit a memory budget, without loading it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.checkpoint_info import CheckpointInfo, as_checkpoint_info
from vismmoe_edge.config import parse_budget
from vismmoe_edge.planning.weights import WeightBytes, weight_bytes
from vismmoe_edge.units import format_bytes

# Resident parts worth naming: always-on shared experts (GLM-4.5V) and the MLPs of dense decoder layers
# (GLM's first_k_dense_replace, Qwen's mlp_only_layers).
SHARED_EXPERT_KEY = re.compile(r"\.layers\.\d+\.mlp\.shared_experts?\.")
DENSE_MLP_KEY = re.compile(r"\.layers\.(?P<layer>\d+)\.mlp\.(gate|up|down)_proj\.weight$")


def resident_parts(resident: dict[str, TensorInfo]) -> dict[str, int]:
    """Bytes of the shared experts and of the dense-layer MLPs among the resident tensors."""
    shared = sum(i.nbytes for n, i in resident.items() if SHARED_EXPERT_KEY.search(n))
    dense = {n: i for n, i in resident.items() if DENSE_MLP_KEY.search(n)}
    return {
        "shared_expert_bytes": shared,
        "dense_mlp_bytes": sum(i.nbytes for i in dense.values()),
        "dense_mlp_layers": len({DENSE_MLP_KEY.search(n)["layer"] for n in dense}),  # type: ignore[index]
    }


def quant_name(spec: Any) -> str:
    """ "int4-g128" or "int8" (per output channel), for sizes quoted at the experts' stored form."""
    q = spec.quant
    return f"int{q.bits}-g{q.group_size}" if q.bits == 4 else f"int{q.bits}"


def quant_summary(spec: Any) -> dict[str, Any]:
    """What `info` says of quantized experts (`spec` is the catalogue's quant.record.ExpertSpec)."""
    q = spec.quant
    return {
        "bits": q.bits,
        "group_size": q.group_size,
        "layout": q.layout,
        "bytes_per_expert": spec.nbytes,
        "bf16_bytes_per_expert": spec.dense_nbytes_bf16,
        "ratio_to_bf16": round(spec.nbytes / spec.dense_nbytes_bf16, 4),
        "source": q.source.get("quant_method") or "dense",
    }


def describe_checkpoint(
    model: Path | CheckpointInfo,
    memory_budget: str = "100%",
    *,
    bits: int | None = None,
    dense_bits: int | None = None,
    group_size: int | None = None,
) -> dict[str, Any]:
    """Sizes are as stored in the checkpoint (its dtype), or as `quantize --bits/--dense-bits` would write them;
    the budget is read against the same bytes."""
    info = as_checkpoint_info(model)
    family, config, catalogue = info.family, info.config, info.catalogue
    text = config.text_config
    weights = weight_bytes(info, bits=bits, dense_bits=dense_bits, group_size=group_size)
    layer_bytes = weights.bytes_per_expert * catalogue.num_experts
    total = weights.expert_bytes
    resident_tensors = info.resident_tensors
    resident = weights.resident_bytes
    budget = parse_budget(memory_budget, total)
    fits = [
        {"pinned_layers": n, "pinned_bytes": n * layer_bytes, "cache_bytes": budget - n * layer_bytes}
        for n in range(len(catalogue.moe_layers) + 1)
        if n * layer_bytes + (weights.bytes_per_expert if n < len(catalogue.moe_layers) else 0) <= budget
    ]
    return {
        "model_dir": str(info.model_dir),
        "architecture": family.architecture,
        "expert_layout": catalogue.layout,
        "dtype": _dtype_name(catalogue, weights, group_size),
        "quantization": None if catalogue.quant is None else quant_summary(catalogue.quant),
        "layers": text.num_hidden_layers,
        "moe_layers": len(catalogue.moe_layers),
        "experts_per_layer": catalogue.num_experts,
        "top_k": text.num_experts_per_tok,
        "shared_experts": family.shared_experts(config),
        "bytes_per_expert": weights.bytes_per_expert,
        "expert_bytes_per_layer": layer_bytes,
        "resident_bytes": resident,
        "parts": weights.as_dict(),
        **resident_parts(resident_tensors),
        "total_expert_bytes": total,
        "memory_budget": memory_budget,
        "memory_budget_bytes": budget,
        "pinned_depths_that_fit": fits,
    }


def _dtype_name(catalogue: Any, weights: WeightBytes, group_size: int | None) -> str:
    if catalogue.quant is not None:
        return quant_name(catalogue.quant)
    if weights.planned:
        return f"int{weights.bits}" + (f"-g{group_size or 128}" if weights.bits == 4 else "") + " (planned)"
    return catalogue.dtype


def format_parts(p: dict[str, Any]) -> list[str]:
    """One line per part of the non-expert weights, as `info` prints them."""
    names = [("embedding_bytes", "token embedding"), ("lm_head_bytes", "lm_head"), ("attention_bytes", "attention"),
             ("mlp_bytes", "dense/shared MLPs"), ("other_language_bytes", "routers, norms"),
             ("vision_bytes", "vision tower")]  # fmt: skip
    lines = [f"  {label:<18} {format_bytes(p[key])}" for key, label in names]
    if p["embedding_on_disk_bytes"]:
        lines[0] += f" held ({format_bytes(p['embedding_on_disk_bytes'])} read by row from disk)"
    return lines


def format_description(d: dict[str, Any]) -> str:
    fits = d["pinned_depths_that_fit"]
    lines = [
        f"model          {d['model_dir']}",
        f"architecture   {d['architecture']} (experts stored {d['expert_layout']}, {d['dtype']})",
        f"layers         {d['layers']} ({d['moe_layers']} MoE)",
        f"experts        {d['experts_per_layer']} per layer, top-{d['top_k']}, {d['shared_experts']} shared",
        f"per expert     {format_bytes(d['bytes_per_expert'])} ({format_bytes(d['expert_bytes_per_layer'])} per layer)",
    ]
    if q := d.get("quantization"):
        group = f"group {q['group_size']}" if q["bits"] == 4 else "per output channel"
        lines.append(
            f"quantized      int{q['bits']}, {group}, layout {q['layout']}: {q['bytes_per_expert']:,} B per expert "
            f"= {q['ratio_to_bf16']:.3f}x bf16 (from {q['source']})"
        )
    p = d["parts"]
    planned = ""
    if p["planned"]:
        dense = f" --dense-bits {p['dense_bits']}" if p["dense_bits"] else ""
        planned = f", as `quantize --bits {p['bits']}{dense}` would write them"
    lines += [
        f"resident       {format_bytes(d['resident_bytes'])} of non-expert weights (always in memory{planned})",
        *format_parts(p),
    ]
    if d["shared_expert_bytes"] or d["dense_mlp_bytes"]:
        lines.append(
            f"  of which     {format_bytes(d['shared_expert_bytes'])} shared experts, "
            f"{format_bytes(d['dense_mlp_bytes'])} dense MLPs ({d['dense_mlp_layers']} dense layers)"
        )
    lines += [
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
