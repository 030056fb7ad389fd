"""`--tier mmap`: the baseline with no management at all, what llama.cpp does by default.

Compute reads views over the shards' mappings (mapped_shards.py); the kernel pages experts in on faults with its
default readahead and decides alone what stays.
"""

from __future__ import annotations

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.pipeline import TierDefaults
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles
from vismmoe_edge.experts.tiers.mapped_shards import MappedShards, drop_unneeded_pages

ExpertKey = tuple[int, int]


class MmapTier(TierDefaults):
    """No management: views over the mapping, the kernel pages them in on faults (default readahead)."""

    name = "mmap"

    def __init__(self, store: ExpertStore, slots: int) -> None:
        self.store = store
        self.shards = MappedShards(store, random_access=False)
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

    def after_load(
        self, files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned_layers: set[int]
    ) -> None:
        drop_unneeded_pages(files, table, catalogue, pinned_layers)


def make(store: ExpertStore, slots: int, *, pinned: int = 0, mirror: object = None) -> MmapTier:
    if store.device.type == "cuda":
        raise VismmoeError("--tier mmap serves experts to the CPU; use --device cpu (or --tier gpu)")
    return MmapTier(store, slots)
