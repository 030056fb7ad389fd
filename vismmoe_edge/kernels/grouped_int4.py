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
"""

from __future__ import annotations

from typing import Any

import torch

from vismmoe_edge.kernels.moe_int4 import INTERPRET
from vismmoe_edge.kernels.slot_matrix import SlotMatrix

BLOCK_M = 64  # pairs a tile
BLOCK_N = 64  # output rows a tile
MAX_BLOCK_K = 128  # codes a step along K: one g128 group, two dots of 64


def block_k(group: int) -> int:
    """Codes a step: one group or MAX_BLOCK_K, whichever is smaller, so that a step lies inside one group."""
    return min(group, MAX_BLOCK_K)


def supported(w: SlotMatrix) -> bool:
    """Groups of at least 32 codes (a dot's inner size is at least 16 per nibble), a power of two dividing K."""
    g = w.group
    return g >= 32 and g & (g - 1) == 0 and w.k % g == 0


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
    first_tile = torch.cat([tile_ends.new_zeros(1), tile_ends])[group.clamp_max(groups - 1)]
    row = starts[group.clamp_max(groups - 1)] + (t - first_tile) * BLOCK_M
    return group.to(torch.int32), row.to(torch.int32), tiles


def grouped_int4_mm(xs: torch.Tensor, w: SlotMatrix, group_slots: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """xs [P, K] (bf16, or float32 in the tests) rows grouped by slot; group g (rows ends[g-1]..ends[g]) meets slot
    group_slots[g]'s matrix W [N, K] -> [P, N] in xs' dtype: xs_g @ W^T, as torch._grouped_mm on the dequantized
    weights."""
    if not supported(w) or xs.shape[1] != w.k:
        raise ValueError(f"grouped_int4_mm: group {w.group}, K {w.k}, input {tuple(xs.shape)} not supported")
    pairs = xs.shape[0]
    out = torch.empty(pairs, w.n, dtype=xs.dtype, device=xs.device)
    if pairs == 0:
        return out
    xs = xs.contiguous()
    tile_group, tile_row, tiles = tile_plan(ends, pairs)
    options = {} if INTERPRET else {"enable_fp_fusion": False, "num_warps": 4, "num_stages": 3}
    grid = (tiles, -(-w.n // BLOCK_N))
    _kernel()[grid](
        xs, w.base, group_slots.to(torch.int32), ends.to(torch.int32), tile_group, tile_row, out,
        ends.shape[0], w.n, w.k, w.stride_slot, w.q_off, w.s_off, GROUP=w.group, HALF=block_k(w.group) // 2,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BF16=xs.dtype == torch.bfloat16, IEEE=INTERPRET or xs.dtype == torch.float32,
        **options,
    )  # fmt: skip
    return out


_compiled: Any = None


def _kernel():  # type: ignore[no-untyped-def]
    """Defined on first use (importing triton costs ~1 s, and CPU hosts have none)."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    # fmt: off
    @triton.jit
    def _grouped_int4_kernel(xs, w, group_slots, ends, tile_group, tile_row, out, G, N, K, stride_slot, q_off, s_off,
                             GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BF16: tl.constexpr, IEEE: tl.constexpr):
        # fmt: on
        t = tl.program_id(0)
        g = tl.load(tile_group + t)
        if g < G:
            row_end = tl.load(ends + g)
            rows = tl.load(tile_row + t) + tl.arange(0, BLOCK_M)
            row_ok = rows < row_end
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output rows: the slot's matrix rows
            col_ok = cols < N
            record = w + tl.load(group_slots + g).to(tl.int64) * stride_slot
            codes = record + q_off  # [N, K/2] row-major nibbles
            sz = (record + s_off).to(tl.pointer_type(tl.bfloat16))  # [K/GROUP, N, 2]: (scale, zero)
            kb = K // 2
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for start in range(0, kb, HALF):
                jb = start + tl.arange(0, HALF)  # byte j: codes 2j (low nibble) and 2j + 1 (high)
                x_at = xs + rows[:, None].to(tl.int64) * K + 2 * jb[None, :]
                x_even = tl.load(x_at, mask=row_ok[:, None], other=0.0)
                x_odd = tl.load(x_at + 1, mask=row_ok[:, None], other=0.0)
                byte = tl.load(codes + cols[:, None].to(tl.int64) * kb + jb[None, :], mask=col_ok[:, None], other=0)
                at = ((start * 2 // GROUP) * N + cols) * 2  # the block lies inside one group
                scale = tl.load(sz + at, mask=col_ok, other=0.0).to(tl.float32)[:, None]
                zero = tl.load(sz + at + 1, mask=col_ok, other=0.0).to(tl.float32)[:, None]
                # both nibbles at once: (code - 8) * scale + zero in float32, [BLOCK_N, HALF, 2]
                v = (tl.join(byte & 15, byte >> 4).to(tl.float32) - 8.0) * scale[:, :, None] + zero[:, :, None]
                if BF16:  # nearest even on the bits (the interpreter's own cast truncates)
                    bits = v.to(tl.uint32, bitcast=True)
                    bits = (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16
                    v = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
                lo, hi = tl.split(v)  # [BLOCK_N, HALF] each: codes 2j and 2j + 1
                if IEEE:  # float32 inputs, and the interpreter (exact float32 products of the bf16 values)
                    acc += tl.dot(x_even.to(tl.float32), tl.trans(lo.to(tl.float32)), input_precision="ieee")
                    acc += tl.dot(x_odd.to(tl.float32), tl.trans(hi.to(tl.float32)), input_precision="ieee")
                else:
                    acc += tl.dot(x_even, tl.trans(lo))
                    acc += tl.dot(x_odd, tl.trans(hi))
            at_out = out + rows[:, None].to(tl.int64) * N + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            if BF16:  # nearest even here too (what the GPU's cast does; the interpreter's truncates)
                bits = acc.to(tl.uint32, bitcast=True)
                bits = (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16
                tl.store(at_out, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=ok)
            else:
                tl.store(at_out, acc, mask=ok)

    _compiled = _grouped_int4_kernel
    return _compiled
