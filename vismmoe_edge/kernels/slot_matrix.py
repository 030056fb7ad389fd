"""Where one expert matrix of every slot lies in a pool's tensor, for the Triton kernels that read slots in place
(moe_decode.py's GEMVs, moe_int4.py's int4 GEMV, dequant_int4.py's int4 dequantize)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vismmoe_edge.kernels.moe_int4 import HAS_TRITON, INTERPRET


def use_triton_int4(records: torch.Tensor, form: Any) -> bool:
    """int4 records whose slots hold row-major nibbles (SlotForm.triton_int4: the pool chose the Triton form) on
    CUDA with Triton; tinygemm's tiles stay on the torch path."""
    return HAS_TRITON and (records.is_cuda or INTERPRET) and form.triton_int4


def record_matrix(records: torch.Tensor, form: Any, name: str) -> SlotMatrix:
    """Where matrix `name` of every slot's quantized record (int8, or int4 in row-major nibbles) lies."""
    offsets = {f.name: f.offset for f in form.spec.fields}
    shape, codes, quant = form.spec.matrices[name], offsets[f"{name}.qweight"], form.spec.quant
    if quant.bits == 8:
        return SlotMatrix.of_int8(records, shape, codes, offsets[f"{name}.scales"])
    return SlotMatrix.of_int4(records, shape, codes, offsets[f"{name}.scales_zeros"], quant.group_size)


@dataclass(frozen=True)
class SlotMatrix:
    """Where one matrix [N, K] of every slot is: a float pool (`stride_row` elements between rows), int8
    records (codes at byte `q_off` of each record, row-major; a bf16 scale per row at byte `s_off`), or int4
    records (`group` > 0: row-major nibbles at `q_off`, bf16 (scale, zero) [K/group, N, 2] at `s_off`)."""

    base: torch.Tensor
    n: int
    k: int
    stride_slot: int
    stride_row: int
    int8: bool = False
    q_off: int = 0
    s_off: int = 0
    group: int = 0

    @staticmethod
    def of_pool(w: torch.Tensor) -> SlotMatrix:
        return SlotMatrix(w, w.shape[1], w.shape[2], w.stride(0), w.stride(1))

    @staticmethod
    def of_int8(records: torch.Tensor, shape: tuple[int, int], q_off: int, s_off: int) -> SlotMatrix:
        n, k = shape
        return SlotMatrix(records, n, k, records.stride(0), k, int8=True, q_off=q_off, s_off=s_off)

    @staticmethod
    def of_int4(records: torch.Tensor, shape: tuple[int, int], q_off: int, s_off: int, group: int) -> SlotMatrix:
        n, k = shape
        return SlotMatrix(records, n, k, records.stride(0), k // 2, q_off=q_off, s_off=s_off, group=group)
