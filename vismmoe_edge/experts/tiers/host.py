"""`--tier host`: the slot pool (slots.py; quant_slots.py for int4/int8 records) in RAM, or on whatever device
computes."""

from __future__ import annotations

from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.experts.tiers.host_mirror import HostMirror
from vismmoe_edge.experts.tiers.quant_slots import slot_pool_class
from vismmoe_edge.experts.tiers.slots import SlotPoolTier


def make(store: ExpertStore, slots: int, *, pinned: int = 0, mirror: HostMirror | None = None) -> SlotPoolTier:
    return slot_pool_class(store)(store, slots, store.device, store.dtype, pinned=pinned)
