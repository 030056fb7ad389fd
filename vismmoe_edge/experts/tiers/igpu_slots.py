"""Expert slots in pinned, GPU-mapped host memory, filled by exact-range reads and read in place by the GPU.

For a Jetson Orin: the iGPU shares the DRAM with the CPU and the page cache, cannot read pageable or mmapped
memory, and has no GPUDirect Storage (docs/platform-facts.md §2-§3.1). So the slot pool (one `[slots, 2I, H]` and one
`[slots, H, I]` tensor, pinned prefix included, as slots.py lays it out for experts/pool_compute.py) lives in
host memory registered with CUDA (host_memory.py), and its tensors are CUDA views of that memory: the batched
expert kernels read the slots where the reads left them. A miss is a pread (O_DIRECT where aligned) of the
expert's byte ranges straight into its slot, then its page cache is dropped (slot_fill.py): each expert byte is
in DRAM once, with no staging buffer and no device copy. On a discrete GPU the same tier works, with the kernels
reading host memory over the bus (slow; it is how this path is tested off a Jetson).

The slots keep each part as the checkpoint stores it, so every layout fills with plain reads: the hub layout's
transposed parts are stored transposed and exposed as transposed views (`[slots, H, 2I]` viewed as
`[slots, 2I, H]`); per-expert gate and up parts fill the two halves of the gate_up slot. A quantized checkpoint's
slots are its records (`[slots, record bytes]` uint8, as quant_slots.py lays them out), read whole into the slot:
its int4 codes must already be in the layout the device's kernels read (CUDA: row-major nibbles for the Triton
GEMV, `quantize --layout rowmajor`; CPU: this CPU's tiles), since nothing rewrites a slot after its read.

Slot reuse is ordered by the GPU: compute records the slot's `freed` event after its last kernel that reads the
slot, and the CPU waits on that event before it reads a new expert into the slot (the CPU must not write memory
the GPU may still read). Without CUDA (device cpu) the same code fills plain anonymous memory.
"""

from __future__ import annotations

import threading
import time

import torch

from vismmoe_edge.checkpoint import DTYPE_NAMES, ExpertCatalogue, ExpertPart, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles
from vismmoe_edge.experts.tier import TierDefaults
from vismmoe_edge.experts.tiers.host_memory import HostMemory
from vismmoe_edge.experts.tiers.igpu import cuda_access
from vismmoe_edge.experts.tiers.slot_fill import FillStats, Read, Reader, SlotFiller, default_reader, drop_loaded_shards
from vismmoe_edge.experts.tiers.slots import pin_after_cache
from vismmoe_edge.hardware import cudart
from vismmoe_edge.hardware.gpu_access import SLOTS_TIER
from vismmoe_edge.quant.kernels import QuantizedExpert
from vismmoe_edge.quant.packing import ROWMAJOR
from vismmoe_edge.quant.slot_form import SlotForm

ExpertKey = tuple[int, int]


def _gate_up_layout(parts: tuple[ExpertPart, ...]) -> tuple[tuple[int, int], bool]:
    """(the gate_up slot's stored shape, whether it is the transpose of nn.Linear's [2I, H])."""
    kinds = {p.kind: p for p in parts}
    if "gate_up" in kinds:
        return kinds["gate_up"].shape, kinds["gate_up"].transposed
    gate, up = kinds["gate"], kinds["up"]  # per-expert [I, H] each, never transposed (checkpoint.py)
    return (gate.shape[0] + up.shape[0], gate.shape[1]), False


