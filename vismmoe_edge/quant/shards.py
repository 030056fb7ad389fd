"""Writing safetensors shards tensor by tensor, in an order we choose.

`safetensors.torch.save_file` needs the whole shard in memory and orders data by dtype, which would split an
expert's uint8 codes from its bf16 scales. The format itself only asks that data ranges tile the buffer, so we
write the header first (all shapes are known in advance) and then stream each tensor as it is produced.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import DTYPE_NAMES, TORCH_DTYPES
from vismmoe_edge.errors import VismmoeError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TORCH_DTYPES[self.dtype].itemsize


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5GB" (10^9) or "4GiB" (2^30)."""
    if isinstance(size, int) and size > 0:
        return size
    m = _SIZE.match(str(size))
    if m is None or float(m[1]) <= 0:
        raise VismmoeError(f"--max-shard-size {size!r}: give bytes or a size like 5GB or 4GiB")
    power = "KMGT".find(m[2].upper()) + 1 if m[2] else 0
    return int(float(m[1]) * (1024 if m[3] else 1000) ** power)


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Greedy packing of units (by index; an expert record is one unit, never split) into shards."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, nbytes in enumerate(sizes):
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return [s for s in shards if s]


class ShardWriter:
    """One safetensors file: header from `entries`, then `write` each tensor in that order, then `close`."""

    def __init__(self, path: Path, entries: list[Entry]) -> None:
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for e in entries:
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors' own writer does
        self.path = path
        self.entries = entries
        self.data_start = 8 + len(raw)
        self._next = 0
        self._file = path.open("wb")
        self._file.write(struct.pack("<Q", len(raw)))
        self._file.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        e = self.entries[self._next]
        if name != e.name or tuple(tensor.shape) != e.shape or DTYPE_NAMES.get(tensor.dtype) != e.dtype:
            raise AssertionError(f"{self.path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned {e}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.entries):
            raise AssertionError(f"{self.path.name}: {self._next} of {len(self.entries)} tensors written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        self._file.close()
