"""Zero-copy views of experts in the shards' mappings: what the page-cache tiers compute from.

One MAP_SHARED, PROT_READ mapping per shard (pagecache.MappedFile), so compute reads an expert where the page cache
holds it; `unified.py`, `mmap.py` and `igpu_registered.py` share it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import DTYPE_NAMES, TORCH_DTYPES, ExpertCatalogue, ExpertPart, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles
from vismmoe_edge.quant.kernels import QuantizedExpert, expert_views
from vismmoe_edge.quant.record import RECORD_PART

ExpertKey = tuple[int, int]


class MappedShards:
    """One MAP_SHARED read-only mapping per shard that holds experts, and zero-copy views of expert parts."""

    def __init__(self, store: ExpertStore, *, random_access: bool) -> None:
        quantized = store.catalogue.quant is not None  # int4/int8 kernels take any activation dtype
        if not quantized and store.catalogue.dtype != DTYPE_NAMES[store.dtype]:  # one dtype per checkpoint
            raise VismmoeError(
                f"the unified tier computes straight from the page cache, so the compute dtype must be the "
                f"checkpoint's ({store.catalogue.dtype}); pass --dtype auto or use --tier host"
            )
        self.store = store
        shards = sorted({p.shard for loc in store.catalogue.experts.values() for p in loc.parts})
        self.files: dict[Path, pagecache.MappedFile] = {s: pagecache.MappedFile(s) for s in shards}
        for mf in self.files.values():
            if random_access:
                mf.set_random()
            else:
                mf.set_normal()

    def ranges(self, key: ExpertKey) -> dict[Path, list[tuple[int, int]]]:
        out: dict[Path, list[tuple[int, int]]] = {}
        for part in self.store.catalogue.expert(*key).parts:
            out.setdefault(part.shard, []).append((part.offset, part.nbytes))
        return out

    def view(self, part: ExpertPart) -> torch.Tensor:
        mf = self.files[part.shard]
        itemsize = TORCH_DTYPES[part.dtype].itemsize
        with warnings.catch_warnings():  # the mapping is read-only on purpose; we never write through it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(
                mf.buffer, dtype=TORCH_DTYPES[part.dtype], count=part.nbytes // itemsize, offset=part.offset
            )
        t = flat.view(part.shape)
        return t.t() if part.transposed else t

    def weights(self, key: ExpertKey) -> ExpertWeights | QuantizedExpert:
        parts = {p.kind: p for p in self.store.catalogue.expert(*key).parts}
        if RECORD_PART in parts:  # a quantized record: the kernels read its bytes where the page cache has them
            return expert_views(self.view(parts[RECORD_PART]), self.store.catalogue.quant)
        if "gate_up" in parts:
            return ExpertWeights(gate_up=self.view(parts["gate_up"]), down=self.view(parts["down"]))
        # per-expert checkpoints keep gate and up apart. safetensors writes tensors sorted by name, so an expert's
        # gate_proj is usually followed directly by its up_proj: one zero-copy view of both. Otherwise stacking
        # them costs an anonymous copy the memory budget does not count (under a cap it ends in an OOM kill).
        gate, up = parts["gate"], parts["up"]
        adjacent = gate.shard == up.shard and up.offset == gate.offset + gate.nbytes
        if adjacent and gate.shape[1:] == up.shape[1:] and not (gate.transposed or up.transposed):
            both = replace(gate, kind="gate_up", nbytes=gate.nbytes + up.nbytes,
                           shape=(gate.shape[0] + up.shape[0], *gate.shape[1:]))  # fmt: skip
            gate_up = self.view(both)
        else:
            gate_up = torch.cat([self.view(gate), self.view(up)])
        return ExpertWeights(gate_up=gate_up, down=self.view(parts["down"]))


def drop_unneeded_pages(
    files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned: set[int]
) -> None:
    """Give back the page cache that loading filled: the non-expert weights now live in our own memory, and
    fault read-around pulled in streamed experts nobody asked for. Unified memory counts page cache against
    the same DRAM, and a cgroup counts it against the process."""
    files.close()  # unmapped pages are the only ones POSIX_FADV_DONTNEED can drop
    ranges = [(i.shard, i.offset, i.nbytes) for n, i in table.items() if n not in catalogue.tensor_names]
    for loc in catalogue.experts.values():
        if loc.layer not in pinned:
            ranges += [(p.shard, p.offset, p.nbytes) for p in loc.parts]
    fds: dict[Path, int] = {}
    try:
        for shard, offset, nbytes in ranges:
            fd = fds.get(shard)
            if fd is None:
                fd = fds[shard] = os.open(shard, os.O_RDONLY)
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        for fd in fds.values():
            os.close(fd)
