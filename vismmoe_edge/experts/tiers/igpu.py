"""What the integrated-GPU tiers (igpu_slots.py, igpu_registered.py) check before they take CUDA.

`--tier unified` on CUDA builds the default one of them (hardware/gpu_access.DEFAULT_IGPU_TIER; unified.py);
`unified-slots` keeps pinned slots the GPU reads in place; `unified-registered` the shards' own pages, registered
read-only. Without CUDA the slot tier fills plain memory and the registered tier is refused.
"""

from __future__ import annotations

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.hardware import cudart
from vismmoe_edge.hardware.gpu_access import GpuAccess, probe


def cuda_access(name: str, store: ExpertStore) -> tuple[cudart.Runtime, GpuAccess]:
    """The bound CUDA runtime and what the device can read of host memory; one line where slots cannot serve."""
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
    return runtime, access
