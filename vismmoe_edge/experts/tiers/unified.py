"""`--tier unified` on the CPU (Jetson without CUDA, CPU hosts): the page cache is the expert cache, managed.

The shards are mapped MADV_RANDOM (a fault reads one page, not 8-16 MiB of read-around), a fetch reads exactly the
expert's byte ranges with a pread pool (pagecache.py), an eviction drops those pages again (MADV_DONTNEED +
POSIX_FADV_DONTNEED), and before compute reads an expert its residency is checked with mincore and any page the
kernel reclaimed meanwhile is read back. Compute reads the experts where they are (mapped_shards.py).
"""

from __future__ import annotations

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.pipeline import Tier, TierDefaults
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles
from vismmoe_edge.experts.tiers.mapped_shards import MappedShards, drop_unneeded_pages

ExpertKey = tuple[int, int]


class UnifiedTier(TierDefaults):
    """Explicitly managed page cache: exact-range reads in, exact-range drops out, residency checked."""

    name = "unified"

    def __init__(self, store: ExpertStore, slots: int, *, threads: int = 8, method: str = "pread") -> None:
        if method not in ("pread", "madvise"):
            raise VismmoeError(f"unified fetch method {method!r}: use pread or madvise")
        self.shards = MappedShards(store, random_access=True)
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

    def after_load(
        self, files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned_layers: set[int]
    ) -> None:
        drop_unneeded_pages(files, table, catalogue, pinned_layers)

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


def make(store: ExpertStore, slots: int, *, pinned: int = 0, mirror: object = None) -> Tier:
    """The page-cache tier on the CPU; on CUDA (a Jetson's iGPU) the default integrated-GPU tier."""
    if store.device.type == "cuda":
        from vismmoe_edge.experts.tiers.registry import tier_kind
        from vismmoe_edge.hardware.gpu_access import DEFAULT_IGPU_TIER

        return tier_kind(DEFAULT_IGPU_TIER).build(store, slots, pinned=pinned)
    return UnifiedTier(store, slots)
