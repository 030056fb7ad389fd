"""AutoAWQ GEMM int4 weights: {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}.

Per linear X [out, in] (casper-hansen/AutoAWQ awq/modules/linear/gemm.py WQLinear_GEMM.from_linear, and
awq/utils/packing_utils.py unpack_awq / reverse_awq_order / dequantize_gemm):
- `X.qweight` int32 [in, out/8]: word c, nibble slot i (bits 4i) holds output column 8c + [0,2,4,6,1,3,5,7][i];
- `X.qzeros` int32 [in/g, out/8]: unsigned zero points, packed the same way;
- `X.scales` fp16 [in/g, out].
Dequantization: W.T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n].
"""

from __future__ import annotations

from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.quantize import Int4Groups

SUFFIXES = ("qweight", "qzeros", "scales")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # slot i of a word holds column AWQ_ORDER[i] of its 8


def parse_config(qc: dict[str, Any], where: str) -> int:
    """The group size (-1: one group per row) of a GEMM AWQ config; other variants are refused."""
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise VismmoeError(f"{where}: AWQ version {version!r}; only GEMM checkpoints are supported")
    if qc.get("bits", qc.get("w_bit")) != 4:
        raise VismmoeError(f"{where}: AWQ with {qc.get('bits')} bits; only 4-bit AWQ is supported")
    if qc.get("zero_point", True) is not True:
        raise VismmoeError(f"{where}: AWQ without zero points is not supported")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise VismmoeError(f"{where}: AWQ group_size {group!r} is not a positive integer or -1")
    return group


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] in AWQ's interleaved order -> uint8 [rows, cols] in column order."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    slots = (packed.to(torch.int32)[:, :, None] >> shifts) & 0xF  # [rows, words, 8] by slot
    cols = torch.empty_like(slots)
    cols[:, :, list(AWQ_ORDER)] = slots  # slot i -> column AWQ_ORDER[i]
    return cols.reshape(packed.shape[0], -1).to(torch.uint8)


def int4_groups(parts: dict[str, torch.Tensor], group: int, name: str) -> Int4Groups:
    """W [out, in] = (code - 8) * scale + zero with codes = q.T, scale = s.T, zero = (8 - z) * s, transposed."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    cols_in, out = qweight.shape[0], qweight.shape[1] * 8
    g = cols_in if group == -1 else group
    if cols_in % g or tuple(scales.shape) != (cols_in // g, out) or tuple(qzeros.shape) != (cols_in // g, out // 8):
        raise VismmoeError(
            f"{name}: AWQ shapes qweight {list(qweight.shape)}, qzeros {list(qzeros.shape)}, scales "
            f"{list(scales.shape)} do not agree with group size {g}; the checkpoint is inconsistent"
        )
    q = unpack(qweight)  # [in, out]
    z = unpack(qzeros).to(torch.float32)  # [in/g, out]
    s = scales.to(torch.float32)
    return Int4Groups(q.t().contiguous(), s.t().contiguous(), ((8.0 - z) * s).t().contiguous(), g)


def dequantize(parts: dict[str, torch.Tensor], group: int, name: str) -> torch.Tensor:
    return int4_groups(parts, group, name).dequantize()
