"""One decode token's dense projection y = x @ W.T as one Triton program per block of W's rows.

At batch 1 cuBLAS picks kernels that are far from HBM speed for some of the compiled decode token's projections
(run 11's profile of the 48-layer 30B-A3B token on an H200, docs/benchmarks.md): o_proj ([2048, 4096], 16.8 MB
of bf16) is a split-K GEMM and its reduction, 7.1 + 1.7 us a layer for a 3.9 us byte bound, two kernels with a
gap between them; the router's GEMV ([128, 2048], 0.5 MB) takes 5.0 us, all latency. Here each program streams
`BLOCK_N` rows of W in blocks of `BLOCK_K` columns, keeps the products per column in float32 and reduces the row
once at the end, then rounds to W's dtype as F.linear does (cuBLAS accumulates in float32 too; the order of the
sums differs, so the GPU checks take the near-tie rule, as for every compiled kernel). One kernel, enough programs
to cover the SMs, no split-K.

The blocks are chosen from the shape, not autotuned: the op runs inside the compiled decode layer
(kernels/decode_layer.py), where a fixed grid is what inductor calls most simply, and a shape gives enough
programs by itself (o_proj 1,024 programs of 2 rows x 1,024 columns, the router 128 of one row). On an H100 (run
13's sweep, docs/benchmarks.md) those o_proj blocks took 5.3 us alone in a graph (the weight can stay in L2 there),
the earlier 8 x 512 8.9 us and cuBLAS 13.6 us.

`dense_gemv` is a `torch.library.triton_op`; eager code (the CPU) keeps F.linear. `VISMMOE_DECODE_GEMV` chooses
which projections of the compiled token take a Triton kernel ("router,o,qkv" by default, "" none:
`gemv_projections`): "o" and "qkv" this GEMV; "router" the router of kernels/decode_router.py `route_and_lookup`,
GEMV, top-k and table lookup in one kernel, whose GEMV is this one's loop (it shares `blocks`). o_proj joined
the default in run 15: with the 2 x 1,024 blocks the resident 48-layer token ran at 257.8 tok/s on an H100
against 246.9 with o_proj on cuBLAS (both trials of each within 0.1%); with run 12's 8 x 512 blocks it had been
slower (15.2 us a layer inside the token against cuBLAS's 10.1). qkv joined in run 16 (an H100): 257.6 tok/s
(257.46, 257.77) against 256.4 (256.08, 256.64) with qkv on cuBLAS, a small gain but in every trial, and alone in
a graph 7.1 against cuBLAS's 7.7 us, its rows 0.12 rounding steps from float64 against cuBLAS's 0.75 (run 13 had
8.8 against 7.6 us alone; run 15 10.4 against 11.2).
"""

from __future__ import annotations

import os

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.kernels.moe_decode import triton_op

PROJECTIONS = ("qkv", "o", "router")
DEFAULT_PROJECTIONS = "router,o,qkv"  # o_proj: 4.4% faster tokens than cuBLAS in run 15; qkv: 0.5% in run 16
TILE = 2048  # elements of W a program holds per step: 16 per thread at 4 warps
# programs aimed at (an H200 has 132 SMs; more programs of fewer rows ran faster in run 13):
# rows per program = N / this, a power of two, <= 16
TARGET_ROWS = 1024


def gemv_projections(value: str | None = None) -> frozenset[str]:
    """`VISMMOE_DECODE_GEMV` (or `value`): a comma-separated subset of qkv, o and router; empty for none."""
    text = os.environ.get("VISMMOE_DECODE_GEMV", DEFAULT_PROJECTIONS) if value is None else value
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(names - set(PROJECTIONS))
    if unknown:
        raise VismmoeError(
            f"VISMMOE_DECODE_GEMV={text!r}: unknown projection {', '.join(unknown)}; use a "
            f"comma-separated subset of {', '.join(PROJECTIONS)}, or an empty value for none"
        )
    return names


def blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for W [n, k]: about TARGET_ROWS programs, each a TILE of W per step."""
    rows = 1
    while rows < 16 and rows * 2 * TARGET_ROWS <= n:
        rows *= 2
    return rows, min(1 << (k - 1).bit_length(), max(64, TILE // rows))


def dense_gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, K], w [N, K] -> [1, N] in w's dtype: the products summed in float64, rounded once."""
    return (x.double() @ w.double().T).to(w.dtype)


def check(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"dense_gemv: x must be [1, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if w.stride(1) != 1:
        raise ValueError("dense_gemv: w's rows must be contiguous")


@triton_op("vismmoe_edge::dense_gemv")
def _dense_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    from torch.library import wrap_triton

    from vismmoe_edge.kernels import triton_decode

    n, k = w.shape
    out = torch.empty(1, n, dtype=w.dtype, device=w.device)
    block_n, block_k = blocks(n, k)
    wrap_triton(triton_decode._dense_gemv_kernel)[(-(-n // block_n),)](
        x.contiguous(), w, out, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k
    )
    return out


def dense_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ w [N, K].T -> [1, N] in w's dtype, by the Triton program (CUDA, or the CPU under
    TRITON_INTERPRET=1); within rounding of `dense_gemv_reference`."""
    check(x, w)
    return _dense_gemv(x, w)
