"""Unified-memory tiers (Jetson, CPU hosts): compute reads experts straight from the mmapped shards.

The page cache is the expert cache. `UnifiedTier` manages it explicitly: the shards are mapped MADV_RANDOM
(a fault reads one page, not 8-16 MiB of read-around), a fetch reads exactly the expert's byte ranges with a
pread pool (pagecache.py), an eviction drops those pages again (MADV_DONTNEED + POSIX_FADV_DONTNEED), and
before compute reads an expert its residency is checked with mincore and any page the kernel reclaimed
meanwhile is read back. `MmapTier` is the baseline with no management at all: plain faults through the
mapping with the kernel's default readahead, what llama.cpp does by default.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import DTYPE_NAMES, TORCH_DTYPES, ExpertPart
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights
from vismmoe_edge.quant.kernels import QuantizedExpert, expert_views
from vismmoe_edge.quant.record import RECORD_PART

ExpertKey = tuple[int, int]


class _MappedShards:
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


class UnifiedTier:
    """Explicitly managed page cache: exact-range reads in, exact-range drops out, residency checked."""

    name = "unified"

    def __init__(self, store: ExpertStore, slots: int, *, threads: int = 8, method: str = "pread") -> None:
        if method not in ("pread", "madvise"):
            raise VismmoeError(f"unified fetch method {method!r}: use pread or madvise")
        self.shards = _MappedShards(store, random_access=True)
        self.threads = threads
        # pread: a blocking pool of exact reads; madvise: chunked WILLNEED hints, then mincore until resident and
        # a pread of any page the hint left out. They tie on this VM's disk (docs/prefetch-measurements.md);
        # pread is the default because it also works where mincore lies (not the files' owner).
        self.method = method
        self.slot_bytes = store.catalogue.expert_bytes
        self.refault_bytes = 0  # pages the kernel reclaimed behind our back and we had to read again

    def read_bytes(self, key: ExpertKey) -> int:
        return self.slot_bytes

    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights:
        for shard, ranges in self.shards.ranges(key).items():
            mf = self.shards.files[shard]
            if self.method == "madvise" and mf.truthful_mincore:
                pagecache.prefetch_madvise(mf, ranges)
                pagecache.wait_resident(mf, ranges, timeout=2.0, stall=0.05)
                pagecache.ensure_resident(mf, ranges, threads=self.threads)
            else:
                pagecache.prefetch_pread(mf, ranges, threads=self.threads)
        return self.shards.weights(key)

    def ready(self, key: ExpertKey, slot: int) -> None:
        for shard, ranges in self.shards.ranges(key).items():
            self.refault_bytes += pagecache.ensure_resident(self.shards.files[shard], ranges, threads=self.threads)

    def done(self, key: ExpertKey, slot: int) -> None:
        """Nothing to do: the CPU has finished reading when compute returns."""

    def release(self, key: ExpertKey, slot: int) -> None:
        for shard, ranges in self.shards.ranges(key).items():
            pagecache.release(self.shards.files[shard], ranges, "auto")

    def pin(self, keys: list[ExpertKey]) -> tuple[dict[ExpertKey, ExpertWeights], pagecache.LockReport]:
        """Read the pinned prefix in and mlock it (within RLIMIT_MEMLOCK); views stay zero-copy."""
        locked = failed = 0
        reasons: set[str] = set()
        for key in keys:
            for shard, ranges in self.shards.ranges(key).items():
                mf = self.shards.files[shard]
                pagecache.prefetch_pread(mf, ranges, threads=self.threads)
                report = pagecache.lock(mf, ranges)
                locked += report.locked_bytes
                failed += report.failed_bytes
                if report.reason:
                    reasons.add(report.reason)
        return {k: self.shards.weights(k) for k in keys}, pagecache.LockReport(
            locked, failed, "; ".join(reasons) or None
        )


class MmapTier:
    """No management: views over the mapping, the kernel pages them in on faults (default readahead)."""

    name = "mmap"

    def __init__(self, store: ExpertStore, slots: int) -> None:
        self.shards = _MappedShards(store, random_access=False)
        self.slot_bytes = store.catalogue.expert_bytes

    def read_bytes(self, key: ExpertKey) -> int:
        return 0  # unknown: the kernel reads on faults; benchmarks count bytes from /proc/<pid>/io

    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights:
        return self.shards.weights(key)

    def ready(self, key: ExpertKey, slot: int) -> None:
        pass

    def done(self, key: ExpertKey, slot: int) -> None:
        pass

    def release(self, key: ExpertKey, slot: int) -> None:
        pass
