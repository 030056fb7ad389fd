"""A MoE layer's quantized experts computed from a slot pool: `records` uint8 [slots, nbytes], one expert's bytes
per row in the SlotForm of the device (slot_form.py). These are functions of the pool's tensors only, so any tier
that keeps such a tensor (host slots, GPU slots, slots in pinned memory a GPU reads) computes with them.

- decode (one token): on CUDA the k routed slots are gathered with one index_select into a fresh [k, nbytes]
  buffer, then each expert is two kernel calls on fixed views of it. The slot ids are read on the device, shapes
  never change, and nothing syncs with the host: a CUDA graph replays it (torch has no grouped int4 GEMM, so k
  pairs of GEMVs it is). int8 under the "dequantize" path dequantizes the k gathered experts at once and runs
  two batched GEMMs instead. On the CPU the experts are read where they are (no gather copy).
- prefill (many tokens): tokens sorted by slot, then each slot in use computes its tokens as one GEMM through
  the same kernels; int4 slots in the Triton decode form (row-major nibbles, on CUDA), which no torch kernel
  reads, run kernels/grouped_int4.py's grouped GEMM reading the codes in place (else they are dequantized to the
  compute dtype a chunk of slots at a time, then torch's grouped GEMMs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vismmoe_edge.experts.pool_compute import (
    combine_pairs,
    expert_mlp,
    gathered_experts,
    grouped_mlp,
    grouped_mm_works,
    per_slot_experts,
    sort_by_slot,
)
from vismmoe_edge.quant.kernels import expert_forward, int8_cuda_path
from vismmoe_edge.quant.packing import unpack_rowmajor
from vismmoe_edge.quant.slot_form import SlotForm

Act = Callable[[torch.Tensor], torch.Tensor]
# Slots dequantized at once in an int4 prefill: at 30B-A3B shapes ~9.4 MB of bf16 weights each, plus ~20 MB of
# float32 transients on the torch path (not with Triton's kernel), so at most ~0.5 GB whatever the layer routes.
PREFILL_CHUNK = 16


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
    if gather and batched_int8(records, form):
        return _int8_batched(x, records.index_select(0, slots[0]), weights, form, act)
    return sequential_sum(quantized_rows(x, slots[0], weights, records, form, act, gather=gather), x.dtype)


def batched_int8(records: torch.Tensor, form: SlotForm) -> bool:
    """int8 records on CUDA where the experts are dequantized together (int8_cuda_path "dequantize")."""
    return form.spec.quant.bits == 8 and records.device.type == "cuda" and int8_cuda_path() == "dequantize"


def quantized_rows(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, records: torch.Tensor, form: SlotForm, act: Act,
    *, gather: bool,
) -> list[torch.Tensor]:  # fmt: skip
    """x [1, H], slots [n], weights [1, n] -> each expert's output times its weight, [1, H] float32 each. `gather`:
    the slot ids stay on the device (records.index_select); else they are read on the host and used in place."""
    chosen = records.index_select(0, slots) if gather else [records[s] for s in slots.tolist()]
    return [expert_forward(x, form.views(row), act).to(torch.float32) * weights[0, i].to(torch.float32)
            for i, row in enumerate(chosen)]  # fmt: skip


def sequential_sum(rows: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Rows [1, H] float32 added one after another into zeros (the order fixes the rounding) -> [1, H] in dtype."""
    out = torch.zeros_like(rows[0])
    for row in rows:
        out += row
    return out.to(dtype)


