"""Computing a quantized expert with torch's own kernels, straight from its record's bytes.

The engine hands over one expert's record as a uint8 tensor (a view of the mmapped shard, or of a slot):

    expert = expert_views(buf, spec)           # zero-copy views: qweight and scales of gate_up and down
    expert = prepare(expert, device)           # once per fetch: CUDA builds tinygemm's layout on the GPU
    y = expert_forward(x, expert)              # down(silu(gate(x)) * up(x)), x [T, H]

CPU int4 runs `_weight_int4pack_mm_for_cpu` on the bytes in place when the file's layout is this CPU's
(packing.native_cpu_layout()); CUDA int4 runs `_weight_int4pack_mm` after `_convert_weight_to_int4pack`; int8
runs `_weight_int8pack_mm`. Group sizes or shapes a kernel cannot take fall back to dequantize + F.linear, which
is also the reference (`dequantize_expert`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import KERNEL_GROUP_SIZES
from vismmoe_edge.quant.packing import cuda_kernel_input, native_cpu_layout, pack_cpu_tiles, unpack_int4
from vismmoe_edge.quant.record import ExpertSpec

CUDA_TINYGEMM = "cuda_tinygemm"  # the layout `_convert_weight_to_int4pack` produces (opaque, GPU only)
_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the CPU kernels take for activations


@dataclass(frozen=True)
class QuantizedMatrix:
    """One weight W [n, k] (nn.Linear orientation) as the kernels take it."""

    bits: int
    n: int
    k: int
    group_size: int | None
    layout: str  # an int4 layout of packing.py, CUDA_TINYGEMM, or "rowmajor" (int8)
    qweight: torch.Tensor  # int4: uint8 [n, k/2] (int32 tiles for CUDA_TINYGEMM); int8: int8 [n, k]
    scales: torch.Tensor  # int4: bf16 [k/g, n, 2] (scale, zero); int8: bf16 [n]


@dataclass(frozen=True)
class QuantizedExpert:
    gate_up: QuantizedMatrix  # [2I, H]: gate rows, then up rows
    down: QuantizedMatrix  # [H, I]

    @property
    def nbytes(self) -> int:
        """Bytes the expert holds in memory (its record's: the CUDA tiles take as many bytes as the nibbles)."""
        return sum(t.nbytes for m in (self.gate_up, self.down) for t in (m.qweight, m.scales))


def expert_views(buf: torch.Tensor, spec: ExpertSpec) -> QuantizedExpert:
    """Zero-copy views of one expert's record; `buf` is a uint8 tensor of exactly spec.nbytes bytes."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"an expert record is a contiguous 1-D uint8 tensor, got {buf.dtype} {tuple(buf.shape)}")
    if buf.numel() != spec.nbytes:
        raise VismmoeError(f"expert record has {buf.numel()} bytes, the quantization_config implies {spec.nbytes}")
    views = {}
    for f in spec.fields:
        views[f.name] = buf[f.offset : f.offset + f.nbytes].view(TORCH_DTYPES[f.dtype]).view(f.shape)
    q = spec.quant
    layout = q.layout
    scales = "scales_zeros" if q.bits == 4 else "scales"
    mats = {
        name: QuantizedMatrix(q.bits, n, k, q.group_size, layout, views[f"{name}.qweight"], views[f"{name}.{scales}"])
        for name, (n, k) in spec.matrices.items()
    }
    return QuantizedExpert(gate_up=mats["gate_up_proj"], down=mats["down_proj"])


def cpu_kernel_ok(m: QuantizedMatrix) -> bool:
    return m.group_size in KERNEL_GROUP_SIZES and m.k % m.group_size == 0 and m.n % 16 == 0


def cuda_inner_k_tiles(m: QuantizedMatrix) -> int | None:
    """tinygemm wants K a multiple of inner_k_tiles * 16 and N a multiple of 8; the largest tile count wins."""
    if m.group_size not in KERNEL_GROUP_SIZES or m.n % 8:
        return None
    return next((t for t in (8, 4, 2) if m.k % (t * 16) == 0), None)


def _to_native_tiles(m: QuantizedMatrix, layout: str) -> QuantizedMatrix:
    codes = unpack_int4(m.qweight, m.layout)
    return replace(m, layout=layout, qweight=pack_cpu_tiles(codes, layout))


def prepare_matrix(m: QuantizedMatrix, device: torch.device) -> QuantizedMatrix:
    """The matrix in the form `linear` computes fastest on `device`; tensors must already be there.

    CUDA int4: tinygemm's layout, built on the GPU (unpack nibbles, swap to its order, repack). CPU int4 in a
    layout other than this CPU's: repacked into it (an owned copy, ~2 ms per 30B-A3B matrix, docs/quantization.md).
    Everything else is returned as is.
    """
    if m.bits != 4 or m.layout == CUDA_TINYGEMM:
        return m
    if device.type == "cuda":
        tiles = cuda_inner_k_tiles(m)
        if tiles is None:
            return m  # dequantize fallback in linear()
        codes = unpack_int4(m.qweight, m.layout)
        packed = torch.ops.aten._convert_weight_to_int4pack(cuda_kernel_input(codes).contiguous(), tiles)
        return replace(m, layout=CUDA_TINYGEMM, qweight=packed, scales=m.scales.to(torch.bfloat16).contiguous())
    native = native_cpu_layout()
    if native is not None and m.layout != native and cpu_kernel_ok(m):
        return _to_native_tiles(m, native)
    return m


def prepare(expert: QuantizedExpert, device: torch.device) -> QuantizedExpert:
    return QuantizedExpert(prepare_matrix(expert.gate_up, device), prepare_matrix(expert.down, device))


def dequantize_matrix(m: QuantizedMatrix, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [n, k] in `dtype`: the reference every kernel is checked against, and the fallback."""
    if m.bits == 8:
        return (m.qweight.to(torch.float32) * m.scales.to(torch.float32)[:, None]).to(dtype)
    if m.layout == CUDA_TINYGEMM:
        raise ValueError("dequantize the expert's record views, not the CUDA-prepared matrix")
    codes = unpack_int4(m.qweight, m.layout).to(torch.float32).view(m.n, m.k // m.group_size, m.group_size)
    sz = m.scales.to(torch.float32)  # [k/g, n, 2]
    scale, zero = sz[..., 0].t(), sz[..., 1].t()
    return ((codes - 8.0) * scale[..., None] + zero[..., None]).view(m.n, m.k).to(dtype)


def dequantize_expert(expert: QuantizedExpert, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) in `dtype`, the orientation experts/compute.py uses."""
    return dequantize_matrix(expert.gate_up, dtype), dequantize_matrix(expert.down, dtype)


_warned: set[str] = set()
_int8_cuda_kernel = [True]  # cleared the first time the CUDA int8 kernel is missing
# int8 on CUDA: "dequantize" (to the activations' dtype, then cuBLAS) or "kernel" (`_weight_int8pack_mm`).
# Dequantize is the default until tools/device/quant_checks.py has timed both on the GPU; VISMMOE_INT8_CUDA or
# set_int8_cuda_path() switches.
INT8_CUDA_PATHS = ("dequantize", "kernel")
_int8_cuda_path = [os.environ.get("VISMMOE_INT8_CUDA", "dequantize")]


def set_int8_cuda_path(path: str) -> None:
    if path not in INT8_CUDA_PATHS:
        raise VismmoeError(f"int8 CUDA path {path!r}: use one of {', '.join(INT8_CUDA_PATHS)}")
    _int8_cuda_path[0] = path


def int8_cuda_path() -> str:
    return _int8_cuda_path[0] if _int8_cuda_path[0] in INT8_CUDA_PATHS else "dequantize"


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def linear(x: torch.Tensor, m: QuantizedMatrix) -> torch.Tensor:
    """x [T, k] @ W.T -> [T, n] in x's dtype."""
    if x.shape[-1] != m.k:
        raise ValueError(f"input has {x.shape[-1]} features, the matrix takes {m.k}")
    if m.layout == CUDA_TINYGEMM:
        y = torch.ops.aten._weight_int4pack_mm(x.to(torch.bfloat16).contiguous(), m.qweight, m.group_size, m.scales)
        return y.to(x.dtype)
    if x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES:
        xc = x.contiguous()
        if m.bits == 8:
            return torch.ops.aten._weight_int8pack_mm(xc, m.qweight, m.scales.to(x.dtype))
        native = native_cpu_layout()
        if cpu_kernel_ok(m) and native is not None:
            w = m.qweight
            if m.layout != native:  # correct, and faster than dequantizing, but 19x the kernel: warn
                _warn_once(
                    m.layout,
                    f"int4 experts in layout {m.layout}, this CPU computes {native}: repacking every call; "
                    "prepare() once per fetch, or re-run quantize with --layout auto here",
                )
                w = _to_native_tiles(m, native).qweight
            return torch.ops.aten._weight_int4pack_mm_for_cpu(xc, w, m.group_size, m.scales.to(x.dtype))
    if m.bits == 8 and x.device.type == "cuda" and int8_cuda_path() == "kernel" and _int8_cuda_kernel[0]:
        try:
            return torch.ops.aten._weight_int8pack_mm(x.contiguous(), m.qweight, m.scales.to(x.dtype))
        except (RuntimeError, NotImplementedError) as e:  # not in every build / dtype: dequantize from now on
            _int8_cuda_kernel[0] = False
            _warn_once("int8-cuda", f"_weight_int8pack_mm failed on CUDA ({str(e).splitlines()[0][:100]}); "
                       "int8 experts dequantize + F.linear instead")  # fmt: skip
    return F.linear(x, dequantize_matrix(m, x.dtype))


def expert_forward(
    x: torch.Tensor, expert: QuantizedExpert, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) for x [T, H] -> [T, H], as experts/compute.py's `_expert`."""
    gate, up = linear(x, expert.gate_up).chunk(2, dim=-1)
    return linear(act_fn(gate) * up, expert.down)


def token_forward(
    x: torch.Tensor,
    experts: Sequence[QuantizedExpert],
    weights: torch.Tensor,
    act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
) -> torch.Tensor:
    """One token's k routed experts: sum_i weights[i] * expert_i(x), x [1, H], weights [k] -> [1, H].

    torch has no grouped int4 kernel, so this is k pairs of GEMVs; on CUDA they queue without a sync.
    """
    if len(experts) != weights.numel():
        raise ValueError(f"{len(experts)} experts but {weights.numel()} routing weights")
    out = torch.zeros_like(x, dtype=torch.float32)
    for expert, w in zip(experts, weights.reshape(-1), strict=True):
        out += expert_forward(x, expert, act_fn).to(torch.float32) * w.to(torch.float32)
    return out.to(x.dtype)
