"""Reading source tensors with pread: one tensor, or one expert's slice of a fused tensor, per call.

Not mmap: on an 8 GB board converting a 61 GB checkpoint, every page a mapping has touched stays in the process
(and its memory cgroup) until unmapped. pread copies exactly the bytes asked for into an owned buffer, and
POSIX_FADV_DONTNEED then drops them from the page cache, so memory stays at the tensor being converted.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.errors import VismmoeError


class PreadFiles:
    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def _fd(self, shard: Path) -> int:
        fd = self._fds.get(shard)
        if fd is None:
            try:
                fd = os.open(shard, os.O_RDONLY)
            except OSError as e:
                raise VismmoeError(f"{shard}: cannot open ({e.strerror}); check the path and permissions") from e
            self._fds[shard] = fd
        return fd

    def read(self, info: TensorInfo, index: int | None = None) -> torch.Tensor:
        """The tensor (or row `index` of its first dimension) as an owned tensor."""
        shape = info.shape if index is None else info.shape[1:]
        nbytes = math.prod(shape) * info.torch_dtype.itemsize
        offset = info.offset + (0 if index is None else index * nbytes)
        if index is not None and not 0 <= index < info.shape[0]:
            raise IndexError(f"{info.name}: index {index} out of {info.shape[0]}")
        fd = self._fd(info.shard)
        buf = bytearray(nbytes)
        view, done = memoryview(buf), 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise VismmoeError(
                    f"{info.shard}: ends inside tensor {info.name}; the shard is truncated, re-download it"
                )
            done += n
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
        if nbytes == 0:
            return torch.empty(shape, dtype=info.torch_dtype)
        return torch.frombuffer(buf, dtype=info.torch_dtype).view(shape)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
