"""The expert pipeline's counters: per MoE layer call (what telemetry records) and over the pipeline's life."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LayerStats:
    """Counters of one MoE layer call (one step of one layer): what telemetry records."""

    layer: int
    hits: int = 0
    misses: int = 0
    stall_s: float = 0.0
    compute_s: float = 0.0
    bytes_read: int = 0
    prefetch_hits: int = 0
    wasted_bytes: int = 0  # prefetched bytes evicted unused while this layer ran
    resident_bytes: int = 0  # at the end of the layer


@dataclass
class PipelineStats:
    hits: int = 0
    misses: int = 0
    prefetch_hits: int = 0  # hits on an expert that arrived on a prediction
    bytes_read: int = 0
    speculative_bytes: int = 0
    wasted_speculative_bytes: int = 0  # prefetched, then evicted or dropped unused
    evictions: int = 0
    stall_s: float = 0.0
    fetch_seconds: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    pinned_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {**out, "hit_rate": self.hit_rate}
