"""The slot pool for quantized experts: one uint8 `[slots, record bytes]` tensor, each row one expert's record with
its int4 codes in the layout the device's kernel reads (quant/slot_form.py).

It is SlotPoolTier (slots.py) with records instead of `[slots, 2I, H]` / `[slots, H, I]` weights: the same cache
then pinned-prefix slots, the same fetch paths (CPU: one copy from the mmapped shard; CUDA: one DMA from the
pinned host mirror or from pinned staging that the pread pool fills), the same per-slot events. A fetch moves the
record's bytes and nothing else; on CUDA the DMA lands in the slot and tinygemm's tiles are then built in place
on the copy stream, before the slot's event, so compute never sees a half-built slot.

int4 slots on CUDA hold either tinygemm's tiles (the per-layer path's kernel) or row-major nibbles (the Triton
GEMV of the device decode path, kernels/moe_int4.py): one layout per pool, chosen when it is allocated
(`triton_int4_slots`), since a slot has room for one.
"""

from __future__ import annotations

import os

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.experts.tiers.slots import SlotPoolTier
from vismmoe_edge.quant.kernels import QuantizedExpert
from vismmoe_edge.quant.slot_form import SlotForm

ExpertKey = tuple[int, int]


class QuantSlotPoolTier(SlotPoolTier):
    def _allocate(self, total: int) -> None:
        """The slots' storage: one record of `spec.nbytes` per slot, in the device's SlotForm."""
        self.spec = self.store.catalogue.quant
        self.form = SlotForm.for_device(self.spec, self.device, triton=triton_int4_slots(self.store, total))
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


def triton_int4_slots(store: ExpertStore, total: int) -> bool:
    """Whether a CUDA pool of `total` slots keeps int4 codes row-major for the Triton GEMV instead of tinygemm's
    tiles. `VISMMOE_INT4_SLOTS`: "triton", "tinygemm", or "auto" (the default): Triton where the engine's
    device decode "auto" will read the pool, i.e. every expert fits in it (Engine.uses_device_decode) and
    VISMMOE_DEVICE_DECODE is not "off". The per-layer decode of such a pool also runs the Triton GEMV
    (OffloadedExperts.pool_compute); its prefill dequantizes the slots in use and runs grouped GEMMs
    (quant_pool.prefill_rowmajor_int4)."""
    spec = store.catalogue.quant  # the records' ExpertSpec
    if store.device.type != "cuda" or spec is None or spec.quant.bits != 4:
        return False
    choice = os.environ.get("VISMMOE_INT4_SLOTS", "auto")
    if choice not in ("auto", "triton", "tinygemm"):
        raise VismmoeError(f"VISMMOE_INT4_SLOTS={choice!r}: use auto, triton or tinygemm")
    if choice in ("triton", "tinygemm"):
        return choice == "triton"
    from vismmoe_edge.kernels.moe_decode import HAS_TRITON

    every_expert = total >= len(store.catalogue.experts)
    return HAS_TRITON and every_expert and os.environ.get("VISMMOE_DEVICE_DECODE", "auto") != "off"


def slot_pool_class(store: ExpertStore) -> type[SlotPoolTier]:
    """Records for a quantized catalogue (torch's int4/int8 kernels compute them), float weights otherwise."""
    return QuantSlotPoolTier if store.catalogue.quant is not None else SlotPoolTier