class UnifiedSlotTier(TierDefaults):
    name = "unified-slots"

    def __init__(
        self,
        store: ExpertStore,
        slots: int,
        *,
        pinned: int = 0,
        runtime: cudart.Runtime | None = None,
        direct: bool = True,
        reader: Reader = default_reader,
    ) -> None:
        catalogue = store.catalogue
        self.form = record_form(store) if catalogue.quant is not None else None
        if self.form is None and catalogue.dtype != DTYPE_NAMES[store.dtype]:
            raise VismmoeError(
                f"--tier {self.name} reads expert bytes straight into the slots the kernels use, so the compute "
                f"dtype must be the checkpoint's ({catalogue.dtype}); pass --dtype auto or use --tier gpu"
            )
        self.store = store
        self.device = store.device
        self.dtype = store.dtype
        self.on_gpu = store.device.type == "cuda"
        if self.on_gpu and runtime is None:
            raise ValueError("a CUDA slot tier needs the CUDA runtime to register its memory")
        self.capacity = slots  # slots [0, capacity) cache streamed experts; [capacity, +pinned) hold the prefix
        loc = next(iter(catalogue.experts.values()))
        self._kinds = tuple(p.kind for p in loc.parts)
        total = slots + pinned
        index = 0
        if self.on_gpu:
            index = store.device.index if store.device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index) if self.on_gpu else torch.device("cpu")
        if self.form is not None:
            self.gate_up_bytes, self.down_bytes = catalogue.quant.nbytes, 0  # one record fills the whole slot
            self.slot_bytes = self.gate_up_bytes
            self.memory = HostMemory(total * self.slot_bytes, runtime=runtime, device_index=index)
            self._gate_up_base = self._down_base = self.memory.address
            self.records = self.memory.view(0, total * self.slot_bytes, device).view(total, self.slot_bytes)
        else:
            self._allocate_weights(loc.parts, total, runtime, index, device)
        self.pool = self  # every resident expert is in these two tensors: compute gathers by slot
        self.pinned_slot: dict[ExpertKey, int] = {}
        self.filler = SlotFiller(direct=direct, reader=reader)
        self.fill_stats = FillStats()
        self._stats_lock = threading.Lock()
        if self.on_gpu:
            self.events = [torch.cuda.Event() for _ in range(total)]  # unused by fills: the CPU writes the slots
            self.freed = [torch.cuda.Event() for _ in range(total)]  # compute's last kernel reading the slot

    def _allocate_weights(
        self,
        parts: tuple[ExpertPart, ...],
        total: int,
        runtime: cudart.Runtime | None,
        index: int,
        device: torch.device,
    ) -> None:
        """`[total, 2I, H]` and `[total, H, I]` weights over one pinned allocation, each part as stored."""
        gu_shape, gu_transposed = _gate_up_layout(parts)
        down = next(p for p in parts if p.kind == "down")
        dtype = self.store.dtype
        self.gate_up_bytes = gu_shape[0] * gu_shape[1] * dtype.itemsize
        self.down_bytes = down.nbytes
        self.slot_bytes = self.gate_up_bytes + self.down_bytes
        self.memory = HostMemory(total * self.slot_bytes, runtime=runtime, device_index=index)
        self._gate_up_base = self.memory.address
        self._down_base = self.memory.address + total * self.gate_up_bytes
        gu = self.memory.view(0, total * self.gate_up_bytes, device).view(dtype).view(total, *gu_shape)
        dn = self.memory.view(total * self.gate_up_bytes, total * self.down_bytes, device)
        dn = dn.view(dtype).view(total, *down.shape)
        # compute wants nn.Linear orientation, [slots, 2I, H] and [slots, H, I]: transposed parts become views
        self.gate_up = gu.transpose(1, 2) if gu_transposed else gu
        self.down = dn.transpose(1, 2) if down.transposed else dn

    def read_bytes(self, key: ExpertKey) -> int:
        return self.slot_bytes

    def slot_ranges(self, slot: int) -> list[tuple[int, int]]:
        """(address, length) of the slot's bytes in host memory (tests check every write lands here)."""
        ranges = [
            (self._gate_up_base + slot * self.gate_up_bytes, self.gate_up_bytes),
            (self._down_base + slot * self.down_bytes, self.down_bytes),
        ]
        return [r for r in ranges if r[1]]  # a record's slot has no down part

    def reads(self, key: ExpertKey, slot: int) -> list[Read]:
        """Each part of the expert and the address in the slot it goes to, as stored."""
        parts = self.store.catalogue.expert(*key).parts
        if tuple(p.kind for p in parts) != self._kinds:
            raise VismmoeError(f"expert {key} is stored as {[p.kind for p in parts]}, unlike the first expert")
        out, gate_up_at = [], self._gate_up_base + slot * self.gate_up_bytes
        for part in parts:
            if part.kind == "down":
                out.append(Read(part.shard, part.offset, part.nbytes, self._down_base + slot * self.down_bytes))
            else:  # gate_up, or gate then up stacked into the gate_up slot, or a quantized record (its one part)
                out.append(Read(part.shard, part.offset, part.nbytes, gate_up_at))
                gate_up_at += part.nbytes
        return out

    # ---- a fetch (an I/O thread) ----------------------------------------------------------------------------
    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights:
        start = time.perf_counter()
        if self.on_gpu:
            self.freed[slot].synchronize()  # kernels queued before may still read the slot's previous expert
        waited = time.perf_counter()
        stats = self.filler.fill(self.reads(key, slot))
        stats.wait_s, stats.read_s = waited - start, time.perf_counter() - waited
        with self._stats_lock:
            self.fill_stats.add(stats)
        return self.weights(slot)

    def weights(self, slot: int) -> ExpertWeights | QuantizedExpert:
        if self.form is not None:
            return self.form.views(self.records[slot])
        return ExpertWeights(gate_up=self.gate_up[slot], down=self.down[slot])

    def pin(self, keys: list[ExpertKey]) -> tuple[dict[ExpertKey, ExpertWeights], None]:
        return pin_after_cache(self, keys), None

    # ---- compute's side ---------------------------------------------------------------------------------------
    def ready(self, key: ExpertKey, slot: int) -> None:
        """Nothing to wait for: the pread finished before the entry was marked loaded, and kernels launched after
        a host write see it (pinned mapped memory; Orin is I/O coherent)."""

    def done(self, key: ExpertKey, slot: int) -> None:
        if self.on_gpu:
            self.freed[slot].record(torch.cuda.current_stream(self.device))

    def release(self, key: ExpertKey, slot: int) -> None:
        """Nothing to free: the next fetch overwrites the slot once `freed` says the GPU is done with it."""

    def after_load(
        self, files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned_layers: set[int]
    ) -> None:
        drop_loaded_shards(files, table)

    def close(self) -> None:
        self.filler.close()


