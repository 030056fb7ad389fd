"""Quantizers, expert records and kernels: every kernel path against F.linear on the dequantized weights.

Tolerances: with float32 activations the CPU int4/int8 kernels dequantize to float32 and accumulate in float32,
so they agree with F.linear to float32 rounding (1e-5 relative). With bfloat16 activations the kernels round
their outputs to bf16 (half an ulp: at most 2^-8 relative), and expert_forward rounds twice (the gate/up output and
the result), plus a different accumulation order: 1% of the output's largest magnitude covers that with room,
while a wrong nibble order or a misplaced scale gives errors of order 100%.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import make_config
from vismmoe_edge.quant.kernels import (
    dequantize_expert,
    expert_forward,
    expert_views,
    linear,
    prepare,
    token_forward,
)
from vismmoe_edge.quant.packing import CPU_LAYOUTS, ROWMAJOR, native_cpu_layout
from vismmoe_edge.quant.quantize import quantize_int4, quantize_int8
from vismmoe_edge.quant.record import ExpertSpec, encode_expert

NATIVE = native_cpu_layout()
OTHER = next(name for name in CPU_LAYOUTS if name != NATIVE)


def weights(hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * inter, hidden, generator=g) * 0.02, torch.randn(hidden, inter, generator=g) * 0.02


def record(spec: ExpertSpec, seed: int = 0) -> torch.Tensor:
    """One expert's record as the file holds it: its tensors' bytes back to back."""
    gate_up, down = weights(spec.hidden, spec.inter, seed)
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in encode_expert(spec, gate_up, down)])


def reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x.float(), gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def test_int4_quantizer_error_is_half_a_step() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    q = quantize_int4(w, 128)
    err = (q.dequantize() - w).abs().view(64, 2, 128)
    # half a step, plus the bf16 rounding of the zero (<= 2^-8 |zero|) shifting the grid
    bound = 0.5 * q.scale + q.zero.abs() * 2**-8 + 1e-6
    assert (err <= bound[..., None]).all()
    assert q.codes.max() <= 15 and torch.equal(q.scale, q.scale.to(torch.bfloat16).float())


def test_int8_quantizer_error_is_half_a_step() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_int8(w)
    assert ((q.float() * scale.float()[:, None] - w).abs() <= 0.5 * scale.float()[:, None] * (1 + 2**-7)).all()


def test_record_sizes_at_30b_shapes() -> None:
    """The issue's budget: int4 g128 <= 0.28x the bf16 bytes, int8 <= 0.53x."""
    int4 = ExpertSpec(make_config(4, 128, NATIVE), 2048, 768)
    int8 = ExpertSpec(make_config(8, None, ROWMAJOR), 2048, 768)
    codes = (1536 * 2048 + 2048 * 768) // 2  # two per byte
    scales_zeros = (2048 // 128 * 1536 + 768 // 128 * 2048) * 2 * 2  # (scale, zero) in bf16 per group
    assert int4.nbytes == codes + scales_zeros == 2_506_752
    assert int4.nbytes / int4.dense_nbytes_bf16 <= 0.28  # 0.2656
    assert int8.nbytes / int8.dense_nbytes_bf16 <= 0.53  # 0.5004
    offsets = [f.offset for f in int4.fields]
    assert offsets == sorted(offsets) and int4.fields[-1].offset + int4.fields[-1].nbytes == int4.nbytes


def test_views_are_zero_copy_and_checked() -> None:
    spec = ExpertSpec(make_config(4, 32, NATIVE), 128, 96)
    buf = record(spec)
    e = expert_views(buf, spec)
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for t in (e.gate_up.qweight, e.gate_up.scales, e.down.qweight, e.down.scales):
        assert start <= t.data_ptr() < end
    with pytest.raises(VismmoeError) as err:
        expert_views(buf[:-2], spec)
    assert "\n" not in str(err.value) and "bytes" in str(err.value)


def test_dequantized_record_equals_quantizer() -> None:
    spec = ExpertSpec(make_config(4, 32, NATIVE), 128, 96)
    gate_up, down = weights(128, 96)
    gu, dn = dequantize_expert(expert_views(record(spec), spec))
    assert torch.equal(gu, quantize_int4(gate_up, 32).dequantize())
    assert torch.equal(dn, quantize_int4(down, 32).dequantize())


CASES = [  # bits, group, layout, hidden, inter
    (4, 128, NATIVE, 2048, 768),  # Qwen3-VL-30B-A3B experts, the CPU kernel in place
    (4, 32, NATIVE, 128, 96),
    (4, 16, NATIVE, 192, 48),  # the demo model's geometry: no kernel group fits, dequantize fallback
    (4, 32, ROWMAJOR, 128, 96),  # CPU-neutral file: repacked per call (warned)
    (8, None, ROWMAJOR, 2048, 768),
    (8, None, ROWMAJOR, 192, 48),
]


@pytest.mark.parametrize("bits,group,layout,hidden,inter", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_expert_forward_matches_dequantized_linear(bits, group, layout, hidden, inter, dtype, tol) -> None:
    spec = ExpertSpec(make_config(bits, group, layout), hidden, inter)
    e = expert_views(record(spec, seed=hidden), spec)
    gate_up, down = dequantize_expert(e)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the row-major case warns that it repacks
        y = expert_forward(x, e)
    assert y.dtype == dtype and y.shape == (5, hidden)
    assert rel_err(y, reference(x, gate_up, down)) < tol
    single = expert_forward(x[:1], e)  # decode: one token
    assert rel_err(single, reference(x[:1], gate_up, down)) < tol


def test_other_cpu_layout_computes_the_same_and_prepare_repacks() -> None:
    spec = ExpertSpec(make_config(4, 32, OTHER), 128, 96)
    e = expert_views(record(spec, seed=4), spec)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = expert_forward(x, e)
    assert any("repacking every call" in str(w.message) for w in caught)
    ready = prepare(e, torch.device("cpu"))
    assert ready.gate_up.layout == NATIVE and ready.down.layout == NATIVE
    assert torch.equal(expert_forward(x, ready), y)
    assert torch.equal(dequantize_expert(ready)[0], dequantize_expert(e)[0])
    assert rel_err(y, reference(x, *dequantize_expert(e))) < 1e-5


def test_token_forward_is_the_weighted_sum() -> None:
    spec = ExpertSpec(make_config(4, 32, NATIVE), 128, 96)
    experts = [expert_views(record(spec, seed=s), spec) for s in range(3)]
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(6))
    w = torch.tensor([0.5, 0.3, 0.2])
    want = sum(wi * reference(x, *dequantize_expert(e)) for wi, e in zip(w, experts, strict=True))
    assert rel_err(token_forward(x, experts, w), want) < 1e-5


def test_linear_checks_the_input_width() -> None:
    spec = ExpertSpec(make_config(8, None, ROWMAJOR), 128, 96)
    e = expert_views(record(spec), spec)
    with pytest.raises(ValueError, match="features"):
        linear(torch.zeros(1, 96), e.gate_up)
