"""Run-time options that users type: memory budgets ("2GiB", "40%"), dtypes and devices."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.units import parse_size

if TYPE_CHECKING:
    from vismmoe_edge.checkpoint import ExpertCatalogue


def parse_budget(text: str, total_bytes: int) -> int:
    """Bytes from "2GiB", "1.5GB", "512MiB", "123456" or a share of `total_bytes` such as "40%"."""
    return parse_size(text, what="memory budget", total=total_bytes)


def cache_expert_bytes(catalogue: ExpertCatalogue, dtype: torch.dtype) -> int:
    """Bytes one routed expert takes in memory: converted to the compute dtype (quantized: its record). What the
    cache holds, so what the planner counts and what a percentage budget is a share of."""
    if catalogue.quant is not None:
        return catalogue.quant.nbytes
    loc = next(iter(catalogue.experts.values()))
    return sum(p.nbytes // TORCH_DTYPES[p.dtype].itemsize for p in loc.parts) * dtype.itemsize


def budget_bytes(memory_budget: str | int, catalogue: ExpertCatalogue, dtype: torch.dtype) -> int:
    """The expert budget in bytes: an int is bytes already; "40%" is a share of every routed expert at `dtype`
    (the one definition of a percentage budget); "2GiB" is a size."""
    if isinstance(memory_budget, int):
        if memory_budget < 0:
            raise VismmoeError(f"memory budget {memory_budget}: must not be negative")
        return memory_budget
    return parse_budget(memory_budget, cache_expert_bytes(catalogue, dtype) * len(catalogue.experts))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise VismmoeError(f"--device {name}: CUDA is not available to this torch build; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise VismmoeError(f"--device {name!r}: use auto, cpu, cuda or cuda:N")
    return torch.device(name)


DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' keeps the checkpoint's dtype, except float16 on the CPU (slow there), which becomes float32."""
    if name == "auto":
        if device.type == "cpu" and checkpoint_dtype == torch.float16:
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype.is_floating_point else torch.float32
    if name not in DTYPES:
        raise VismmoeError(f"--dtype {name!r}: use auto, float32, bfloat16 or float16")
    return DTYPES[name]