def prefill_quantized(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    form: SlotForm,
    act: Act,
    run: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [T, H], slots and weights [T, k] -> [T, H], each (token, expert) pair once, one GEMM per slot in use
    (int4 slots in the Triton form: `prefill_rowmajor_int4`, which takes a pinned layer's `run`)."""
    if form.triton_int4:
        grouped = grouped_mm_works(x.dtype, x.device)
        in_place = records.is_cuda and reads_int4_in_place(records, form, x.dtype)
        return prefill_rowmajor_int4(x, slots, weights, records, form, act, grouped=grouped, run=run,
                                     in_place=in_place)  # fmt: skip
    return per_slot_experts(x, slots, weights, lambda slot, rows: expert_forward(rows, form.views(records[slot]), act))


def prefill_rowmajor_int4(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    form: SlotForm,
    act: Act,
    *,
    grouped: bool,
    chunk: int = PREFILL_CHUNK,
    run: tuple[int, int] | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """The prefill of int4 slots in row-major nibbles (which no torch kernel takes): the slots in use are
    dequantized `chunk` at a time, each chunk with a few batched ops (the per-slot path ran ~10 small kernels and
    their host work per expert: 6,144 experts a prompt at 30B-A3B, 1.4-3.1 s on the H200), then one grouped GEMM
    per projection over the chunk (`grouped`), or one GEMM per slot. The weights are dequantize_matrix's, element
    for element, so without `grouped` the result is that of the per-slot path on CUDA (dequantize_matrix, then
    F.linear, slot by slot) bit for bit. `run` (first, count): the slots are one pinned layer's experts, every one
    of which is a group (unrouted ones empty), so no host read waits for the slots in use to be found.
    `in_place`: no dequantized copy; kernels/grouped_int4.py's grouped GEMM reads the codes where they lie (the
    same weights, sums in another order), with no host read at all for a `run`."""
    order, token_of, xs = sort_by_slot(x, slots)
    sorted_slots = slots.reshape(-1)[order]
    if run is None:
        used, counts = torch.unique_consecutive(sorted_slots, return_counts=True)
        ends = torch.cumsum(counts, 0)
    else:
        used = torch.arange(run[0], run[0] + run[1], device=slots.device)
        ends = torch.searchsorted(sorted_slots, used, right=True)
    if in_place:
        from vismmoe_edge.kernels.grouped_int4 import grouped_int4_mm  # (kernels imports experts: not at the top)
        from vismmoe_edge.kernels.slot_matrix import record_matrix

        offs = ends.to(torch.int32)
        gate_up = grouped_int4_mm(xs, record_matrix(records, form, "gate_up_proj"), used, offs)
        gate, up = gate_up.chunk(2, dim=-1)
        y = grouped_int4_mm(act(gate) * up, record_matrix(records, form, "down_proj"), used, offs)
        return combine_pairs(x, y, weights, order, token_of)
    bounds = [0, *ends.tolist()]  # one host read per layer: where each slot's pairs start
    y = torch.empty(xs.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    for c0 in range(0, used.shape[0], chunk):
        c1 = min(c0 + chunk, used.shape[0])
        gate_up = dequantize_slots(records, form, used[c0:c1], "gate_up_proj", x.dtype)  # [c, 2I, H]
        down = dequantize_slots(records, form, used[c0:c1], "down_proj", x.dtype)  # [c, H, I]
        if grouped:
            offs = (ends[c0:c1] - bounds[c0]).to(torch.int32)
            y[bounds[c0] : bounds[c1]] = grouped_mlp(xs[bounds[c0] : bounds[c1]], gate_up, down, offs, act)
            continue
        for i in range(c1 - c0):
            part = slice(bounds[c0 + i], bounds[c0 + i + 1])
            y[part] = expert_mlp(xs[part], gate_up[i], down[i], act)
    return combine_pairs(x, y, weights, order, token_of)


def reads_int4_in_place(records: torch.Tensor, form: SlotForm, dtype: torch.dtype) -> bool:
    """Whether kernels/grouped_int4.py takes these slots: Triton, bf16 or float32 inputs, groups it supports."""
    from vismmoe_edge.kernels.grouped_int4 import supported
    from vismmoe_edge.kernels.moe_int4 import HAS_TRITON

    if not HAS_TRITON or dtype not in (torch.bfloat16, torch.float32):
        return False
    group = form.spec.quant.group_size
    return all(supported(group, k) for _, k in form.spec.matrices.values())


def dequantize_slots(
    records: torch.Tensor, form: SlotForm, slot_ids: torch.Tensor, name: str, dtype: torch.dtype
) -> torch.Tensor:
    """Matrix `name` of the slots `slot_ids` [c] in row-major nibbles -> [c, N, K] in `dtype`: with Triton one
    kernel reading the records in place (kernels/dequant_int4.py), else the slots gathered and dequantize_rowmajor;
    the same values either way."""
    # imported here: kernels/ imports experts/
    from vismmoe_edge.kernels.dequant_int4 import dequantize_int4_slots
    from vismmoe_edge.kernels.slot_matrix import record_matrix, use_triton_int4

    if use_triton_int4(records, form):
        return dequantize_int4_slots(record_matrix(records, form, name), slot_ids, dtype)
    return dequantize_rowmajor(form, records.index_select(0, slot_ids), name, dtype)


def dequantize_rowmajor(form: SlotForm, chosen: torch.Tensor, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Matrix `name` of c slots' records in row-major nibbles [c, nbytes] -> [c, N, K] in `dtype`: quant.kernels.
    dequantize_matrix batched over the slots (the same float32 operations, element for element)."""
    n, k = form.spec.matrices[name]
    g = form.spec.quant.group_size
    codes = unpack_rowmajor(form.batched(chosen, f"{name}.qweight")).to(torch.float32).view(-1, n, k // g, g)
    sz = form.batched(chosen, f"{name}.scales_zeros").to(torch.float32)  # [c, K/g, N, 2]
    scale, zero = sz[..., 0].transpose(1, 2), sz[..., 1].transpose(1, 2)  # [c, N, K/g]
    return ((codes - 8.0) * scale[..., None] + zero[..., None]).view(-1, n, k).to(dtype)


def pool_forward(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    form: SlotForm,
    act: Act,
    run: tuple[int, int] | None = None,
) -> torch.Tensor:
    """OffloadedExperts.pool_compute for a quantized pool: decode for one token, prefill otherwise (`run`: the
    slots are one pinned layer's, prefill_rowmajor_int4)."""
    if x.shape[0] == 1:
        return decode_quantized(x, slots, weights, records, form, act)
    return prefill_quantized(x, slots, weights, records, form, act, run)
