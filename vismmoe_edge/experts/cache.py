"""The expert cache: a static resident region (the pinned prefix) plus a byte-bounded set of streamed experts.

Storage (ExpertStore) and policy (EvictionPolicy) are separate so that the pipeline can swap either.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Protocol

from tqdm.auto import tqdm

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights

ExpertKey = tuple[int, int]  # (layer, expert)


class EvictionPolicy(Protocol):
    def touched(self, key: ExpertKey) -> None: ...
    def inserted(self, key: ExpertKey) -> None: ...
    def removed(self, key: ExpertKey) -> None: ...
    def victim(self) -> ExpertKey: ...


class LRUPolicy:
    """Evict the expert used longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[ExpertKey, None] = OrderedDict()

    def touched(self, key: ExpertKey) -> None:
        self._order.move_to_end(key)

    def inserted(self, key: ExpertKey) -> None:
        self._order[key] = None

    def removed(self, key: ExpertKey) -> None:
        del self._order[key]

    def victim(self) -> ExpertKey:
        return next(iter(self._order))


@dataclass
class ExpertStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    evictions: int = 0
    fetch_seconds: float = 0.0
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    pinned_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "hit_rate": self.hit_rate}


class ExpertCache:
    """Serves expert weights for compute. Pinned layers stay resident; the rest share `capacity_bytes`.

    Experts are computed one at a time, so the cache never has to hold a whole layer: the minimum useful
    capacity is one expert.
    """

    def __init__(
        self,
        store: ExpertStore,
        *,
        budget_bytes: int,
        pinned_layers: list[int],
        policy: EvictionPolicy | None = None,
    ) -> None:
        self.store = store
        self.policy = policy or LRUPolicy()
        self.stats = ExpertStats()
        self.pinned_layers = set(pinned_layers)
        per_expert = store.expert_nbytes()
        pinned_bytes = len(pinned_layers) * store.catalogue.num_experts * per_expert
        if pinned_bytes > budget_bytes:
            raise VismmoeError(
                f"the pinned prefix of {len(pinned_layers)} layers needs {format_bytes(pinned_bytes)}, more than the "
                f"memory budget {format_bytes(budget_bytes)}; lower --pinned-layers or raise --memory-budget"
            )
        self.capacity_bytes = budget_bytes - pinned_bytes
        streamed = [layer for layer in store.catalogue.moe_layers if layer not in self.pinned_layers]
        if streamed and self.capacity_bytes < per_expert:
            raise VismmoeError(
                f"the memory budget leaves {format_bytes(self.capacity_bytes)} for streamed experts, less than one "
                f"expert ({format_bytes(per_expert)}); raise --memory-budget or lower --pinned-layers"
            )
        self._pinned: dict[ExpertKey, ExpertWeights] = {}
        self._cached: dict[ExpertKey, ExpertWeights] = {}
        self._cached_bytes = 0
        pinned_keys = [(layer, e) for layer in sorted(self.pinned_layers) for e in range(store.catalogue.num_experts)]
        for key in tqdm(pinned_keys, desc="loading pinned prefix", unit="expert", disable=None, leave=False):
            self._pinned[key] = store.load(*key)
        self.stats.pinned_bytes = sum(w.nbytes for w in self._pinned.values())
        self.stats.bytes_read = store.bytes_read
        self._update_resident()

    def get(self, layer: int, expert: int) -> ExpertWeights:
        key = (layer, expert)
        if layer in self.pinned_layers:
            self.stats.hits += 1
            return self._pinned[key]
        weights = self._cached.get(key)
        if weights is not None:
            self.stats.hits += 1
            self.policy.touched(key)
            return weights
        self.stats.misses += 1
        start = time.perf_counter()
        before = self.store.bytes_read
        weights = self.store.load(layer, expert)
        self.stats.bytes_read += self.store.bytes_read - before
        self.stats.fetch_seconds += time.perf_counter() - start
        while self._cached and self._cached_bytes + weights.nbytes > self.capacity_bytes:
            self._evict(self.policy.victim())
        self._cached[key] = weights
        self._cached_bytes += weights.nbytes
        self.policy.inserted(key)
        self._update_resident()
        return weights

    def _evict(self, key: ExpertKey) -> None:
        weights = self._cached.pop(key)
        self._cached_bytes -= weights.nbytes
        self.policy.removed(key)
        self.stats.evictions += 1

    def _update_resident(self) -> None:
        self.stats.resident_bytes = self.stats.pinned_bytes + self._cached_bytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._pinned or (layer, expert) in self._cached

    def reset_stats(self) -> None:
        """Zero the counters of one request; resident bytes carry over."""
        pinned = self.stats.pinned_bytes
        self.stats = ExpertStats(pinned_bytes=pinned)
        self._update_resident()


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
