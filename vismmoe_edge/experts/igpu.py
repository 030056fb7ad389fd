"""`--tier unified` and its variants: which unified-memory tier serves experts on this device.

- device cpu: `unified` is the page-cache tier (unified.py); `unified-slots` the slot tier over plain memory.
- device cuda: `unified` is the default integrated-GPU tier (hardware/gpu_access.DEFAULT_IGPU_TIER);
  `unified-slots` pinned slots the GPU reads in place (igpu_slots.py); `unified-registered` the shards' own
  pages, registered read-only (igpu_registered.py). Where registration is refused, one line says so and the
  slots serve.
"""

from __future__ import annotations

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.igpu_registered import RegistrationRefused, UnifiedRegisteredTier
from vismmoe_edge.experts.igpu_slots import UnifiedSlotTier
from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.hardware import cudart
from vismmoe_edge.hardware.gpu_access import DEFAULT_IGPU_TIER, REGISTERED_TIER, SLOTS_TIER, igpu_tier, probe
from vismmoe_edge.hardware.monitor import notice_once

UNIFIED_TIERS = ("unified", SLOTS_TIER, REGISTERED_TIER)


def make_unified_tier(
    name: str, store: ExpertStore, slots: int, *, pinned: int = 0
) -> UnifiedSlotTier | UnifiedRegisteredTier:
    if store.device.type != "cuda":
        if name == SLOTS_TIER:
            return UnifiedSlotTier(store, slots, pinned=pinned)
        raise VismmoeError(f"--tier {name} registers shard ranges with CUDA; it needs --device cuda")
    torch.cuda.init()  # so that the libcudart torch loaded is mapped, and bound, before ours
    index = store.device.index if store.device.index is not None else torch.cuda.current_device()
    try:
        runtime = cudart.runtime()
    except cudart.CudaRuntimeUnavailable as e:
        raise VismmoeError(f"--tier {name} on {store.device} calls the CUDA runtime, which is not loadable: {e}") from e
    access = probe(index)
    assert access is not None, "CUDA is available: torch.cuda.init() succeeded"
    refusal = access.slot_refusal()
    if refusal is not None:
        raise VismmoeError(f"--tier {name}: {refusal}; use --tier gpu")
    chosen, note = igpu_tier(access, DEFAULT_IGPU_TIER if name == "unified" else name)
    if note:
        notice_once(f"igpu-tier:{note}", note)
    if chosen == REGISTERED_TIER:
        try:
            return UnifiedRegisteredTier(store, slots, runtime=runtime, pinned=pinned)
        except RegistrationRefused as e:
            notice_once(f"igpu-register:{e}", f"{e}: registered shard ranges are refused here, experts go to pinned "
                        "slots instead")  # fmt: skip
    return UnifiedSlotTier(store, slots, pinned=pinned, runtime=runtime)
