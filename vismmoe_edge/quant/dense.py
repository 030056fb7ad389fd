"""Quantized dense weights: attention projections, lm_head, dense and shared MLPs, and the vision tower's linears.

On disk a quantized nn.Linear `X` (weight `X.weight`) is stored as the experts' matrices are (record.py):

    int4 (group g, the file's layout L):   X.qweight U8 [N, K/2]   X.scales_zeros BF16 [K/g, N, 2]
    int8 (per output channel):             X.qweight I8 [N, K]     X.scales BF16 [N]

and `X.bias`, if any, keeps its dtype. Which one a tensor got is read from its companion's name, so one file may
hold both: the language model at `--dense-bits`, the vision tower at int8 (its widths, e.g. Qwen3-VL's 4304,
are not multiples of the int4 groups), and an int4 matrix the kernels cannot tile at int8. Routers, norms,
embeddings and convolutions keep their dtype.

At load time every such `X` becomes a `QuantizedLinear` computing with kernels.linear (torch's int4/int8 kernels on
CPU and CUDA, as the experts do). The token embedding of a quantized file is not held: `RowEmbedding` preads the
rows a step needs from the shard.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from vismmoe_edge.checkpoint import TORCH_DTYPES, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import KERNEL_GROUP_SIZES
from vismmoe_edge.quant.kernels import CUDA_TINYGEMM, QuantizedMatrix, linear, prepare_matrix
from vismmoe_edge.quant.packing import pack_int4
from vismmoe_edge.quant.quantize import SCALE_DTYPE, quantize_int4, quantize_int8

QUANT_SUFFIXES = (".qweight", ".scales_zeros", ".scales")
VISION_KEY = re.compile(r"(^|\.)(visual|vision|vision_model|vision_tower|projector)\.")
# Kept at full precision: routers pick the experts (a flipped choice costs more than the bytes save), and tiny
# per-layer vectors are not worth a kernel.
_KEEP = re.compile(r"(\.gate|\.router|\.classifier)$")
_INT8_CUDA_CHUNK = 16384  # output rows dequantized at a time where no int8 kernel runs (bounds lm_head's temporary)


@dataclass(frozen=True)
class DenseChoice:
    """How one linear is stored: its weight's name, shape (N, K) and bits (group size for int4)."""

    weight: str
    n: int
    k: int
    bits: int
    group_size: int | None

    @property
    def base(self) -> str:
        return self.weight.removesuffix(".weight")

    def fields(self, layout: str) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of the stored tensors, in write order."""
        if self.bits == 4:
            g = self.group_size
            assert g is not None
            return [(f"{self.base}.qweight", "U8", (self.n, self.k // 2)),
                    (f"{self.base}.scales_zeros", "BF16", (self.k // g, self.n, 2))]  # fmt: skip
        return [(f"{self.base}.qweight", "I8", (self.n, self.k)), (f"{self.base}.scales", "BF16", (self.n,))]

    @property
    def nbytes(self) -> int:
        if self.bits == 4:
            assert self.group_size is not None
            return self.n * self.k // 2 + (self.k // self.group_size) * self.n * 2 * 2
        return self.n * self.k + 2 * self.n


def int4_fits(n: int, k: int, group_size: int) -> bool:
    """What the int4 kernels tile without falling back: K a multiple of the group, N of 16 (CPU blocks)."""
    return k % group_size == 0 and n % 16 == 0 and k % 2 == 0


def choose(weight: str, n: int, k: int, dense_bits: int, group_size: int) -> DenseChoice:
    """The language model's linears at `dense_bits`, the vision tower's at int8. int4 takes the largest group the
    kernels accept that is at most `group_size` and divides K (e.g. 64 for a width of 192); a matrix no such group
    tiles is stored int8."""
    bits = 8 if VISION_KEY.search(weight) else dense_bits
    group = next((g for g in sorted(KERNEL_GROUP_SIZES, reverse=True) if g <= group_size and int4_fits(n, k, g)), None)
    if bits == 4 and group is None:
        bits = 8
    return DenseChoice(weight, n, k, bits, group if bits == 4 else None)


def linear_weights(model: nn.Module, exclude: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """Weight name -> (N, K) of every nn.Linear of `model` (built on the meta device), routers and `exclude` out."""
    skip = set(exclude)
    out = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not _KEEP.search(name) and f"{name}.weight" not in skip:
            out[f"{name}.weight"] = (int(module.out_features), int(module.in_features))
    return out


def encode(choice: DenseChoice, w: torch.Tensor, layout: str) -> list[torch.Tensor]:
    """W [N, K] -> the stored tensors of `choice`, in `fields` order."""
    if choice.bits == 4:
        assert choice.group_size is not None
        q = quantize_int4(w, choice.group_size)
        sz = torch.stack([q.scale.t(), q.zero.t()], dim=-1).to(SCALE_DTYPE).contiguous()
        return [pack_int4(q.codes, layout).contiguous(), sz]
    q8, scale = quantize_int8(w)
    return [q8.contiguous(), scale.contiguous()]


def stored_matrices(table: dict[str, TensorInfo], layout: str) -> dict[str, DenseChoice]:
    """base name -> DenseChoice of every quantized linear in a checkpoint's tensor table; shapes are checked."""
    out: dict[str, DenseChoice] = {}
    for name, info in table.items():
        if not name.endswith(".qweight") or ".experts." in name:
            continue
        base = name.removesuffix(".qweight")
        if f"{base}.scales_zeros" in table:
            sz = table[f"{base}.scales_zeros"]
            n, k = info.shape[0], info.shape[1] * 2
            groups = sz.shape[0] if len(sz.shape) == 3 else 0
            choice = DenseChoice(f"{base}.weight", n, k, 4, k // groups if groups and k % groups == 0 else None)
        elif f"{base}.scales" in table:
            n, k = info.shape[0], info.shape[1]
            choice = DenseChoice(f"{base}.weight", n, k, 8, None)
        else:
            raise VismmoeError(f"{info.shard}: {name} has no scales beside it; the checkpoint is incomplete")
        if choice.bits == 4 and choice.group_size is None:
            raise VismmoeError(f"{info.shard}: {base}.scales_zeros has no group count that divides {k} inputs")
        for fname, dtype, shape in choice.fields(layout):
            found = table[fname]
            if found.dtype != dtype or tuple(found.shape) != shape:
                raise VismmoeError(
                    f"{found.shard}: {fname} is {found.dtype} {list(found.shape)}, its qweight implies {dtype} "
                    f"{list(shape)}; re-run vismmoe-edge quantize"
                )
        out[base] = choice
    return out


class QuantizedLinear(nn.Module):
    """nn.Linear's forward over an int4/int8 matrix: kernels.linear on the stored bytes (prepared once per device)."""

    def __init__(self, choice: DenseChoice, layout: str, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = choice.k, choice.n
        self.bits, self.group_size, self.layout = choice.bits, choice.group_size, layout
        self.scale_name = "scales_zeros" if choice.bits == 4 else "scales"
        for fname, dtype, shape in choice.fields(layout):
            self.register_buffer(fname.rsplit(".", 1)[1], torch.empty(shape, dtype=TORCH_DTYPES[dtype], device="meta"))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._prepared: QuantizedMatrix | None = None

    def matrix(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.bits, self.out_features, self.in_features, self.group_size, self.layout,
                               self.qweight, getattr(self, self.scale_name))  # fmt: skip

    def prepare(self, device: torch.device) -> None:
        """Build the kernel's form once (CUDA int4: tinygemm tiles; CPU int4 in another CPU's layout: this one's)."""
        m = prepare_matrix(self.matrix(), device)
        self._prepared = m
        if m.layout == CUDA_TINYGEMM:  # the nibbles are no longer needed: hold the tiles only
            self.qweight, self.layout = m.qweight, CUDA_TINYGEMM
            setattr(self, self.scale_name, m.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self._prepared if self._prepared is not None else self.matrix()
        flat = x.reshape(-1, self.in_features)
        if m.bits == 8 and flat.device.type == "cuda" and m.n > _INT8_CUDA_CHUNK:
            y = torch.cat([linear(flat, _rows(m, i, i + _INT8_CUDA_CHUNK)) for i in range(0, m.n, _INT8_CUDA_CHUNK)],
                          dim=-1)  # fmt: skip
        else:
            y = linear(flat, m)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}{group}"


def _rows(m: QuantizedMatrix, start: int, stop: int) -> QuantizedMatrix:
    stop = min(stop, m.n)
    return replace(m, n=stop - start, qweight=m.qweight[start:stop], scales=m.scales[start:stop])


def swap_quantized_linears(model: nn.Module, choices: dict[str, DenseChoice], layout: str) -> None:
    """Replace every nn.Linear named in `choices` (by base name) with a QuantizedLinear of meta buffers, filled by
    load_state_dict; a choice without such a Linear is a checkpoint that does not match config.json."""
    modules = dict(model.named_modules())
    for base, choice in choices.items():
        old = modules.get(base)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != (choice.n, choice.k):
            raise VismmoeError(
                f"quantized tensor {base}.qweight matches no [{choice.n}, {choice.k}] linear of the model; "
                "the checkpoint does not match config.json"
            )
        parent_name, _, child = base.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        setattr(parent, child, QuantizedLinear(choice, layout, old.bias))


def prepare_quantized_linears(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.prepare(device)


class RowEmbedding(nn.Module):
    """nn.Embedding whose rows stay in the checkpoint: each call preads the rows of the ids it is given.

    The shard is opened once; a step reads k rows of `hidden x itemsize` bytes (4 KiB for Qwen3-VL-30B-A3B in
    bf16), a prompt one row per token. Nothing is held but the file descriptor, so the 0.58 GiB embedding of a
    151,936-token vocabulary leaves the resident set.
    """

    def __init__(self, info: TensorInfo, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if len(info.shape) != 2:
            raise VismmoeError(f"{info.shard}: {info.name} is not a 2-D embedding")
        self.num_embeddings, self.embedding_dim = info.shape
        self.stored = info.torch_dtype
        self.row_bytes = self.embedding_dim * self.stored.itemsize
        self.offset, self.dtype, self.device = info.offset, dtype, device
        self.path = Path(info.shard)
        self.fd = os.open(self.path, os.O_RDONLY)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)
            self.fd = None

    def host_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of `ids` (any shape, on the CPU) at the compute dtype, on the CPU: [*ids.shape, H]."""
        flat = ids.reshape(-1).tolist()
        out = torch.empty(len(flat), self.embedding_dim, dtype=self.stored)
        raw = out.view(torch.uint8).view(len(flat), self.row_bytes)
        for i, token in enumerate(flat):
            if not 0 <= token < self.num_embeddings:
                raise IndexError(f"token id {token} is outside the vocabulary of {self.num_embeddings}")
            buf = os.pread(self.fd, self.row_bytes, self.offset + token * self.row_bytes)
            if len(buf) != self.row_bytes:
                raise VismmoeError(f"{self.path}: short read of the embedding; the shard is truncated")
            raw[i] = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        return out.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.host_rows(ids.cpu())
        return rows.to(self.device, non_blocking=False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from {self.path.name}"


def dequantized_weight(read: Callable[[str], torch.Tensor], choice: DenseChoice, layout: str, dtype: torch.dtype):
    """W [N, K] in `dtype` from the stored tensors (`read(name)`): what transformers gets in the reference."""
    from vismmoe_edge.quant.kernels import dequantize_matrix

    tensors = [read(name) for name, _, _ in choice.fields(layout)]
    m = QuantizedMatrix(choice.bits, choice.n, choice.k, choice.group_size, layout, tensors[0], tensors[1])
    return dequantize_matrix(m, dtype)
