"""A pinned host tier between the disk and the GPU slot pool: every streamed expert's bytes in page-locked RAM.

Where host RAM holds all streamed experts (a desktop with a discrete GPU, 128 GiB beside an H200), a GPU miss
becomes one DMA from this mirror into the slot, queued on a copy stream from the compute thread: no staging
memcpy, no I/O thread, no interpreter on the transfer's path. The mirror is filled once at load by the page-cache
pread pool (native threads, no GIL), straight into the pinned buffers, and the page cache those reads filled is
dropped again: holding the bytes twice would halve what the host can keep.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vismmoe_edge.checkpoint import TORCH_DTYPES, ExpertCatalogue, ExpertPart
from vismmoe_edge.experts import pagecache

ExpertKey = tuple[int, int]
CHUNK_BYTES = 1 << 30  # pinned memory is taken in 1 GiB pieces: one huge cudaHostAlloc can take tens of seconds


class HostMirror:
    """The raw bytes of `keys`, each expert's parts back to back as the shards store them."""

    def __init__(self, catalogue: ExpertCatalogue, keys: Iterable[ExpertKey], *, pin: bool = True) -> None:
        self.catalogue = catalogue
        self.keys = list(keys)
        self.expert_bytes = catalogue.expert_bytes
        per_chunk = max(1, CHUNK_BYTES // self.expert_bytes)
        self.buffers: list[torch.Tensor] = []
        for start in range(0, len(self.keys), per_chunk):
            count = min(per_chunk, len(self.keys) - start)
            self.buffers.append(torch.empty(count * self.expert_bytes, dtype=torch.uint8, pin_memory=pin))
        self.per_chunk = per_chunk
        self.index = {key: i for i, key in enumerate(self.keys)}
        self.nbytes = len(self.keys) * self.expert_bytes
        self._slot_shaped: dict[torch.dtype, bool] = {}

    def slot_shaped(self, dtype: torch.dtype) -> bool:
        """Whether every expert here is stored as a slot holds it (gate_up then down, or gate, up, down;
        untransposed; in `dtype`), so that the slot kernels can read its bytes in place. Asked once per request
        on a daemon's path and fixed at load: computed once per dtype."""
        if dtype not in self._slot_shaped:

            def as_slot(parts: tuple[ExpertPart, ...]) -> bool:
                if tuple(p.kind for p in parts) not in (("gate_up", "down"), ("gate", "up", "down")):
                    return False
                return not any(p.transposed or TORCH_DTYPES[p.dtype] != dtype for p in parts)

            self._slot_shaped[dtype] = all(as_slot(self.catalogue.expert(*key).parts) for key in self.keys)
        return self._slot_shaped[dtype]

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self.index

    def expert(self, key: ExpertKey) -> torch.Tensor:
        i = self.index[key]
        chunk, at = divmod(i, self.per_chunk)
        return self.buffers[chunk][at * self.expert_bytes : (at + 1) * self.expert_bytes]

    def part(self, key: ExpertKey, part: ExpertPart) -> torch.Tensor:
        """One part as stored (its dtype and shape), a view of the pinned bytes."""
        raw = self.expert(key)
        offset = 0
        for p in self.catalogue.expert(*key).parts:
            if p is part:
                break
            offset += p.nbytes
        return raw[offset : offset + part.nbytes].view(TORCH_DTYPES[part.dtype]).view(part.shape)

    def fill(self, *, threads: int = 8, batch: int = 32, progress: bool = True) -> None:
        """Read every expert from the shards into the mirror (`batch` experts per pread-pool call, so the pool's
        threads stay busy), then drop the page cache those reads left behind."""
        files: dict[Path, pagecache.MappedFile] = {}
        bar = tqdm(total=self.nbytes, desc="filling the pinned host tier", unit="B", unit_scale=True,
                   disable=None if progress else True, leave=False)  # fmt: skip
        try:
            for start in range(0, len(self.keys), batch):
                keys = self.keys[start : start + batch]
                by_shard: dict[Path, tuple[list[tuple[int, int]], list[torch.Tensor]]] = {}
                for key in keys:
                    raw, offset = self.expert(key), 0
                    for part in self.catalogue.expert(*key).parts:
                        ranges, dests = by_shard.setdefault(part.shard, ([], []))
                        ranges.append((part.offset, part.nbytes))
                        dests.append(raw[offset : offset + part.nbytes])
                        offset += part.nbytes
                for shard, (ranges, dests) in by_shard.items():
                    mf = files.get(shard)
                    if mf is None:
                        mf = files[shard] = pagecache.MappedFile(shard)
                        mf.set_random()
                    pagecache.read_into(mf, ranges, dests, threads=threads)
                    for offset, nbytes in ranges:
                        os.posix_fadvise(mf.fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
                bar.update(len(keys) * self.expert_bytes)
        finally:
            bar.close()
            for mf in files.values():
                mf.close()
