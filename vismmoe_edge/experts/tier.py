"""The tier contract: what the pipeline, the runtime, compute and the loader ask of a tier (experts/tiers/), and
the usual answers for a tier with no slot pool of its own."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from tqdm.auto import tqdm

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles

ExpertKey = tuple[int, int]  # (layer, expert)


class Tier(Protocol):
    """Moves one expert into slot `slot` of fast memory (blocking; runs on the I/O thread). Everything the
    pipeline, the runtime, compute and the loader ask of a tier is here; TierDefaults gives the usual answers."""

    name: str
    slot_bytes: int  # bytes one expert takes in fast memory
    # The slot pool compute gathers a layer's experts from by slot id (experts/pool_compute.py), or None: the
    # experts are computed one by one from what `fetch` returned.
    pool: Any
    pinned_slot: Mapping[ExpertKey, int]  # the pinned prefix's slots in `pool` (empty where it lives apart)
    # What the device decode path (static_decode.py) reads: the pinned host mirror experts can be read from in
    # place (experts/tiers/host_mirror.py) or None; the quantized record form of the slots or None (float slots);
    # on CUDA one event per slot, recorded when its fill has been queued, or None.
    mirror: Any
    form: Any
    events: list[Any] | None

    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights: ...
    def release(self, key: ExpertKey, slot: int) -> None: ...
    def ready(self, key: ExpertKey, slot: int) -> None: ...  # before compute reads it (CUDA: wait on the event)
    def done(self, key: ExpertKey, slot: int) -> None: ...  # compute has queued its last read of the slot
    def read_bytes(self, key: ExpertKey) -> int: ...  # bytes one fetch moves from the slow tier
    def can_fetch_inline(self, key: ExpertKey) -> bool: ...  # a miss only queues a DMA: fetch on compute's thread

    def pin(self, keys: list[ExpertKey]) -> tuple[dict[ExpertKey, ExpertWeights], Any]:
        """The pinned prefix's weights, and what locking them reported (None: nothing to report)."""
        ...

    def after_load(
        self, files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned_layers: set[int]
    ) -> None:
        """Once the model is built: give back what loading left in the page cache that this tier will not use."""
        ...


class TierDefaults:
    """The answers of a tier with no slot pool of its own: experts computed one by one, no inline fetch, the
    pinned prefix loaded into ordinary tensors, nothing to release after loading."""

    pool: Any = None
    pinned_slot: Mapping[ExpertKey, int] = MappingProxyType({})
    mirror: Any = None
    form: Any = None
    events: list[Any] | None = None
    store: ExpertStore

    def can_fetch_inline(self, key: ExpertKey) -> bool:
        return False

    def pin(self, keys: list[ExpertKey]) -> tuple[dict[ExpertKey, ExpertWeights], Any]:
        bar = tqdm(keys, desc="loading pinned prefix", unit="expert", disable=None, leave=False)
        return {k: self.store.load(*k) for k in bar}, None

    def after_load(
        self, files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned_layers: set[int]
    ) -> None:
        return None
