"""The compiled decode token's dense projections (kernels/dense_gemv.py): one Triton program per block of rows,
against the float64 product rounded once, and the choice of projections that take it."""

from __future__ import annotations

import pytest
import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.kernels.dense_gemv import blocks, dense_gemv, dense_gemv_reference, gemv_projections

needs_interpreter = pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET,
                                       reason="needs Triton and TRITON_INTERPRET=1")  # fmt: skip


def test_blocks_give_enough_programs_at_30b_a3b_shapes() -> None:
    assert blocks(2048, 4096) == (2, 1024)  # o_proj: 1,024 programs, the fastest blocks of run 13's sweep
    assert blocks(128, 2048) == (1, 2048)  # the router: 128 programs, one step each
    assert blocks(5120, 2048) == (4, 512)  # q, k and v stacked: 1,280 programs
    for n, k in ((2048, 4096), (128, 2048), (5120, 2048), (3, 40)):
        rows, cols = blocks(n, k)
        assert rows & (rows - 1) == 0 and cols & (cols - 1) == 0 and rows * cols <= 2048


@needs_interpreter
@pytest.mark.parametrize(("n", "k", "dtype"), [(128, 2048, torch.bfloat16), (48, 200, torch.float32),
                                               (37, 96, torch.float16), (512, 64, torch.bfloat16)])  # fmt: skip
def test_dense_gemv_is_the_product_rounded_once_in_the_interpreter(n: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    y = dense_gemv(x, w)
    ref = dense_gemv_reference(x, w)
    assert y.shape == (1, n) and y.dtype == dtype
    # float32 sums in another order than float64's, and Triton's interpreter truncates float32 to bf16/fp16 where
    # the GPU rounds to nearest even: at most one rounding step of the output dtype apart
    ulp = torch.finfo(dtype).eps * ref.double().abs().clamp_min(1e-3)
    assert ((y.double() - ref.double()).abs() <= ulp + 1e-6).all()
    if dtype == torch.float32:
        assert torch.allclose(y, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-6)


@needs_interpreter
def test_dense_gemv_reads_rows_with_a_stride() -> None:
    """Rows of a taller weight at an offset, as the modules' k and v weights are views of the stacked q/k/v."""
    w = torch.randn(96, 64)
    x = torch.randn(1, 64)
    view = w[32:80]
    assert torch.allclose(dense_gemv(x, view), x @ view.T, rtol=1e-5, atol=1e-5)


def test_dense_gemv_refuses_what_it_cannot_compute() -> None:
    with pytest.raises(ValueError, match="x must be"):
        dense_gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous"):
        dense_gemv(torch.randn(1, 8), torch.randn(8, 4).T)


def test_gemv_projections_parse_and_refuse_unknown_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VISMMOE_DECODE_GEMV", raising=False)
    assert gemv_projections() == {"router", "o", "qkv"}
    assert gemv_projections("") == frozenset()
    assert gemv_projections(" qkv, o ,router") == {"qkv", "o", "router"}
    monkeypatch.setenv("VISMMOE_DECODE_GEMV", "o")
    assert gemv_projections() == {"o"}
    with pytest.raises(VismmoeError, match="VISMMOE_DECODE_GEMV='o,gate': unknown projection gate") as e:
        gemv_projections("o,gate")
    assert "\n" not in str(e.value)
