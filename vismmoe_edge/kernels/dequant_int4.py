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
    from vismmoe_edge.kernels.triton_int4 import _dequant_int4_kernel

    options = {} if INTERPRET else {"enable_fp_fusion": False}
    _dequant_int4_kernel[grid](w.base, slot_ids.to(torch.int32), out, w.n, w.k, w.stride_slot, w.q_off, w.s_off,
                    GROUP=w.group, BF16=dtype == torch.bfloat16, BLOCK_N=BLOCK_N, HALF=HALF, **options)  # fmt: skip
    return out
