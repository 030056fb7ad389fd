"""Int4 nibble layouts: the plain row-major packing, the CPU kernel's tiles, and the CUDA kernel's input.

A matrix W [N, K] (nn.Linear orientation: N outputs, K inputs) is quantized to `codes` uint8 [N, K] in 0..15
(offset binary: the signed value is code - 8). Three byte layouts of those codes exist:

- "rowmajor": uint8 [N, K/2], byte j of row n = codes[n, 2j] | codes[n, 2j+1] << 4. This is what compressed-tensors'
  int32 words hold once viewed as little-endian bytes (nibble i of a word at bits 4i).
- the CPU kernel's tiles (`torch.ops.aten._convert_weight_to_int4pack_for_cpu`, aten/src/ATen/native/cpu/
  int4mm_kernel.cpp, weight_to_int4pack_kernel): rows are cut into blocks of BLOCK_N outputs, each block stored as
  [K, BLOCK_N/2] bytes. Inside a full block the AVX-512 build pairs output j with j + 32 (BLOCK_N 64), the AVX2
  build j with j + 16 (BLOCK_N 32); every other build, and the tail block of the vector builds, pairs 2j with
  2j+1 (BLOCK_N 16 on aarch64 NEON, 32 elsewhere). The layout therefore depends on the CPU the file runs on.
- the CUDA kernel's input (`_convert_weight_to_int4pack`, uint8 [N, K/2]): row-major with the even column in the
  HIGH nibble, the reverse of "rowmajor".

Everything here is plain tensor ops, so it runs on any device (the GPU rebuilds its layout from any of these).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vismmoe_edge.errors import VismmoeError

ROWMAJOR = "rowmajor"


@dataclass(frozen=True)
class CpuTiles:
    """One CPU tile layout: blocks of `block_n` outputs; `split` pairs j with j + block_n/2 in full blocks."""

    name: str
    block_n: int
    split: bool


CPU_LAYOUTS: dict[str, CpuTiles] = {
    t.name: t
    for t in (
        CpuTiles("cpu_b64_split", 64, True),  # x86 AVX-512 builds
        CpuTiles("cpu_b32_split", 32, True),  # x86 AVX2 builds
        CpuTiles("cpu_b16_pairs", 16, False),  # aarch64 NEON (Jetson Orin, Graviton 2)
        CpuTiles("cpu_b32_pairs", 32, False),  # x86 without AVX2, aarch64 SVE-256
    )
}
INT4_LAYOUTS = (ROWMAJOR, *CPU_LAYOUTS)


def pack_rowmajor(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] -> uint8 [N, K/2], low nibble = even column."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_rowmajor(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> codes uint8 [N, K]."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def _block_sizes(n: int, block_n: int) -> list[int]:
    full, tail = divmod(n, block_n)
    return [block_n] * full + ([tail] if tail else [])


def pack_cpu_tiles(codes: torch.Tensor, layout: str) -> torch.Tensor:
    """codes uint8 [N, K] -> the CPU kernel's uint8 [N, K/2] for `layout`, without calling the kernel's repack."""
    tiles = CPU_LAYOUTS[layout]
    n, k = codes.shape
    c = codes.to(torch.uint8)
    out = torch.empty((n * k // 2,), dtype=torch.uint8, device=codes.device)
    full = n // tiles.block_n * tiles.block_n
    if full:
        blocks = c[:full].view(-1, tiles.block_n, k)  # [NB, BN, K]
        if tiles.split:
            half = tiles.block_n // 2
            lo, hi = blocks[:, :half], blocks[:, half:]
        else:
            lo, hi = blocks[:, 0::2], blocks[:, 1::2]
        out[: full * k // 2].view(-1, k, tiles.block_n // 2).copy_((lo | (hi << 4)).transpose(1, 2))
    if full < n:  # the tail block is always paired 2j | 2j+1
        tail = c[full:]
        out[full * k // 2 :].view(k, (n - full) // 2).copy_((tail[0::2] | (tail[1::2] << 4)).t())
    return out.view(n, k // 2)


def unpack_cpu_tiles(packed: torch.Tensor, layout: str) -> torch.Tensor:
    """The CPU kernel's uint8 [N, K/2] for `layout` -> codes uint8 [N, K]."""
    tiles = CPU_LAYOUTS[layout]
    n, k = packed.shape[0], packed.shape[1] * 2
    flat = packed.reshape(-1)
    codes = torch.empty((n, k), dtype=torch.uint8, device=packed.device)
    full = n // tiles.block_n * tiles.block_n
    if full:
        b = flat[: full * k // 2].view(-1, k, tiles.block_n // 2).transpose(1, 2)  # [NB, BN/2, K]
        lo, hi = b & 0x0F, b >> 4
        blocks = codes[:full].view(-1, tiles.block_n, k)
        if tiles.split:
            half = tiles.block_n // 2
            blocks[:, :half] = lo
            blocks[:, half:] = hi
        else:
            blocks[:, 0::2] = lo
            blocks[:, 1::2] = hi
    if full < n:
        t = flat[full * k // 2 :].view(k, (n - full) // 2).t()
        codes[full::2] = t & 0x0F
        codes[full + 1 :: 2] = t >> 4
    return codes


def pack_int4(codes: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == ROWMAJOR:
        return pack_rowmajor(codes)
    if layout in CPU_LAYOUTS:
        return pack_cpu_tiles(codes, layout)
    raise VismmoeError(f"unknown int4 layout {layout!r}; use one of {', '.join(INT4_LAYOUTS)}")


def unpack_int4(packed: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == ROWMAJOR:
        return unpack_rowmajor(packed)
    if layout in CPU_LAYOUTS:
        return unpack_cpu_tiles(packed, layout)
    raise VismmoeError(f"unknown int4 layout {layout!r}; use one of {', '.join(INT4_LAYOUTS)}")


def cuda_kernel_input(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] -> what `_convert_weight_to_int4pack` takes: uint8 [N, K/2], even column high."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] << 4) | c[:, 1::2]


@functools.cache
def native_cpu_layout() -> str | None:
    """The tile layout this machine's `_convert_weight_to_int4pack_for_cpu` produces, found by packing a probe.

    Probing instead of reading torch.backends.cpu.get_cpu_capability() also catches ATEN_CPU_CAPABILITY overrides
    and builds whose vector width differs from the ISA name. None when the op is missing or matches no layout.
    """
    n, k = 80, 16  # one 64-block and a 16-row tail, so every candidate packs differently
    codes = (torch.arange(n * k, dtype=torch.int32).view(n, k) * 7 + torch.arange(n)[:, None]) % 16
    try:
        native = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 8)
    except (AttributeError, RuntimeError):
        return None
    for name in CPU_LAYOUTS:
        if torch.equal(pack_cpu_tiles(codes.to(torch.uint8), name), native):
            return name
    return None
