"""The quantized slot pool's compute (experts/quant_pool.py, quant/slot_form.py) on the CPU: the graph-replayable
gather path, the in-place path and prefill all equal F.linear on the dequantized weights; the gather path reads no
slot id on the host (what a CUDA graph needs, checked on fake tensors); slots rebuilt in place from another layout
compute the same; a wrong layout is caught by these tolerances by orders of magnitude."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from vismmoe_edge.experts.pool_compute import grouped_mm_works, per_slot_experts
from vismmoe_edge.experts.quant_pool import (
    _int8_batched,
    decode_quantized,
    prefill_quantized,
    prefill_rowmajor_int4,
    reads_int4_in_place,
)
from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.quant.config import make_config
from vismmoe_edge.quant.kernels import dequantize_expert, dequantize_matrix, expert_views
from vismmoe_edge.quant.packing import ROWMAJOR, native_cpu_layout
from vismmoe_edge.quant.record import ExpertSpec, encode_expert
from vismmoe_edge.quant.slot_form import SlotForm

HIDDEN, INTER, SLOTS, K = 128, 96, 6, 4


def make_pool(
    bits: int, layout: str, seed: int = 0, *, hidden: int = HIDDEN, inter: int = INTER, group: int = 32
) -> tuple[ExpertSpec, torch.Tensor, list]:
    """SLOTS random experts as records in one [SLOTS, nbytes] tensor, and their dequantized float32 weights."""
    spec = ExpertSpec(make_config(bits, group if bits == 4 else None, layout), hidden, inter)
    g = torch.Generator().manual_seed(seed)
    records, dense = [], []
    for _ in range(SLOTS):
        gate_up = torch.randn(2 * inter, hidden, generator=g) * 0.05
        down = torch.randn(hidden, inter, generator=g) * 0.05
        buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in encode_expert(spec, gate_up, down)])
        records.append(buf)
        dense.append(dequantize_expert(expert_views(buf, spec)))
    return spec, torch.stack(records), dense


def reference(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, dense: list) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j, s in enumerate(slots[t].tolist()):
            gate_up, down = dense[s]
            gate, up = F.linear(x[t : t + 1].float(), gate_up).chunk(2, dim=-1)
            out[t] += (F.linear(F.silu(gate) * up, down) * weights[t, j].float())[0]
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_gather_and_in_place_match_the_dequantized_weights(bits: int, dtype: torch.dtype) -> None:
    spec, records, dense = make_pool(bits, native_cpu_layout() or ROWMAJOR if bits == 4 else ROWMAJOR)
    form = SlotForm.for_device(spec, torch.device("cpu"))
    x = torch.randn(1, HIDDEN).to(dtype)
    slots = torch.tensor([[4, 0, 5, 2]])
    weights = torch.softmax(torch.randn(1, K), -1).to(dtype)
    ref = reference(x, slots, weights, dense)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: activations and outputs rounded (docs/quantization.md)
    for gather in (True, False):
        assert rel(decode_quantized(x, slots, weights, records, form, F.silu, gather=gather), ref) < tol, gather
    if bits == 8:  # the batched dequantize path CUDA takes for int8 by default, here on CPU tensors
        assert rel(_int8_batched(x, records.index_select(0, slots[0]), weights, form, F.silu), ref) < tol


@pytest.mark.parametrize("bits", [4, 8])
def test_the_gather_path_reads_no_slot_id_on_the_host(bits: int) -> None:
    """Run on fake tensors (no data): reading a slot id on the host (`.tolist()`, `.item()`) raises, as it would
    break a CUDA graph. The gather path runs through; the in-place path, which does read them, is caught."""
    spec, records, _ = make_pool(bits, native_cpu_layout() or ROWMAJOR if bits == 4 else ROWMAJOR)
    form = SlotForm.for_device(spec, torch.device("cpu"))
    mode = FakeTensorMode()
    real = (torch.randn(1, HIDDEN), torch.tensor([[1, 3, 0, 2]]), torch.full((1, K), 0.25), records)
    x, slots, weights, pool = (mode.from_tensor(t) for t in real)
    with mode:
        assert decode_quantized(x, slots, weights, pool, form, F.silu, gather=True).shape == (1, HIDDEN)
        with pytest.raises(DataDependentOutputException):
            decode_quantized(x, slots, weights, pool, form, F.silu, gather=False)


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_matches_the_dequantized_weights(bits: int) -> None:
    spec, records, dense = make_pool(bits, native_cpu_layout() or ROWMAJOR if bits == 4 else ROWMAJOR, seed=1)
    form = SlotForm.for_device(spec, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, HIDDEN, generator=g)
    slots = torch.stack([torch.randperm(SLOTS, generator=g)[:K] for _ in range(9)])  # every slot, some many times
    weights = torch.softmax(torch.randn(9, K, generator=g), -1)
    assert rel(prefill_quantized(x, slots, weights, records, form, F.silu), reference(x, slots, weights, dense)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_prefill_of_triton_form_slots_is_the_per_slot_dequantize_path(dtype: torch.dtype) -> None:
    """Slots in row-major nibbles (the Triton decode form) prefill by dequantizing a chunk of slots at once: the
    same weights as dequantize_matrix, so slot by slot (no grouped GEMM) the output equals the per-slot
    dequantize + F.linear path (CUDA's) exactly, chunk boundaries included; grouped, within float rounding. Under
    TRITON_INTERPRET=1 the slots are dequantized by kernels/dequant_int4.py, to the same results."""
    spec, records, dense = make_pool(4, ROWMAJOR, seed=4)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    assert form.triton_int4 and not form.rebuilds
    g = torch.Generator().manual_seed(5)
    x = torch.randn(11, HIDDEN, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(SLOTS, generator=g)[:K] for _ in range(11)])
    weights = torch.softmax(torch.randn(11, K, generator=g), -1).to(dtype)

    def per_slot(slot: int, rows: torch.Tensor) -> torch.Tensor:
        expert = form.views(records[slot])
        gate, up = F.linear(rows, dequantize_matrix(expert.gate_up, dtype)).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, dequantize_matrix(expert.down, dtype))

    expected = per_slot_experts(x, slots, weights, per_slot)
    for chunk in (1, 4, SLOTS):
        got = prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=False, chunk=chunk)
        assert torch.equal(got, expected), chunk
        # a pinned layer's slots (run): every slot a group, found on the device, the unrouted ones empty
        run = prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=False, chunk=chunk,
                                    run=(0, SLOTS))  # fmt: skip
        assert torch.equal(run, expected), chunk
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel(got, reference(x, slots, weights, dense)) < tol
    if grouped_mm_works(dtype, torch.device("cpu")):
        grouped = prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=True, chunk=4)
        assert rel(grouped, reference(x, slots, weights, dense)) < tol
        run = prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=True, chunk=4, run=(0, SLOTS))
        assert torch.equal(run, grouped)
    if md.HAS_TRITON and md.INTERPRET:  # no dequantized copy: kernels/grouped_int4.py reads the codes in place
        assert reads_int4_in_place(records, form, dtype)
        in_place = prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=True, in_place=True)
        assert rel(in_place, reference(x, slots, weights, dense)) < tol
        run = prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=True, in_place=True,
                                    run=(0, SLOTS))  # fmt: skip
        assert torch.equal(run, in_place)


def test_a_slot_rebuilt_from_another_layout_computes_the_same() -> None:
    spec, records, dense = make_pool(4, ROWMAJOR, seed=2)
    form = SlotForm.for_device(spec, torch.device("cpu"))
    if native_cpu_layout() is None:
        pytest.skip("this torch has no CPU int4 kernel")
    assert form.rebuilds
    for s in range(SLOTS):
        form.build(records[s])
    x, slots, weights = torch.randn(1, HIDDEN), torch.tensor([[0, 1, 2, 3]]), torch.full((1, K), 0.25)
    assert rel(decode_quantized(x, slots, weights, records, form, F.silu), reference(x, slots, weights, dense)) < 1e-5


def test_a_wrong_layout_is_far_outside_the_tolerance() -> None:
    """Reading row-major nibbles as the CPU's tiles (a wrong layout label) moves outputs by O(1), five orders of
    magnitude above the 1e-5 the right layout stays within."""
    native = native_cpu_layout()
    if native is None:
        pytest.skip("this torch has no CPU int4 kernel")
    spec, records, dense = make_pool(4, ROWMAJOR, seed=4)
    wrong = SlotForm(spec, torch.device("cpu"), {"gate_up_proj": native, "down_proj": native}, {})
    x, slots, weights = torch.randn(1, HIDDEN), torch.tensor([[0, 1, 2, 3]]), torch.full((1, K), 0.25)
    assert rel(decode_quantized(x, slots, weights, records, wrong, F.silu), reference(x, slots, weights, dense)) > 0.1
