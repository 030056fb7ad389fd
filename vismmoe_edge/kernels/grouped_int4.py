"""A grouped GEMM over int4 slots in row-major nibbles, read in place: the prefill's expert GEMMs without a
dequantized copy of the weights.

The prefill of an int4 pool (experts/quant_pool.prefill_rowmajor_int4) dequantized every slot in use to the
compute dtype (kernels/dequant_int4.py) and ran torch's grouped GEMM on the copy: at 30B-A3B shapes a layer wrote
1.2 GB of bf16 and read it back, for 0.3 GB of codes, and on the H200 (run 9) the int4 prefill took 2.6-2.7x
transformers' (bf16 resident: 0.6-1.1x). Here each program takes a tile of one group's rows (the (token, expert)
pairs routed to one slot, sorted by slot) and of the slot's output rows, and walks K one block of codes at a
time: it loads the block's nibbles where the record holds them, dequantizes them in registers exactly as
dequant_int4.py does ((code - 8) * scale + zero in float32, no fused multiply-add, rounded to the compute dtype
to nearest even), and multiplies: the low nibbles (codes 2j) meet the even input columns and the high nibbles
the odd ones, two dots a block, so nothing is interleaved. The weights are the dequantized file's bf16 values;
only the sums' order differs from torch's grouped GEMM (the GPU checks judge that by the near-tie rule).

The tiles are laid out on the device (`tile_plan`): group g has ceil(rows_g / BLOCK_M) tiles, the grid is the
static bound pairs / BLOCK_M + groups, and a program past the last tile returns at once; no count goes to the
host.

Since run 11 (not yet run on a GPU; run 11 measured 4.25 ms a layer for a 1,100-token prefill at 30B-A3B shapes,
~20 TFLOP/s, and the int4 resident prefill at 1.7-1.9x transformers'): a step loads its input tile whole (the even
and odd columns were two loads at a stride of two elements), puts the two nibbles' weights back into the columns'
order (`tl.join`) for one dot over the step's 128 codes instead of two over 64, rounds to bf16 with the GPU's own
cast (round to nearest even, as the bit arithmetic the interpreter needs), and the output tile's width, warps and
pipeline stages are autotuned per shape on the GPU (the first prefill of each shape times them).
"""

from __future__ import annotations

from typing import Any

import torch

from vismmoe_edge.kernels.moe_int4 import INTERPRET
from vismmoe_edge.kernels.slot_matrix import SlotMatrix

BLOCK_M = 64  # pairs a tile
BLOCK_N = 64  # output rows a tile (in the interpreter; the GPU's autotuner chooses 64 or 128)
MAX_BLOCK_K = 128  # codes a step along K: one g128 group, one dot


def block_k(group: int) -> int:
    """Codes a step: one group or MAX_BLOCK_K, whichever is smaller, so that a step lies inside one group."""
    return min(group, MAX_BLOCK_K)


def supported(group: int, k: int) -> bool:
    """Groups of at least 32 codes (a dot's inner size is at least 16 per nibble), a power of two dividing K."""
    return group >= 32 and group & (group - 1) == 0 and k % group == 0


def tile_plan(ends: torch.Tensor, pairs: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """ends [G] int32: where each group's rows end. -> (tile_group, tile_row [tiles] int32, tiles): the group and
    first row of each tile; tiles past the last have group G."""
    groups = ends.shape[0]
    tiles = pairs // BLOCK_M + groups  # each group wastes at most one partial tile
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tile_ends = torch.cumsum(-(-(ends - starts) // BLOCK_M), 0)  # inclusive end of each group's tiles
    t = torch.arange(tiles, device=ends.device)
    group = torch.searchsorted(tile_ends, t, right=True)
    real = group.clamp_max(groups - 1)  # (tiles past the last: any group's numbers, never read)
    first_tile = torch.cat([tile_ends.new_zeros(1), tile_ends])[real]
    row = starts[real] + (t - first_tile) * BLOCK_M
    return group.to(torch.int32), row.to(torch.int32), tiles


def grouped_int4_mm(xs: torch.Tensor, w: SlotMatrix, group_slots: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """xs [P, K] (bf16, or float32 in the tests) rows grouped by slot; group g (rows ends[g-1]..ends[g]) meets slot
    group_slots[g]'s matrix W [N, K] -> [P, N] in xs' dtype: xs_g @ W^T, as torch._grouped_mm on the dequantized
    weights."""
    if not supported(w.group, w.k) or xs.shape[1] != w.k:
        raise ValueError(f"grouped_int4_mm: group {w.group}, K {w.k}, input {tuple(xs.shape)} not supported")
    pairs = xs.shape[0]
    out = torch.empty(pairs, w.n, dtype=xs.dtype, device=xs.device)
    if pairs == 0:
        return out
    xs = xs.contiguous()
    tile_group, tile_row, tiles = tile_plan(ends, pairs)
    # the GPU: without fused multiply-add (dequantized exactly as torch's separate ops), blocks autotuned
    options = {"BLOCK_N": BLOCK_N} if INTERPRET else {"enable_fp_fusion": False}
    _kernel()[lambda meta: (tiles, -(-w.n // meta["BLOCK_N"]))](
        xs, w.base, group_slots.to(torch.int32), ends.to(torch.int32), tile_group, tile_row, out,
        ends.shape[0], w.n, w.k, w.stride_slot, w.q_off, w.s_off, GROUP=w.group, HALF=block_k(w.group) // 2,
        BLOCK_M=BLOCK_M, BF16=xs.dtype == torch.bfloat16, IEEE=INTERPRET or xs.dtype == torch.float32,
        NATIVE_CAST=not INTERPRET, **options,
    )  # fmt: skip
    return out


_tuned: Any = None


def _kernel() -> Any:
    """triton_int4._grouped_int4_kernel, on the GPU under an autotuner over the output tile's width, the warps and
    the pipeline stages (keyed by shape; the kernel writes every output it owns, so the trial runs are harmless)."""
    global _tuned
    from vismmoe_edge.kernels.triton_int4 import _grouped_int4_kernel

    if INTERPRET:
        return _grouped_int4_kernel
    if _tuned is None:
        import triton

        configs = [triton.Config({"BLOCK_N": n}, num_warps=warps, num_stages=stages)
                   for n in (64, 128) for warps in (4, 8) for stages in (3, 4)]  # fmt: skip
        _tuned = triton.autotune(configs=configs, key=["N", "K", "GROUP"], cache_results=True)(_grouped_int4_kernel)
    return _tuned
