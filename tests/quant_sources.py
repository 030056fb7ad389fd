"""Quantized source checkpoints for the converter tests, packed by references written here from each spec.

Each writer takes a dense tiny checkpoint (per-expert keys, as the FP8 / W4A16 / AWQ releases of Qwen3-VL-MoE
ship) and writes a copy in one format with that format's exact tensor names, dtypes and bit packing. Packing
and the reference dequantization use numpy loops in the order the format's source describes, independent of
vismmoe_edge.quant. Each returns {logical weight name: reference dequantized float32 weight}.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
# Linear weights quantized by all three formats: routed experts and attention projections (as real releases do).
QUANTIZED = re.compile(r"(\.mlp\.experts\.\d+\.(gate|up|down)_proj|\.self_attn\.(q|k|v|o)_proj)\.weight$")
FUSED = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")  # [E, a, b]: FP8 keeps one block grid per expert
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ WQLinear_GEMM.from_linear order_map


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensor ops on this shared 2-core VM: two OpenMP threads spin against the neighbours (a tiny conversion
    measured 1.5-7.7 s with 2 threads, 0.05-0.09 s with 1). Restored afterwards for the rest of the suite."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rewrite(src: Path, dst: Path, convert, quantization_config: dict) -> None:
    """Apply `convert(name, tensor) -> {name: tensor}` shard by shard; copy every other file; set the config."""
    dst.mkdir(parents=True)
    index = json.loads((src / INDEX).read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src / shard), framework="pt") as f:
            for name in f.keys():
                out.update(convert(name, f.get_tensor(name)))
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, shard))
    (dst / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX, "config.json"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))


# --- FP8, block 128 ------------------------------------------------------------------------------------------


def fp8_reference_dequant(q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = q.shape
    out = torch.empty(rows, cols)
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            out[i : i + block, j : j + block] = (
                q[i : i + block, j : j + block].float() * scale_inv[i // block, j // block]
            )
    return out


def fp8_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    scale_inv = torch.empty(-(-rows // block), -(-cols // block))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            tile = w[i : i + block, j : j + block].float()
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale_inv[i // block, j // block] = s
            q[i : i + block, j : j + block] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def write_fp8(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    reference: dict[str, torch.Tensor] = {}

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if FUSED.search(name):  # transformers' naming for a tensor not ending in .weight: name + "_scale_inv"
            pairs = [fp8_quantize(x) for x in t]
            reference[name] = torch.stack([fp8_reference_dequant(q, s) for q, s in pairs])
            return {name: torch.stack([q for q, _ in pairs]), name + "_scale_inv": torch.stack([s for _, s in pairs])}
        if not QUANTIZED.search(name):
            return {name: t}
        q, s = fp8_quantize(t)
        reference[name] = fp8_reference_dequant(q, s)
        return {name: q, name + "_scale_inv": s}

    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    _rewrite(src, dst, convert, qc)
    return reference


# --- compressed-tensors pack-quantized W4A16 -----------------------------------------------------------------


def ct_pack(values: np.ndarray, dim: int) -> np.ndarray:
    """Unsigned 4-bit values -> int32 words, value i of 8 at bits 4i, along `dim` (pack_to_int32's loop)."""
    v = values.astype(np.uint32)
    if dim == 0:
        return ct_pack(v.T, 1).T.copy()
    pad = -v.shape[1] % 8
    v = np.pad(v, [(0, 0), (0, pad)])
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        packed |= v[:, i::8] << (4 * i)
    return packed.view(np.int32)


def ct_quantize(w: torch.Tensor, group: int, symmetric: bool, scale_dtype: torch.dtype):
    """Signed int4 q, scale [out, groups] and signed zero point (asymmetric) with w ~ (q - zp) * scale."""
    out, cols = w.shape
    w = w.float()
    groups = -(-cols // group)
    q = np.zeros((out, cols), dtype=np.int64)
    scale = torch.empty(out, groups)
    zp = np.zeros((out, groups), dtype=np.int64)
    for gi in range(groups):
        tile = w[:, gi * group : (gi + 1) * group]
        if symmetric:
            s = (tile.abs().amax(dim=1) / 7.5).clamp(min=1e-8).to(scale_dtype).float()
            z = torch.zeros(out)
        else:
            lo, hi = tile.amin(dim=1).clamp(max=0), tile.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype).float()
            z = (-8 - torch.round(lo / s)).clamp(-8, 7)
        scale[:, gi] = s
        zp[:, gi] = z.numpy().astype(np.int64)
        q[:, gi * group : (gi + 1) * group] = (torch.round(tile / s[:, None]) + z[:, None]).clamp(-8, 7).numpy()
    return q, scale.to(scale_dtype), zp


def ct_reference_dequant(q: np.ndarray, scale: torch.Tensor, zp: np.ndarray, group: int) -> torch.Tensor:
    """w[:, c] = (q[:, c] - zp[:, c // g]) * scale[:, c // g] (quantization/lifecycle/forward.py dequantize)."""
    cols = q.shape[1]
    s = np.repeat(scale.float().numpy(), group, axis=1)[:, :cols]
    z = np.repeat(zp, group, axis=1)[:, :cols]
    return torch.from_numpy(((q - z) * s).astype(np.float32))


def write_compressed_tensors(
    src: Path, dst: Path, *, symmetric: bool, group: int = 128, scale_dtype: torch.dtype = torch.bfloat16,
    act_order: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    reference: dict[str, torch.Tensor] = {}

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not QUANTIZED.search(name):
            return {name: t}
        base = name.removesuffix(".weight")
        q, scale, zp = ct_quantize(t, group, symmetric, scale_dtype)
        reference[name] = ct_reference_dequant(q, scale, zp, group)
        out = {
            base + ".weight_packed": torch.from_numpy(ct_pack(q + 8, dim=1)),
            base + ".weight_scale": scale,
            base + ".weight_shape": torch.tensor(list(t.shape), dtype=torch.int32),
        }
        if not symmetric:
            out[base + ".weight_zero_point"] = torch.from_numpy(ct_pack(zp + 8, dim=0))
        if act_order:
            out[base + ".weight_g_idx"] = torch.arange(t.shape[1], dtype=torch.int32) // group
        return out

    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group,
               "actorder": "group" if act_order else None, "dynamic": False, "observer": "minmax"}  # fmt: skip
    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },  # fmt: skip
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }
    if act_order:  # a config without the actorder flag, so that only the tensor gives it away
        weights["actorder"] = None
    _rewrite(src, dst, convert, qc)
    return reference


