"""One routed expert on disk: a record of four tensors written back to back, so one read fetches all of it.

int4 (group g, layout L):              int8 (per output channel):
  gate_up_proj.qweight      U8  [2I, H/2]       gate_up_proj.qweight  I8   [2I, H]
  gate_up_proj.scales_zeros BF16 [H/g, 2I, 2]   gate_up_proj.scales   BF16 [2I]
  down_proj.qweight         U8  [H, I/2]        down_proj.qweight     I8   [H, I]
  down_proj.scales_zeros    BF16 [I/g, H, 2]    down_proj.scales      BF16 [H]

Matrices are in nn.Linear orientation (gate rows, then up rows). `qweight` bytes are in layout L (packing.py);
`scales_zeros` is exactly the [K/g, N, 2] (scale, zero) tensor both tinygemm kernels take, so nothing is
rebuilt per fetch. Each record is named `{experts prefix}.{j}.{field}` in the safetensors shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import QuantConfig
from vismmoe_edge.quant.packing import pack_int4
from vismmoe_edge.quant.quantize import SCALE_DTYPE, Int4Groups, quantize_int4, quantize_int8

RECORD_PART = "record"  # the kind of an expert's one ExpertPart in the engine's catalogue (its whole record)


@dataclass(frozen=True)
class RecordField:
    name: str  # e.g. "gate_up_proj.qweight"
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the record

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class ExpertSpec:
    """Everything needed to lay out or view one expert's record."""

    quant: QuantConfig
    hidden: int
    inter: int

    @property
    def matrices(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each matrix, nn.Linear orientation."""
        return {"gate_up_proj": (2 * self.inter, self.hidden), "down_proj": (self.hidden, self.inter)}

    @property
    def fields(self) -> list[RecordField]:
        out: list[RecordField] = []
        offset = 0
        for matrix, (n, k) in self.matrices.items():
            if self.quant.bits == 4:
                g = self.quant.group_size
                shapes = [("qweight", "U8", (n, k // 2)), ("scales_zeros", "BF16", (k // g, n, 2))]
            else:
                shapes = [("qweight", "I8", (n, k)), ("scales", "BF16", (n,))]
            for part, dtype, shape in shapes:
                f = RecordField(f"{matrix}.{part}", dtype, shape, offset)
                out.append(f)
                offset += f.nbytes
        return out

    @property
    def nbytes(self) -> int:
        last = self.fields[-1]
        return last.offset + last.nbytes

    @property
    def dense_nbytes_bf16(self) -> int:
        return 3 * self.hidden * self.inter * 2

    def check_geometry(self) -> None:
        """One-line errors for dimensions this format or its kernels cannot hold."""
        for matrix, (n, k) in self.matrices.items():
            if self.quant.bits == 4 and n % 16:  # the int4 kernels' tiles (CPU: 16-row blocks, CUDA: 8)
                raise VismmoeError(f"{matrix}: {n} outputs; int4 experts need a multiple of 16 (use --bits 8)")
            if self.quant.bits == 4 and k % self.quant.group_size:
                raise VismmoeError(
                    f"--group-size {self.quant.group_size} does not divide {matrix}'s {k} inputs "
                    f"(hidden {self.hidden}, moe_intermediate {self.inter}); pick a divisor of both"
                )


def encode_matrix(spec: ExpertSpec, w: torch.Tensor | Int4Groups) -> list[torch.Tensor]:
    """A dense W [N, K] (or int4 groups already chosen by the source) -> the record tensors of one matrix."""
    if spec.quant.bits == 4:
        q = w if isinstance(w, Int4Groups) else quantize_int4(w, spec.quant.group_size)
        if q.group_size != spec.quant.group_size:
            raise ValueError(f"int4 groups of {q.group_size}, the record wants {spec.quant.group_size}")
        sz = torch.stack([q.scale.t(), q.zero.t()], dim=-1).to(SCALE_DTYPE).contiguous()
        return [pack_int4(q.codes, spec.quant.layout).contiguous(), sz]
    if isinstance(w, Int4Groups):
        w = w.dequantize()
    q8, scale = quantize_int8(w)
    return [q8.contiguous(), scale.contiguous()]


def encode_expert(
    spec: ExpertSpec, gate_up: torch.Tensor | Int4Groups, down: torch.Tensor | Int4Groups
) -> list[torch.Tensor]:
    """The record's tensors in field order; shapes and dtypes are checked against `spec.fields`."""
    tensors = encode_matrix(spec, gate_up) + encode_matrix(spec, down)
    for f, t in zip(spec.fields, tensors, strict=True):
        if tuple(t.shape) != f.shape or t.dtype != TORCH_DTYPES[f.dtype]:
            raise AssertionError(f"{f.name}: encoded {tuple(t.shape)} {t.dtype}, the record wants {f.shape} {f.dtype}")
    return tensors
