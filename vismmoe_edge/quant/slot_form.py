"""What a quantized expert looks like inside a slot: its record's bytes, with each int4 matrix in the layout the
device's kernel reads, rebuilt in place once per fetch.

A slot is `spec.nbytes` bytes, the record's size, on every device: the fields stay where the record has them,
and only the int4 codes change layout.
- CPU: the CPU kernel's tiles for this machine (packing.native_cpu_layout()). A file converted here is already
  in them, so a fetch is one copy; another layout is repacked in place (~2 ms per 30B-A3B matrix).
- CUDA: tinygemm's int32 tiles (`_convert_weight_to_int4pack`), built on the GPU from the record's nibbles right
  after their DMA. The tiles take exactly the nibbles' bytes, so they overwrite them.
- CUDA for the Triton decode kernel (`for_device(..., triton=True)`, kernels/moe_int4.py): the file's plain
  row-major nibbles (packing.ROWMAJOR), which a Triton GEMV reads with one byte load per two codes; tinygemm's
  tiles are opaque to it. A row-major file is then one DMA; a file in a CPU's tiles is repacked on the GPU
  after the DMA, as for tinygemm. The pool asks for this form (experts/tiers/quant_slots.py,
  `triton_int4_slots`) only where the device decode path will read it; everything else keeps tinygemm's.
- int8, and int4 matrices a kernel cannot take (group sizes other than 32..256, odd shapes): the record's bytes
  as they are (kernels.linear dequantizes those).
The scales stay as stored: `[K/g, N, 2]` bf16 is what both int4 kernels take. `views(buf)` turns one slot's
bytes into the QuantizedExpert that kernels.expert_forward computes with, with no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.quant.kernels import (
    CUDA_TINYGEMM,
    QuantizedExpert,
    QuantizedMatrix,
    cpu_kernel_ok,
    cuda_inner_k_tiles,
)
from vismmoe_edge.quant.packing import ROWMAJOR, cuda_kernel_input, native_cpu_layout, pack_int4, unpack_int4
from vismmoe_edge.quant.record import ExpertSpec, RecordField

MATRICES = ("gate_up_proj", "down_proj")


def triton_group_ok(group_size: int | None) -> bool:
    """Groups the Triton int4 GEMV takes: a power of two, so a block of codes splits into whole groups."""
    return group_size is not None and group_size >= 2 and group_size & (group_size - 1) == 0


def tinygemm_shape(n: int, k: int, inner_k_tiles: int) -> tuple[int, int, int, int]:
    """The int32 tensor `_convert_weight_to_int4pack(uint8 [n, k/2], inner_k_tiles)` returns (n*k/8 words)."""
    return (n // 8, k // (inner_k_tiles * 16), 32, inner_k_tiles // 2)


@dataclass(frozen=True)
class SlotForm:
    """How each matrix's codes sit in a slot on `device`: `layouts[matrix]` is a packing layout of the file's,
    this CPU's tiles, or CUDA_TINYGEMM (then `tiles[matrix]` is its inner_k_tiles)."""

    spec: ExpertSpec
    device: torch.device
    layouts: dict[str, str]
    tiles: dict[str, int]

    @staticmethod
    def for_device(spec: ExpertSpec, device: torch.device, *, triton: bool = False) -> SlotForm:
        """`triton`: int4 matrices in row-major nibbles for the Triton GEMV (group sizes it takes), on any device
        (the CPU only in the interpreter's tests: the CPU pools never ask for it)."""
        layouts: dict[str, str] = {}
        tiles: dict[str, int] = {}
        q = spec.quant
        for name, (n, k) in spec.matrices.items():
            layouts[name] = q.layout
            if q.bits != 4:
                continue
            if triton and triton_group_ok(q.group_size):
                layouts[name] = ROWMAJOR
                continue
            probe = QuantizedMatrix(4, n, k, q.group_size, q.layout, torch.empty(0), torch.empty(0))
            if device.type == "cuda":
                t = cuda_inner_k_tiles(probe)
                if t is not None:
                    layouts[name], tiles[name] = CUDA_TINYGEMM, t
            elif (native := native_cpu_layout()) is not None and cpu_kernel_ok(probe):
                layouts[name] = native
        return SlotForm(spec, device, layouts, tiles)

    @property
    def triton_int4(self) -> bool:
        """int4 matrices all in row-major nibbles with groups the Triton GEMV takes (kernels/moe_int4.py)."""
        q = self.spec.quant
        return q.bits == 4 and triton_group_ok(q.group_size) and all(self.layouts[m] == ROWMAJOR for m in MATRICES)

    @property
    def rebuilds(self) -> bool:
        """Whether a fetch must rewrite the codes after copying the record (False: one copy is all)."""
        return any(self.layouts[m] != self.spec.quant.layout for m in MATRICES)

    def _fields(self) -> dict[str, RecordField]:
        return {f.name: f for f in self.spec.fields}

    def _qweight(self, buf: torch.Tensor, name: str, f: RecordField) -> torch.Tensor:
        raw = buf[f.offset : f.offset + f.nbytes]
        if self.layouts[name] == CUDA_TINYGEMM:
            n, k = self.spec.matrices[name]
            return raw.view(torch.int32).view(tinygemm_shape(n, k, self.tiles[name]))
        return raw.view(TORCH_DTYPES[f.dtype]).view(f.shape)

    def views(self, buf: torch.Tensor) -> QuantizedExpert:
        """Zero-copy kernel views of one slot's bytes (uint8 [spec.nbytes], on any device)."""
        fields, q = self._fields(), self.spec.quant
        scales = "scales_zeros" if q.bits == 4 else "scales"
        mats = {}
        for name, (n, k) in self.spec.matrices.items():
            qf, sf = fields[f"{name}.qweight"], fields[f"{name}.{scales}"]
            sz = buf[sf.offset : sf.offset + sf.nbytes].view(TORCH_DTYPES[sf.dtype]).view(sf.shape)
            qweight = self._qweight(buf, name, qf)
            mats[name] = QuantizedMatrix(q.bits, n, k, q.group_size, self.layouts[name], qweight, sz)
        return QuantizedExpert(gate_up=mats["gate_up_proj"], down=mats["down_proj"])

    def batched(self, bufs: torch.Tensor, field: str) -> torch.Tensor:
        """Field `field` (e.g. "down_proj.scales") of k slots' bytes `bufs` [k, nbytes] as one [k, *shape] view."""
        f = self._fields()[field]
        return bufs[:, f.offset : f.offset + f.nbytes].view(TORCH_DTYPES[f.dtype]).view(bufs.shape[0], *f.shape)

    def build(self, buf: torch.Tensor) -> None:
        """Rewrite a slot that holds the record as stored into this form, in place, on the slot's device (CUDA:
        queued on the current stream, after the DMA that filled it)."""
        fields = self._fields()
        for name, (n, k) in self.spec.matrices.items():
            layout = self.layouts[name]
            if layout == self.spec.quant.layout:
                continue
            f = fields[f"{name}.qweight"]
            raw = buf[f.offset : f.offset + f.nbytes]
            codes = unpack_int4(raw.view(n, k // 2), self.spec.quant.layout)
            if layout == CUDA_TINYGEMM:
                tiles = self.tiles[name]
                packed = torch.ops.aten._convert_weight_to_int4pack(cuda_kernel_input(codes).contiguous(), tiles)
                want = tinygemm_shape(n, k, tiles)
                if tuple(packed.shape) != want or packed.dtype != torch.int32:
                    raise RuntimeError(
                        f"_convert_weight_to_int4pack gave {packed.dtype} {list(packed.shape)}, expected int32 "
                        f"{list(want)}: this torch's tinygemm layout changed"
                    )
                raw.view(torch.int32).view(want).copy_(packed)
            else:  # another CPU's tiles, or row-major nibbles for the Triton GEMV
                raw.view(n, k // 2).copy_(pack_int4(codes, layout))
