"""The Triton kernels over int4 records in row-major nibbles that a prefill reads: dequant_int4.py's dequantize
and grouped_int4.py's grouped GEMM, in a module of their own so that importing the engine does not import Triton
(~1 s, and CPU hosts have none): their callers import it on first use. Both dequantize a code as
(code - 8) * scale + zero in float32 (launched without fused multiply-add, as torch's separate ops round it) and
round to bf16 to nearest even on the bits (the interpreter's own cast truncates), so both give the dequantized
file's weights element for element."""

import triton
import triton.language as tl

from vismmoe_edge.kernels.triton_codes import centered  # code - 8 without an int-to-float conversion


@triton.jit
def dequantized(code, scale, zero):
    """int4 codes (0..15) -> (code - 8) * scale + zero in float32."""
    return centered(code) * scale + zero


@triton.jit
def bf16_bits(v):
    """float32 -> the bits of its bf16 rounded to nearest even, in the low half of a uint32."""
    bits = v.to(tl.uint32, bitcast=True)
    return (bits + ((bits >> 16) & 1) + 0x7FFF) >> 16


@triton.jit
def as_bf16(bits):
    """`bf16_bits`' result as bf16 values."""
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


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
    lo = dequantized(byte & 15, scale, zero)
    hi = dequantized(byte >> 4, scale, zero)
    at_out = e.to(tl.int64) * N * K + rows[:, None].to(tl.int64) * K + 2 * jb[None, :]
    if BF16:
        lo_bits, hi_bits = bf16_bits(lo), bf16_bits(hi)
        # both codes of a byte are adjacent bf16s: one 32-bit store (low half first, little-endian) instead of
        # two 2-byte stores at a 4-byte stride
        pair = out.to(tl.pointer_type(tl.uint32)) + at_out // 2
        tl.store(pair, (hi_bits << 16) | lo_bits, mask=ok)
    else:
        tl.store(out + at_out, lo.to(out.dtype.element_ty), mask=ok)
        tl.store(out + at_out + 1, hi.to(out.dtype.element_ty), mask=ok)


# fmt: off
@triton.jit
def _grouped_int4_kernel(xs, w, group_slots, ends, tile_group, tile_row, out, G, N, K, stride_slot, q_off, s_off,
                         GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BF16: tl.constexpr, IEEE: tl.constexpr, NATIVE_CAST: tl.constexpr):
    # fmt: on
    # NATIVE_CAST (the GPU): Triton's float32 -> bf16 cast, round to nearest even as `bf16_bits` (which the
    # interpreter needs: its cast truncates) in one instruction per pair instead of six integer ops per value
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
            kc = 2 * start + tl.arange(0, 2 * HALF)  # this step's input columns, contiguous
            x = tl.load(xs + rows[:, None].to(tl.int64) * K + kc[None, :], mask=row_ok[:, None], other=0.0)
            byte = tl.load(codes + cols[:, None].to(tl.int64) * kb + jb[None, :], mask=col_ok[:, None], other=0)
            at = ((start * 2 // GROUP) * N + cols) * 2  # the block lies inside one group
            scale = tl.load(sz + at, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            zero = tl.load(sz + at + 1, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            lo = dequantized(byte & 15, scale, zero)  # [BLOCK_N, HALF]: codes 2j
            hi = dequantized(byte >> 4, scale, zero)  # codes 2j + 1
            wt = tl.reshape(tl.join(lo, hi), (BLOCK_N, 2 * HALF))  # interleaved back into the columns' order
            if BF16:
                if NATIVE_CAST:
                    wt = wt.to(tl.bfloat16, fp_downcast_rounding="rtne")
                else:
                    wt = as_bf16(bf16_bits(wt))
            if IEEE:  # float32 inputs, and the interpreter (exact float32 products of the bf16 values)
                acc += tl.dot(x.to(tl.float32), tl.trans(wt.to(tl.float32)), input_precision="ieee")
            else:  # one dot over the step's 2 * HALF codes
                acc += tl.dot(x, tl.trans(wt))
        at_out = out + rows[:, None].to(tl.int64) * N + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        if BF16:
            if NATIVE_CAST:
                tl.store(at_out, acc.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=ok)
            else:
                tl.store(at_out, as_bf16(bf16_bits(acc)), mask=ok)
        else:
            tl.store(at_out, acc, mask=ok)
