"""One decode token's routed experts computed as their weights arrive, instead of after the last one has.

A layer whose experts are all resident runs them in one batched call (OffloadedExperts.pool_compute). Where some
are still being read into their slots (a miss: on a Jetson an NVMe read into a unified slot; on a desktop a copy
into a pinned or GPU slot), that call must wait for every read, so the compute idles for the reads' whole length
and the device's reads of the resident experts (over the bus, for slots in host memory) wait too. Here the experts
resident at the routing run at once as one batch, and the missing ones as their reads land (those that have
landed together as one batch), while the I/O threads read the rest. Each expert's output row is kept, and the
rows are summed at the end as the batched call sums them: the same operations on the same values. For bf16 slots
and quantized records the token's output is the batched call's bit for bit; for float32 slots on the CPU, whose
batched matmul rounds a row differently with the number of experts in the batch, it differs from it by that
rounding alone (~1e-7), and the engine's tokens and logits stay transformers' (tests/test_arrival.py). The rows
of int4 records on the GPU are Triton programs, a row each, the same whatever the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vismmoe_edge.experts.pool_compute import Act, expert_outputs, weighted_sum
from vismmoe_edge.experts.quant_pool import batched_int8, quantized_rows, sequential_sum

# x [1, H], slots [n], weights [1, n] -> the n experts' rows ([n, H], or n of [1, H])
Rows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Sequence[torch.Tensor]]
Total = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]  # rows stacked, weights [1, k], dtype


@dataclass(frozen=True)
class RowForm:
    """A pool's one-token computation as per-expert rows and their total [1, H] (the batched call is
    `total(rows(all k experts))`)."""

    rows: Rows
    total: Total


def row_form(pool: Any, act: Act) -> RowForm | None:
    """The rows and total of `pool`'s decode (OffloadedExperts.pool_compute's choice of path), or None where the
    path computes its experts together (int8 dequantized as a batch on CUDA)."""
    form = getattr(pool, "form", None)
    if form is None:

        def rows(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            return expert_outputs(x, pool.gate_up.index_select(0, slots), pool.down.index_select(0, slots), act)

        return RowForm(rows, weighted_sum)
    if form.triton_int4:
        from vismmoe_edge.kernels.moe_decode import fused_decode_records, use_triton_int4  # kernels/ imports us

        if use_triton_int4(pool.records, form):

            def int4_rows(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
                return fused_decode_records(x, slots.view(1, -1), weights, pool.records, form, act, summed=False)

            return RowForm(int4_rows, lambda rows, _weights, dtype: rows.sum(0, keepdim=True).to(dtype))
    gather = pool.records.device.type == "cuda"  # quant_pool.decode_quantized's default
    if gather and batched_int8(pool.records, form):
        return None

    def records_rows(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return quantized_rows(x, slots if gather else slots.cpu(), weights, pool.records, form, act, gather=gather)

    return RowForm(records_rows, lambda rows, _weights, dtype: sequential_sum(rows, dtype))


def compute_as_they_arrive(
    x: torch.Tensor,
    routed: list[int],
    weights: torch.Tensor,
    resident: list[int],
    reading: list[int],
    arrived: Callable[[list[int]], list[int]],
    slots_of: Callable[[list[int]], dict[int, int]],
    form: RowForm,
    device: torch.device,
) -> torch.Tensor:
    """x [1, H]; `routed`: the token's k experts in the router's order, `weights` [1, k] theirs; `resident`: those
    in slots now, computed first as one batch; `reading`: the others, each batch of them computed as `arrived`
    returns it (it waits until at least one has landed and returns all that have); `slots_of(batch)` acquires a
    batch's experts and returns their slots. -> [1, H]."""
    parts: list[torch.Tensor | None] = [None] * len(routed)

    def compute(batch: list[int]) -> None:
        slot_of = slots_of(batch)
        at = [j for j, expert in enumerate(routed) if expert in slot_of]
        # host -> device without a stream synchronisation: the rows queue behind the kernels already launched
        slots = torch.tensor([slot_of[routed[j]] for j in at]).to(device, non_blocking=True)
        positions = torch.tensor(at).to(weights.device, non_blocking=True)
        out = form.rows(x, slots, weights.index_select(1, positions))
        for row, j in enumerate(at):
            parts[j] = out[row]

    if resident:
        compute(resident)
    while reading:
        batch = arrived(reading)
        compute(batch)
        reading = [e for e in reading if e not in batch]
    assert all(p is not None for p in parts), "every routed expert computed"
    return form.total(torch.stack(parts), weights, x.dtype)  # type: ignore[arg-type]
