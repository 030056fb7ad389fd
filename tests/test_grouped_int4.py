"""kernels/grouped_int4.py: the grouped GEMM reading int4 slots in place equals torch's grouped GEMM on the
dequantized weights (Triton's interpreter on the CPU; the GPU checks judge the sums' order by the near-tie rule)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.test_quant_pool import HIDDEN, SLOTS, make_pool
from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.kernels.grouped_int4 import BLOCK_M, grouped_int4_mm, tile_plan
from vismmoe_edge.kernels.slot_matrix import record_matrix
from vismmoe_edge.quant.kernels import dequantize_matrix
from vismmoe_edge.quant.packing import ROWMAJOR
from vismmoe_edge.quant.slot_form import SlotForm

needs_interpreter = pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs TRITON_INTERPRET=1")


def test_tile_plan_covers_every_row_once() -> None:
    counts = torch.tensor([0, 1, BLOCK_M, BLOCK_M + 1, 0, 3 * BLOCK_M])
    ends = torch.cumsum(counts, 0).to(torch.int32)
    group, row, tiles = tile_plan(ends, int(ends[-1]))
    assert tiles == int(ends[-1]) // BLOCK_M + len(counts)
    covered = torch.zeros(int(ends[-1]), dtype=torch.long)
    for g, r in zip(group.tolist(), row.tolist(), strict=True):
        if g == len(counts):  # past the last tile
            continue
        start = int(ends[g - 1]) if g else 0
        assert start <= r < int(ends[g]) and (r - start) % BLOCK_M == 0
        covered[r : min(r + BLOCK_M, int(ends[g]))] += 1
    assert (covered == 1).all()
    assert int((group < len(counts)).sum()) == sum(-(-c // BLOCK_M) for c in counts.tolist())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gate_up_proj", "down_proj"])
def test_grouped_int4_matches_the_dequantized_grouped_gemm(dtype: torch.dtype, name: str) -> None:
    spec, records, _ = make_pool(4, ROWMAJOR, seed=7)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    w = record_matrix(records, form, name)
    g = torch.Generator().manual_seed(8)
    counts = [0, 3, BLOCK_M + 5, 1, 0, 2 * BLOCK_M]  # empty groups, a partial tile, whole and split tiles
    group_slots = torch.tensor([2, 0, 5, 1, 3, 4])
    assert len(counts) == SLOTS
    xs = (torch.randn(sum(counts), w.k, generator=g)).to(dtype)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    got = grouped_int4_mm(xs, w, group_slots, ends)
    assert got.shape == (sum(counts), w.n) and got.dtype == dtype
    start = 0
    for slot, end in zip(group_slots.tolist(), ends.tolist(), strict=True):
        weight = dequantize_matrix(getattr(form.views(records[slot]), name.removesuffix("_proj")), dtype)
        want = F.linear(xs[start:end].float(), weight.float())
        if end > start:
            tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's rounding
            assert ((got[start:end].float() - want).abs().max() / want.abs().max()).item() < tol, slot
        start = end
    assert HIDDEN in (w.n, w.k)


def test_refuses_groups_below_32() -> None:
    spec, records, _ = make_pool(4, ROWMAJOR, seed=7, group=16)
    w = record_matrix(records, SlotForm.for_device(spec, torch.device("cpu"), triton=True), "down_proj")
    with pytest.raises(ValueError, match="grouped_int4_mm: group 16"):
        grouped_int4_mm(torch.zeros(1, w.k), w, torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.int32))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_are_the_dequantized_files_element_for_element(dtype: torch.dtype) -> None:
    """One-hot rows read the weights back: each equals dequantize_matrix's value exactly (the same float32 steps,
    the same rounding to the compute dtype)."""
    spec, records, _ = make_pool(4, ROWMAJOR, seed=9)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    w = record_matrix(records, form, "gate_up_proj")
    eye = torch.eye(w.k, dtype=dtype)
    got = grouped_int4_mm(eye, w, torch.tensor([3]), torch.tensor([w.k], dtype=torch.int32))
    assert torch.equal(got.t(), dequantize_matrix(form.views(records[3]).gate_up, dtype))
