"""Weight quantizers in the kernels' own conventions: int4 group-wise asymmetric, int8 per output channel.

int4 follows tinygemm (aten `_weight_int4pack_mm`, CPU and CUDA): W[n, k] ~ (code - 8) * scale[n, g] + zero[n, g]
with g = k // group_size, the zero in the float domain. Scale and zero are rounded to bf16 before the codes are
chosen, because bf16 is what the kernels read; the codes then absorb that rounding.
int8 follows `_weight_int8pack_mm`: W[n, k] ~ q[n, k] * scale[n], symmetric, one scale per output channel (the
kernel takes no groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.bfloat16  # the dtype both int4 kernels and the CPU int8 kernel read scales in
_TINY = 1e-10  # a constant group has range 0: any positive scale reproduces it exactly through the zero


@dataclass
class Int4Groups:
    """W ~ (codes - 8) * scale + zero, per group of `group_size` consecutive inputs."""

    codes: torch.Tensor  # uint8 [N, K], 0..15
    scale: torch.Tensor  # float32 [N, K / group_size], values exactly representable in bf16
    zero: torch.Tensor  # float32 [N, K / group_size], idem
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.codes.shape
        c = self.codes.view(n, k // self.group_size, self.group_size).to(torch.float32)
        w = (c - 8.0) * self.scale[..., None] + self.zero[..., None]
        return w.view(n, k).to(dtype)


def cat_rows(parts: list[Int4Groups]) -> Int4Groups:
    """Stack along outputs (gate rows then up rows make gate_up)."""
    if len({p.group_size for p in parts}) != 1:
        raise ValueError("cannot stack int4 matrices with different group sizes")
    return Int4Groups(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.zero for p in parts]),
        parts[0].group_size,
    )


def quantize_int4(w: torch.Tensor, group_size: int) -> Int4Groups:
    """Min/max asymmetric int4 of W [N, K] in groups of `group_size` along K (K must be a multiple)."""
    n, k = w.shape
    g = w.to(torch.float32).reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((hi - lo) / 15.0).clamp(min=_TINY).to(SCALE_DTYPE).to(torch.float32)
    zero = (lo + 8.0 * scale).to(SCALE_DTYPE).to(torch.float32)
    codes = torch.round((g - zero[..., None]) / scale[..., None] + 8.0).clamp(0, 15).to(torch.uint8)
    return Int4Groups(codes.view(n, k), scale, zero, group_size)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax int8 of W [N, K], one bf16 scale per output row: (q int8 [N, K], scale bf16 [N])."""
    w32 = w.to(torch.float32)
    scale = (w32.abs().amax(dim=1) / 127.0).clamp(min=_TINY).to(SCALE_DTYPE)
    q = torch.round(w32 / scale.to(torch.float32)[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)
