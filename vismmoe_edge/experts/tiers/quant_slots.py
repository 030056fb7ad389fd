"""The slot pool for quantized experts: one uint8 `[slots, record bytes]` tensor, each row one expert's record with
its int4 codes in the layout the device's kernel reads (quant/slot_form.py).

It is SlotPoolTier (slots.py) with records instead of `[slots, 2I, H]` / `[slots, H, I]` weights: the same cache
then pinned-prefix slots, the same fetch paths (CPU: one copy from the mmapped shard; CUDA: one DMA from the
pinned host mirror or from pinned staging that the pread pool fills), the same per-slot events. A fetch moves the
record's bytes and nothing else; on CUDA the DMA lands in the slot and tinygemm's tiles are then built in place
on the copy stream, before the slot's event, so compute never sees a half-built slot.
"""

from __future__ import annotations

import torch

from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.experts.tiers.slots import SlotPoolTier
from vismmoe_edge.quant.kernels import QuantizedExpert
from vismmoe_edge.quant.slot_form import SlotForm

ExpertKey = tuple[int, int]


class QuantSlotPoolTier(SlotPoolTier):
    def _allocate(self, total: int) -> None:
        """The slots' storage: one record of `spec.nbytes` per slot, in the device's SlotForm."""
        self.spec = self.store.catalogue.quant
        self.form = SlotForm.for_device(self.spec, self.device)
        self.records = torch.empty((total, self.spec.nbytes), dtype=torch.uint8, device=self.device)
        self.slot_bytes = self._read_bytes = self.spec.nbytes

    def fetch(self, key: ExpertKey, slot: int) -> QuantizedExpert:  # type: ignore[override]
        loc = self.store.catalogue.expert(*key)
        (part,) = loc.parts
        dest = self.records[slot]
        if not self.on_gpu:
            dest.copy_(self.store.files.view(part.shard, part.offset, part.nbytes, "U8", (part.nbytes,)))
            if self.form.rebuilds:  # a file converted for another CPU: its tiles, once per fetch
                self.form.build(dest)
            return self.weights(slot)
        stream = self._copy_stream()
        stream.wait_event(self.freed[slot])  # kernels queued before may still read the slot's previous expert
        with torch.cuda.stream(stream):
            if self.mirror is not None and key in self.mirror:
                dest.copy_(self.mirror.expert(key), non_blocking=True)
            else:
                staging, dma_done = self._staging_for(part.nbytes)
                self._read_into(loc.parts, staging)
                dest.copy_(staging[: part.nbytes], non_blocking=True)
                dma_done.record(stream)
            if self.form.rebuilds:
                self.form.build(dest)  # tinygemm's tiles, on the GPU, queued behind the DMA
            self.events[slot].record(stream)
        return self.weights(slot)

    def weights(self, slot: int) -> QuantizedExpert:  # type: ignore[override]
        return self.form.views(self.records[slot])


def slot_pool_class(store: ExpertStore) -> type[SlotPoolTier]:
    """Records for a quantized catalogue (torch's int4/int8 kernels compute them), float weights otherwise."""
    return QuantSlotPoolTier if store.catalogue.quant is not None else SlotPoolTier
