"""What a CUDA device can read of host memory: the facts the integrated-GPU tiers (experts/igpu_*.py) rest on.

On a Jetson Orin the iGPU shares the DRAM but cannot dereference pageable or mmapped pointers
(pageableMemoryAccess = 0) and the CPU must not touch managed memory while a kernel runs
(concurrentManagedAccess = 0), so expert bytes must sit in pinned, mapped host memory or in a registered range
(docs/platform-facts.md §2-§3.1). Read from torch and cudaDeviceGetAttribute (hardware/cudart.py), or simulated in
tests; `doctor` prints them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from vismmoe_edge.hardware import cudart


@dataclass(frozen=True)
class GpuAccess:
    name: str
    index: int
    integrated: bool
    can_map_host_memory: bool | None  # None: not read (no libcudart bound, or documented as unverified)
    pageable_memory_access: bool | None
    concurrent_managed_access: bool | None
    host_pointer_for_registered_mem: bool | None  # registered ranges keep their host address on the GPU
    host_register_supported: bool | None
    read_only_host_register_supported: bool | None
    source: str  # where the facts come from

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        def flag(v: bool | None) -> str:
            return "?" if v is None else str(int(v))

        return (
            f"cuda:{self.index} {self.name}: integrated {flag(self.integrated)}, map host memory "
            f"{flag(self.can_map_host_memory)}, pageable access {flag(self.pageable_memory_access)}, host register "
            f"{flag(self.host_register_supported)}, read-only register {flag(self.read_only_host_register_supported)}"
            f", host pointer for registered memory {flag(self.host_pointer_for_registered_mem)}, concurrent managed "
            f"access {flag(self.concurrent_managed_access)} ({self.source})"
        )

    def slot_refusal(self) -> str | None:
        """Why kernels cannot read slots in mapped pinned host memory here, or None."""
        if self.can_map_host_memory is False:
            return f"{self.name} cannot map host memory (cudaDevAttrCanMapHostMemory = 0)"
        return None

    def registration_refusal(self) -> str | None:
        """Why READ_ONLY registration of shard mappings cannot serve experts here, or None (unknown counts as
        allowed: the first registration is the real test, and its failure falls back too)."""
        if self.host_register_supported is False:
            return f"{self.name} does not support cudaHostRegister (attribute 99 = 0; pre-Orin Jetsons)"
        if self.read_only_host_register_supported is False:
            return f"{self.name} refuses read-only host registration (attribute 113 = 0)"
        if self.host_pointer_for_registered_mem is False:
            return (
                f"{self.name} maps registered ranges at other addresses (attribute 91 = 0), so one expert cannot "
                "span separately registered pages"
            )
        return None


# What the CUDA for Tegra note and our notes say of Orin's iGPU; None where no Orin has been probed yet
# (docs/platform-facts.md §3.1: attributes 99, 100, 113 and registration of file maps are unverified).
ORIN_DOCUMENTED = GpuAccess(
    name="Orin iGPU",
    index=0,
    integrated=True,
    can_map_host_memory=True,
    pageable_memory_access=False,
    concurrent_managed_access=False,
    host_pointer_for_registered_mem=None,
    host_register_supported=None,
    read_only_host_register_supported=None,
    source="documented for Orin, not probed (docs/platform-facts.md §3.1)",
)


def simulated_integrated(**overrides: Any) -> GpuAccess:
    """An Orin-like device with every attribute known (tests and `plan` on a machine without one)."""
    base = replace(
        ORIN_DOCUMENTED,
        host_pointer_for_registered_mem=True,
        host_register_supported=True,
        read_only_host_register_supported=True,
        source="simulated",
    )
    return replace(base, **overrides)


def _flag(rt: cudart.Runtime | None, attr: int, index: int) -> bool | None:
    value = None if rt is None else rt.attribute(attr, index)
    return None if value is None else bool(value)


def probe(index: int = 0) -> GpuAccess | None:
    """This machine's CUDA device `index`, or None when torch cannot use CUDA. Imports torch."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    torch.cuda.init()  # so that the libcudart torch uses is mapped and found first
    try:
        rt: cudart.Runtime | None = cudart.runtime()
        source = f"cudaDeviceGetAttribute via {rt.path}"  # type: ignore[union-attr]
    except cudart.CudaRuntimeUnavailable as e:
        rt, source = None, f"torch only; {e}"
    integrated = _flag(rt, cudart.ATTR_INTEGRATED, index)
    return GpuAccess(
        name=props.name,
        index=index,
        integrated=bool(getattr(props, "is_integrated", False)) if integrated is None else integrated,
        can_map_host_memory=_flag(rt, cudart.ATTR_CAN_MAP_HOST_MEMORY, index),
        pageable_memory_access=_flag(rt, cudart.ATTR_PAGEABLE_MEMORY_ACCESS, index),
        concurrent_managed_access=_flag(rt, cudart.ATTR_CONCURRENT_MANAGED_ACCESS, index),
        host_pointer_for_registered_mem=_flag(rt, cudart.ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, index),
        host_register_supported=_flag(rt, cudart.ATTR_HOST_REGISTER_SUPPORTED, index),
        read_only_host_register_supported=_flag(rt, cudart.ATTR_READ_ONLY_HOST_REGISTER_SUPPORTED, index),
        source=source,
    )


def probe_quietly(index: int = 0) -> GpuAccess | None:
    """probe(), with a broken torch or driver read as "no CUDA device" (the planner must still plan)."""
    try:
        return probe(index)
    except Exception:  # noqa: BLE001 - a missing torch, cuInit failures, driver mismatches
        return None


# The two integrated-GPU tiers (experts/tiers/igpu_slots.py, igpu_registered.py) and the default one. Slots until
# a measurement on the device says otherwise: tools/device/igpu_checks.py times both and reports the faster.
SLOTS_TIER = "unified-slots"
REGISTERED_TIER = "unified-registered"
DEFAULT_IGPU_TIER = SLOTS_TIER


def igpu_tier(access: GpuAccess, wanted: str = DEFAULT_IGPU_TIER) -> tuple[str, str | None]:
    """(the tier to use, a one-line note when `wanted` was refused and the slots tier serves instead)."""
    if wanted == REGISTERED_TIER:
        refusal = access.registration_refusal()
        if refusal is not None:
            return SLOTS_TIER, f"{refusal}: registered shard ranges are refused, experts go to pinned slots instead"
    return wanted, None