def record_form(store: ExpertStore) -> SlotForm:
    """The form of a quantized checkpoint's records in these slots: the codes as the file stores them, which must
    be what the device's kernels read (row-major nibbles, for the Triton GEMV, on CUDA; this CPU's tiles on the CPU),
    since a slot is only ever written by its read."""
    spec = store.catalogue.quant
    on_gpu = store.device.type == "cuda"
    form = SlotForm.for_device(spec, store.device, triton=on_gpu and spec.quant.layout == ROWMAJOR)
    if form.rebuilds:
        want = ROWMAJOR if on_gpu else "auto"
        raise VismmoeError(
            f"--tier {SLOTS_TIER} reads each expert's record straight into the slot its kernels read, and this "
            f"file's int4 codes are in layout {spec.quant.layout}, which the {store.device.type} kernels do not "
            f"read: convert with `vismmoe-edge quantize SRC OUT --bits 4 --layout {want}`, or use --tier gpu"
        )
    return form


def make(store: ExpertStore, slots: int, *, pinned: int = 0, mirror: object = None) -> UnifiedSlotTier:
    """Pinned, GPU-mapped slots on CUDA; without CUDA the same slots over plain memory."""
    if store.device.type != "cuda":
        return UnifiedSlotTier(store, slots, pinned=pinned)
    runtime, _ = cuda_access(SLOTS_TIER, store)
    return UnifiedSlotTier(store, slots, pinned=pinned, runtime=runtime)
