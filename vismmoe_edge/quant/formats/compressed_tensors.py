"""compressed-tensors "pack-quantized" int4 weights (llm-compressor's W4A16), symmetric or asymmetric.

Per weight X [out, in] (neuralmagic/compressed-tensors, src/compressed_tensors/compressors/
quantized_compressors/pack_quantized.py, pack_to_int32 / unpack_from_int32 / decompress_weight):
- `X.weight_packed` int32 [out, ceil(in/8)]: value i of a word at bits 4i, stored offset-binary (signed q + 8);
- `X.weight_scale` [out, ceil(in/g)] (g = in for the "channel" strategy);
- `X.weight_zero_point` (asymmetric only) int32 [ceil(out/8), ceil(in/g)]: signed zero points + 8, packed the
  same way but along dim 0;
- `X.weight_shape` [2] = (out, in); `X.weight_g_idx` only with activation ordering, which we refuse.
Dequantization (quantization/lifecycle/forward.py): w = (q - zp) * scale per group of g inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.quantize import Int4Groups

SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass(frozen=True)
class Scheme:
    group_sizes: tuple[int, ...]  # every group size the config declares (a channel strategy declares none)
    channel: bool  # some group uses the "channel" strategy


def parse_config(qc: dict[str, Any], where: str) -> Scheme:
    """Accept W4A16 pack-quantized configs only; anything else is one line saying what it is."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise VismmoeError(f"{where}: compressed-tensors status {status!r}; only saved (compressed) checkpoints load")
    if qc.get("sparsity_config") or qc.get("transform_config"):
        raise VismmoeError(f"{where}: compressed-tensors sparsity or transforms (rotations) are not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise VismmoeError(f"{where}: compressed-tensors config has no config_groups; the config is corrupt")
    sizes: set[int] = set()
    channel = False
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise VismmoeError(f"{where}: compressed-tensors config_groups.{name} is not an object (corrupt)")
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise VismmoeError(
                f"{where}: compressed-tensors format {fmt!r} in {name}; only pack-quantized (W4A16) is supported"
            )
        if group.get("input_activations") or group.get("output_activations"):
            raise VismmoeError(
                f"{where}: {name} quantizes activations (W4A8/W8A8); only weight-only W4A16 is supported"
            )
        w = group.get("weights") or {}
        if w.get("type", "int") != "int" or w.get("num_bits") != 4:
            raise VismmoeError(
                f"{where}: {name} has {w.get('type')} {w.get('num_bits')}-bit weights; only int4 is supported"
            )
        if w.get("actorder") in ("group", "dynamic", True):
            raise VismmoeError(
                f"{where}: {name} uses activation ordering (actorder={w.get('actorder')!r}, g_idx); re-quantize "
                f"without act-order"
            )
        strategy = w.get("strategy")
        if strategy == "group" and isinstance(w.get("group_size"), int) and w["group_size"] > 0:
            sizes.add(w["group_size"])
        elif strategy == "channel":
            channel = True
        else:
            raise VismmoeError(
                f"{where}: {name} has weight strategy {strategy!r}; only group and channel are supported"
            )
    return Scheme(tuple(sorted(sizes)), channel)


def group_size_for(scheme: Scheme, shape: tuple[int, int], scale_shape: tuple[int, ...], name: str) -> int:
    """The group size of one weight, from its scale's shape and the sizes the config declares."""
    out, cols = shape
    if len(scale_shape) != 2 or scale_shape[0] != out:
        raise VismmoeError(f"{name}.weight_scale has shape {list(scale_shape)}, expected [{out}, groups]")
    candidates = [g for g in scheme.group_sizes if -(-cols // g) == scale_shape[1]]
    if scheme.channel and scale_shape[1] == 1:
        candidates.append(cols)
    if not candidates:
        raise VismmoeError(
            f"{name}.weight_scale has {scale_shape[1]} groups for {cols} inputs: no declared group size fits"
        )
    return candidates[0]


def unpack_int32(packed: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """int32 words holding 8 nibbles each (value i at bits 4i) -> uint8 codes along `dim`, cut to `length`."""
    words = packed.to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    if dim == 1:
        nib = (words[:, :, None] >> shifts) & 0xF  # [rows, words, 8]
        return nib.reshape(words.shape[0], -1)[:, :length].to(torch.uint8)
    nib = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [words, 8, cols]
    return nib.reshape(-1, words.shape[1])[:length].to(torch.uint8)


def int4_groups(parts: dict[str, torch.Tensor], shape: tuple[int, int], group: int, name: str) -> Int4Groups:
    """Codes (offset binary = our codes), scale, and the float zero -zp * scale of one weight."""
    if "weight_g_idx" in parts:
        raise VismmoeError(
            f"{name}.weight_g_idx: activation-ordered (act-order) weights are not supported; re-quantize "
            f"without act-order"
        )
    out, cols = shape
    words = -(-cols // 8)
    if tuple(parts["weight_packed"].shape) != (out, words):
        raise VismmoeError(
            f"{name}.weight_packed has shape {list(parts['weight_packed'].shape)}, expected [{out}, {words}]"
        )
    codes = unpack_int32(parts["weight_packed"], cols, dim=1)
    scale = parts["weight_scale"].to(torch.float32)
    groups = scale.shape[1]
    if "weight_zero_point" in parts:
        zp_shape = (-(-out // 8), groups)
        if tuple(parts["weight_zero_point"].shape) != zp_shape:
            raise VismmoeError(
                f"{name}.weight_zero_point has shape {list(parts['weight_zero_point'].shape)}, expected "
                f"{list(zp_shape)}"
            )
        zp = unpack_int32(parts["weight_zero_point"], out, dim=0).to(torch.float32) - 8.0
        zero = -zp * scale
    else:
        zero = torch.zeros_like(scale)
    return Int4Groups(codes, scale, zero, group)


def dequantize(parts: dict[str, torch.Tensor], shape: tuple[int, int], group: int, name: str) -> torch.Tensor:
    """float32 [out, in]; partial last groups (in % g != 0) are handled, unlike Int4Groups."""
    q = int4_groups(parts, shape, group, name)
    cols = shape[1]
    index = torch.arange(cols) // group
    return (q.codes.to(torch.float32) - 8.0) * q.scale[:, index] + q.zero[:, index]
