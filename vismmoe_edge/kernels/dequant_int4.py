"""int4 records in row-major nibbles -> one matrix per slot in the compute dtype, in one pass, read in place.

The prefill of a pool whose int4 slots are in the Triton decode form (moe_int4.py; no torch kernel reads them),
where kernels/grouped_int4.py does not take them, dequantizes the slots in use and runs grouped GEMMs
(experts/quant_pool.prefill_rowmajor_int4). In torch that
dequantize is a chain of ops, each writing a float32 tensor of every weight (codes, minus 8, times the scale,
plus the zero) before the bf16 result: ~10x the result's bytes, and on the H200 (run 7) the int4 prefill took
3.7-4.1x transformers'. This kernel reads each slot's nibbles and (scale, zero) where they lie and writes the
result once. It computes (code - 8) * scale + zero in float32 with a rounding after the product and after the
sum (no fused multiply-add: `enable_fp_fusion=False`), as torch's separate ops do, then rounds to the compute
dtype to nearest even (bf16 on the bits, which the Triton interpreter's cast does not do): the result equals
quant_pool.dequantize_rowmajor element for element.
"""

from __future__ import annotations

from typing import Any

import torch

from vismmoe_edge.kernels.moe_int4 import INTERPRET
from vismmoe_edge.kernels.slot_matrix import SlotMatrix

BLOCK_N = 32  # rows a program
HALF = 64  # bytes of a row a program (128 codes)


def dequantize_int4_slots(w: SlotMatrix, slot_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w: int4 records' matrix (slot_matrix.record_matrix); slot_ids [c] -> [c, N, K] in `dtype`."""
    c = slot_ids.shape[0]
    out = torch.empty(c, w.n, w.k, dtype=dtype, device=w.base.device)
    grid = (c, -(-w.n // BLOCK_N), -(-(w.k // 2) // HALF))
    options = {} if INTERPRET else {"enable_fp_fusion": False}
    _kernel()[grid](w.base, slot_ids.to(torch.int32), out, w.n, w.k, w.stride_slot, w.q_off, w.s_off,
                    GROUP=w.group, BF16=dtype == torch.bfloat16, BLOCK_N=BLOCK_N, HALF=HALF, **options)  # fmt: skip
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
    def _dequant_int4_kernel(w, slot_ids, out, N, K, stride_slot, q_off, s_off, GROUP: tl.constexpr,
                             BF16: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
        # fmt: on
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        jb = tl.program_id(2) * HALF + tl.arange(0, HALF)  # byte j of a row: codes 2j (low nibble) and 2j + 1
        kb = K // 2
        ok = (rows < N)[:, None] & (jb < kb)[None, :]
        record = w + tl.load(slot_ids + e).to(tl.int64) * stride_slot
        byte = tl.load(record + q_off + rows[:, None].to(tl.int64) * kb + jb[None, :], mask=ok, other=0)
        sz = (record + s_off).to(tl.pointer_type(tl.bfloat16))  # [K/GROUP, N, 2]: (scale, zero)
        if GROUP >= 2 * HALF:  # the program's codes are all in one group: one (scale, zero) a row, broadcast
            at = ((tl.program_id(2) * 2 * HALF // GROUP) * N + rows) * 2
            scale = tl.load(sz + at, mask=rows < N, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(sz + at + 1, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        else:
            at = (((2 * jb) // GROUP)[None, :] * N + rows[:, None]) * 2  # both nibbles of a byte share a group
            scale = tl.load(sz + at, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(sz + at + 1, mask=ok, other=0.0).to(tl.float32)
        lo = ((byte & 15).to(tl.float32) - 8.0) * scale + zero
        hi = ((byte >> 4).to(tl.float32) - 8.0) * scale + zero
        at_out = e.to(tl.int64) * N * K + rows[:, None].to(tl.int64) * K + 2 * jb[None, :]
        if BF16:  # round to nearest even on the bits: the interpreter's own cast truncates
            lo_bits, hi_bits = lo.to(tl.uint32, bitcast=True), hi.to(tl.uint32, bitcast=True)
            lo_bits = (lo_bits + ((lo_bits >> 16) & 1) + 0x7FFF) >> 16
            hi_bits = (hi_bits + ((hi_bits >> 16) & 1) + 0x7FFF) >> 16
            # both codes of a byte are adjacent bf16s: one 32-bit store (low half first, little-endian) instead of
            # two 2-byte stores at a 4-byte stride
            pair = out.to(tl.pointer_type(tl.uint32)) + at_out // 2
            tl.store(pair, (hi_bits << 16) | lo_bits, mask=ok)
        else:
            tl.store(out + at_out, lo.to(out.dtype.element_ty), mask=ok)
            tl.store(out + at_out + 1, hi.to(out.dtype.element_ty), mask=ok)

    _compiled = _dequant_int4_kernel
    return _compiled
