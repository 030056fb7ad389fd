"""Fine-grained FP8: `weight` float8_e4m3fn [..., R, C] and `weight_scale_inv` [..., ceil(R/bR), ceil(C/bC)].

w[i, j] = fp8[i, j] * scale_inv[i // bR, j // bC] (Qwen3-VL-*-FP8 model cards: "fine-grained fp8 quantization
with block size of 128"; transformers src/transformers/integrations/finegrained_fp8.py, Fp8Dequantize). The
scale of a fused tensor carries the same leading dims (one grid per expert). Partial edge blocks use the last
scale, as DeepSeek-V3's reference weight_dequant does.
"""

from __future__ import annotations

from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError

SCALE_SUFFIX = "_scale_inv"


def parse_config(qc: dict[str, Any], where: str) -> tuple[int, int]:
    """The (rows, cols) block of a {"quant_method": "fp8", "weight_block_size": [128, 128]} config."""
    block = qc.get("weight_block_size")
    if block is None:
        raise VismmoeError(
            f"{where}: FP8 without weight_block_size (per-tensor FP8) is not supported; use the block-128 FP8 release"
        )
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise VismmoeError(f"{where}: quantization_config.weight_block_size {block!r} is not two positive integers")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise VismmoeError(f"{where}: FP8 format {fmt!r} is not supported (only e4m3)")
    return block[0], block[1]


def scale_name(weight_name: str) -> str:
    """transformers' naming: `x.weight` -> `x.weight_scale_inv`; a fused `x.gate_up_proj` -> `..._scale_inv`."""
    return weight_name + SCALE_SUFFIX


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weights of the same shape as `weight`."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape[-2:]) != grid or scale_inv.shape[:-2] != weight.shape[:-2]:
        raise VismmoeError(
            f"FP8 scale grid {list(scale_inv.shape)} does not fit weight {list(weight.shape)} in blocks of "
            f"{list(block)}; the checkpoint is inconsistent"
        )
    s = scale_inv.to(torch.float32)
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return weight.to(torch.float32) * s