# --- AutoAWQ GEMM --------------------------------------------------------------------------------------------


def awq_pack(intweight: np.ndarray) -> np.ndarray:
    """[rows, cols] unsigned 4-bit -> int32 [rows, cols/8], slot i of word c = column 8c + AWQ_ORDER[i]."""
    rows, cols = intweight.shape
    packed = np.zeros((rows, cols // 8), dtype=np.uint32)
    v = intweight.astype(np.uint32)
    for i in range(8):  # from_linear's `for col: for i: qweight[:, col] |= intweight[:, col*8 + order_map[i]] << 4i`
        packed |= v[:, AWQ_ORDER[i] :: 8] << (i * 4)
    return packed.view(np.int32)


def write_awq(src: Path, dst: Path, group: int = 128) -> dict[str, torch.Tensor]:
    reference: dict[str, torch.Tensor] = {}

    def convert(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not QUANTIZED.search(name):
            return {name: t}
        base = name.removesuffix(".weight")
        wt = t.float().t()  # AWQ stores [in, out]
        cols_in, out = wt.shape
        g = wt.view(cols_in // group, group, out)
        lo, hi = g.amin(dim=1), g.amax(dim=1)
        scales = ((hi - lo) / 15).clamp(min=1e-5).half()
        zeros = torch.round(-lo / scales.float()).clamp(0, 15)
        iw = (torch.round(g / scales.float()[:, None]) + zeros[:, None]).clamp(0, 15).view(cols_in, out)
        iw_np, z_np = iw.numpy().astype(np.int64), zeros.numpy().astype(np.int64)
        # dequantize_gemm: (iweight - izeros.repeat_interleave(g)) * scales.repeat_interleave(g), [in, out]
        ref = (iw_np - np.repeat(z_np, group, axis=0)) * np.repeat(scales.float().numpy(), group, axis=0)
        reference[name] = torch.from_numpy(ref.astype(np.float32)).t().contiguous()
        return {
            base + ".qweight": torch.from_numpy(awq_pack(iw_np)),
            base + ".qzeros": torch.from_numpy(awq_pack(z_np)),
            base + ".scales": scales,
        }

    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True}
    _rewrite(src, dst, convert, qc)
    return reference
