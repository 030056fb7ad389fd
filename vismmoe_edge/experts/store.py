"""Where an expert's bytes live: read-only views of the mmapped shards, turned into owned weights on demand."""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES, ExpertCatalogue, ExpertLocation, ExpertPart, TensorInfo
from vismmoe_edge.config import cache_expert_bytes
from vismmoe_edge.quant.kernels import QuantizedExpert
from vismmoe_edge.quant.slot_form import SlotForm


@dataclass
class ExpertWeights:
    """One expert in nn.Linear orientation: gate_up [2I, H] (gate rows first, then up) and down [H, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes


class ShardFiles:
    """One mmap per shard, opened lazily; MAP_PRIVATE so torch can wrap the bytes without copying them."""

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}

    def view(self, shard: Path, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy tensor over the file bytes; it page-faults on use, so callers copy what they keep."""
        mm = self._maps.get(shard)
        if mm is None:
            fd = os.open(shard, os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            self._maps[shard] = mm
        flat = torch.frombuffer(
            mm, dtype=TORCH_DTYPES[dtype], count=nbytes // TORCH_DTYPES[dtype].itemsize, offset=offset
        )
        return flat.view(shape)

    def tensor(self, info: TensorInfo) -> torch.Tensor:
        return self.view(info.shard, info.offset, info.nbytes, info.dtype, info.shape)

    def close(self) -> None:
        """Unmap every shard no tensor views (each map holds a file descriptor); a viewed one goes with its views."""
        for shard, mm in list(self._maps.items()):
            try:
                mm.close()
            except BufferError:  # weights that compute reads in place still point into it
                continue
            del self._maps[shard]


class ExpertStore:
    """Reads routed experts from the checkpoint into the compute dtype and device, whatever the layout."""

    def __init__(self, catalogue: ExpertCatalogue, files: ShardFiles, dtype: torch.dtype, device: torch.device):
        self.catalogue = catalogue
        self.files = files
        self.dtype = dtype
        self.device = device
        self.bytes_read = 0

    def expert_nbytes(self) -> int:
        """Bytes one expert takes in memory once converted to the compute dtype (quantized: its record)."""
        return cache_expert_bytes(self.catalogue, self.dtype)

    def _part(self, part: ExpertPart) -> torch.Tensor:
        raw = self.files.view(part.shard, part.offset, part.nbytes, part.dtype, part.shape)
        self.bytes_read += part.nbytes
        return raw.t() if part.transposed else raw

    def load(self, layer: int, expert: int) -> ExpertWeights | QuantizedExpert:
        loc: ExpertLocation = self.catalogue.expert(layer, expert)
        if self.catalogue.quant is not None:  # an owned copy of the record, in the device's kernel layout
            record = self._owned(self._part(loc.parts[0]))
            form = SlotForm.for_device(self.catalogue.quant, self.device)
            if form.rebuilds:
                form.build(record)
            return form.views(record)
        parts = {p.kind: self._part(p) for p in loc.parts}
        if "gate_up" in parts:
            gate_up = parts["gate_up"]
        else:
            gate_up = torch.cat([parts["gate"], parts["up"]], dim=0)
        return ExpertWeights(gate_up=self._owned(gate_up), down=self._owned(parts["down"]))

    def _owned(self, src: torch.Tensor) -> torch.Tensor:
        # Always copy out of the mmap: a cached view would page-fault inside every GEMM and escape the budget.
        dtype = self.dtype if src.dtype.is_floating_point else src.dtype  # a quantized record stays bytes
        out = torch.empty(src.shape, dtype=dtype, device=self.device)
        out.copy_(src)
        return out
