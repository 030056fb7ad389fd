"""A MoE layer's quantized experts computed from a slot pool: `records` uint8 [slots, nbytes], one expert's bytes
per row in the SlotForm of the device (slot_form.py). These are functions of the pool's tensors only, so any tier
that keeps such a tensor (host slots, GPU slots, slots in pinned memory a GPU reads) computes with them.

- decode (one token): on CUDA the k routed slots are gathered with one index_select into a fresh [k, nbytes]
  buffer, then each expert is two kernel calls on fixed views of it. The slot ids are read on the device, shapes
  never change, and nothing syncs with the host: a CUDA graph replays it (torch has no grouped int4 GEMM, so k
  pairs of GEMVs it is). int8 under the "dequantize" path dequantizes the k gathered experts at once and runs
  two batched GEMMs instead. On the CPU the experts are read where they are (no gather copy).
- prefill (many tokens): tokens sorted by slot, then each slot in use computes its tokens as one GEMM through
  the same kernels (int4 slots in the Triton decode form, row-major nibbles on CUDA: dequantized to the compute
  dtype, then F.linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vismmoe_edge.experts.pool_compute import gathered_experts, per_slot_experts
from vismmoe_edge.quant.kernels import expert_forward, int8_cuda_path
from vismmoe_edge.quant.slot_form import SlotForm

Act = Callable[[torch.Tensor], torch.Tensor]


def _int8_batched(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, form: SlotForm, act: Act):
    """One token through k gathered int8 experts: dequantize them together, two batched GEMMs."""
    dtype = x.dtype
    gate_up = form.batched(chosen, "gate_up_proj.qweight").to(dtype) * form.batched(chosen, "gate_up_proj.scales").to(
        dtype
    ).unsqueeze(-1)  # [k, 2I, H]
    down = form.batched(chosen, "down_proj.qweight").to(dtype) * form.batched(chosen, "down_proj.scales").to(
        dtype
    ).unsqueeze(-1)  # [k, H, I]
    return gathered_experts(x, gate_up, down, weights, act)


def decode_quantized(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    form: SlotForm,
    act: Act,
    *,
    gather: bool | None = None,
) -> torch.Tensor:
    """x [1, H], slots and weights [1, k] -> [1, H]. `gather` (default: on CUDA) reads the slot ids on the device
    (the graph-replayable path); without it they are read on the host and the slots used in place."""
    if gather is None:
        gather = records.device.type == "cuda"
    k = slots.shape[1]
    if gather:
        chosen = records.index_select(0, slots[0])  # [k, nbytes]
        if form.spec.quant.bits == 8 and records.device.type == "cuda" and int8_cuda_path() == "dequantize":
            return _int8_batched(x, chosen, weights, form, act)
        rows = [chosen[i] for i in range(k)]
    else:
        rows = [records[s] for s in slots[0].tolist()]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for i, row in enumerate(rows):
        out += expert_forward(x, form.views(row), act).to(torch.float32) * weights[0, i].to(torch.float32)
    return out.to(x.dtype)


def prefill_quantized(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, records: torch.Tensor, form: SlotForm, act: Act
) -> torch.Tensor:
    """x [T, H], slots and weights [T, k] -> [T, H], each (token, expert) pair once, one GEMM per slot in use."""
    return per_slot_experts(x, slots, weights, lambda slot, rows: expert_forward(rows, form.views(records[slot]), act))


def pool_forward(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, records: torch.Tensor, form: SlotForm, act: Act
) -> torch.Tensor:
    """OffloadedExperts.pool_compute for a quantized pool: decode for one token, prefill otherwise."""
    if x.shape[0] == 1:
        return decode_quantized(x, slots, weights, records, form, act)
    return prefill_quantized(x, slots, weights, records, form, act)
