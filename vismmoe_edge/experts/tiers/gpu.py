"""`--tier gpu`: the slot pool (slots.py; quant_slots.py for int4/int8 records) in GPU memory, filled by DMA from
pinned staging or from the pinned host mirror (host_mirror.py) where host RAM holds every streamed expert."""

from __future__ import annotations

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.experts.tiers.host_mirror import HostMirror
from vismmoe_edge.experts.tiers.quant_slots import slot_pool_class
from vismmoe_edge.experts.tiers.slots import SlotPoolTier


def make(store: ExpertStore, slots: int, *, pinned: int = 0, mirror: HostMirror | None = None) -> SlotPoolTier:
    if store.device.type != "cuda":
        raise VismmoeError("--tier gpu needs --device cuda")
    return slot_pool_class(store)(store, slots, store.device, store.dtype, pinned=pinned, mirror=mirror)
