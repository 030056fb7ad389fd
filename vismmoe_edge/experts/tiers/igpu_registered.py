"""The product card's mmap path: GPU kernels read experts in the page cache, through READ_ONLY-registered ranges
of the shards' MAP_SHARED, PROT_READ mappings, with no copy at all.

A fetch (demand, or a prediction the pipeline queued) hints the expert's byte ranges in with chunked
MADV_WILLNEED and waits for them (mincore, then a pread of any page the hint left out; a pread pool where mincore
would lie), then pins them for the GPU with cudaHostRegister(READ_ONLY). An eviction waits on the slot's `freed`
event, unregisters, and drops the pages (MADV_DONTNEED + POSIX_FADV_DONTNEED): registered pages cannot be
dropped (docs/platform-facts.md §2.2), unregistered ones can.

Only MAP_SHARED + PROT_READ + READ_ONLY avoids an anonymous copy of every page (a MAP_PRIVATE mapping is
COW-copied when pinned, and READ_ONLY on it hung: platform-facts.md §2.2); pagecache.MappedFile maps exactly that.
Where the device refuses (attribute 99 or 113 = 0, pre-Orin boards, a kernel that forbids the pin) the
factory (`make`, below) falls back to the slot tier with one line.

cudaHostRegister refuses overlapping ranges, and two experts' byte ranges often share a page. So a part's page
span is registered as up to three segments, its first page, its interior and its last page, reference-counted:
an edge page shared by two parts is the same one-page segment for both. The pieces must then be addressable as
one range on the device, which attribute 91 (registered memory keeps its host address) guarantees. There is no
slot pool, so compute takes the per-expert path (compute.py) and the engine decodes without CUDA graphs.
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES, ExpertCatalogue, ExpertPart, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.page_ranges import PAGE_SIZE, page_span
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights, ShardFiles
from vismmoe_edge.experts.tier import Tier, TierDefaults
from vismmoe_edge.experts.tiers.host_memory import DeviceArray
from vismmoe_edge.experts.tiers.igpu import cuda_access
from vismmoe_edge.experts.tiers.igpu_slots import UnifiedSlotTier
from vismmoe_edge.experts.tiers.mapped_shards import MappedShards
from vismmoe_edge.experts.tiers.slot_fill import drop_loaded_shards, drop_whole_files
from vismmoe_edge.hardware import cudart
from vismmoe_edge.hardware.gpu_access import REGISTERED_TIER, igpu_tier
from vismmoe_edge.hardware.monitor import notice_once

ExpertKey = tuple[int, int]
Segment = tuple[Path, int, int]  # (shard, page-aligned file offset, length)


class RegistrationRefused(VismmoeError):
    """cudaHostRegister(READ_ONLY) of a shard range failed here."""


def segments(shard: Path, offset: int, nbytes: int, file_size: int) -> list[Segment]:
    """The part's page span as its first page, its interior and its last page (fewer for spans of 1-2 pages)."""
    start, end = page_span(offset, nbytes)
    end = min(end, file_size + (-file_size) % PAGE_SIZE)
    pages = (end - start) // PAGE_SIZE
    if pages <= 2:
        return [(shard, start + i * PAGE_SIZE, PAGE_SIZE) for i in range(pages)]
    return [(shard, start, PAGE_SIZE), (shard, start + PAGE_SIZE, end - start - 2 * PAGE_SIZE),
            (shard, end - PAGE_SIZE, PAGE_SIZE)]  # fmt: skip


class SegmentRegistry:
    """Reference-counted READ_ONLY registrations of segments; a segment is registered once, however many parts
    hold it, and unregistered when the last lets go."""

    def __init__(self, runtime: cudart.Runtime, address_of: dict[Path, int]) -> None:
        self.runtime = runtime
        self.address_of = address_of  # shard -> base address of its mapping
        self.counts: dict[Segment, int] = {}
        self.registered_bytes = 0
        self._lock = threading.Lock()

    def acquire(self, segs: list[Segment]) -> None:
        done: list[Segment] = []
        with self._lock:
            for seg in segs:
                if self.counts.get(seg, 0) == 0:
                    shard, offset, length = seg
                    err = self.runtime.host_register(self.address_of[shard] + offset, length, cudart.REGISTER_READ_ONLY)
                    if err:
                        self._release(done)
                        raise RegistrationRefused(
                            f"cudaHostRegister(READ_ONLY) of {length} bytes of {shard.name} at {offset} failed: "
                            f"{self.runtime.error_string(err)}"
                        )
                    self.registered_bytes += length
                self.counts[seg] = self.counts.get(seg, 0) + 1
                done.append(seg)

    def release_all(self) -> None:
        """Unregister everything still registered: before the mappings go, or the driver keeps ranges registered
        that a later mmap may reuse (cudaHostRegister then fails with 712, "already mapped": seen on the H200)."""
        with self._lock:
            for seg in list(self.counts):
                shard, offset, _ = seg
                self.runtime.host_unregister(self.address_of[shard] + offset)
            self.counts.clear()
            self.registered_bytes = 0

    def release(self, segs: list[Segment]) -> list[Segment]:
        """Let go of `segs`; returns those now unregistered (their pages may be dropped)."""
        with self._lock:
            return self._release(segs)

    def _release(self, segs: list[Segment]) -> list[Segment]:
        freed = []
        for seg in segs:
            left = self.counts[seg] - 1
            if left:
                self.counts[seg] = left
                continue
            del self.counts[seg]
            shard, offset, length = seg
            self.runtime.host_unregister(self.address_of[shard] + offset)
            self.registered_bytes -= length
            freed.append(seg)
        return freed


class UnifiedRegisteredTier(TierDefaults):
    name = "unified-registered"

    def __init__(
        self, store: ExpertStore, slots: int, *, runtime: cudart.Runtime, pinned: int = 0, threads: int = 8
    ) -> None:
        self.shards = MappedShards(store, random_access=True)  # MAP_SHARED, PROT_READ; refuses a dtype change
        drop_whole_files(self.shards.files)  # the header reads' readahead: large folios and readahead marks
        self.store = store
        self.device = store.device
        self.on_gpu = store.device.type == "cuda"
        self.threads = threads
        self.capacity = slots
        sizes = {path: mf.size for path, mf in self.shards.files.items()}
        self.registry = SegmentRegistry(runtime, {path: mf.base_address for path, mf in self.shards.files.items()})
        self._segments = {
            key: [s for p in loc.parts for s in segments(p.shard, p.offset, p.nbytes, sizes[p.shard])]
            for key, loc in store.catalogue.experts.items()
        }
        # What one expert pins: its page spans, a little more than its bytes; what the pipeline budgets per slot.
        self.slot_bytes = max(sum(n for _, _, n in segs) for segs in self._segments.values())
        self._expert_bytes = store.catalogue.expert_bytes
        self._held: dict[int, ExpertKey] = {}
        self.gathered_bytes = 0  # per-expert gate and up that were not adjacent: concatenated on the device
        total = slots + pinned
        if self.on_gpu:
            self.freed = [torch.cuda.Event() for _ in range(total)]
        self.probe()

    def probe(self) -> None:
        """Register and unregister the first expert once: a kernel or board that forbids the pin says so now, while
        the factory can still fall back, rather than on the first miss."""
        segs = next(iter(self._segments.values()))
        self.registry.acquire(segs)
        self.registry.release(segs)

    def read_bytes(self, key: ExpertKey) -> int:
        return self._expert_bytes

    # ---- a fetch (an I/O thread) ----------------------------------------------------------------------------
    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights:
        for shard, ranges in self.shards.ranges(key).items():
            mf = self.shards.files[shard]
            if mf.truthful_mincore:  # WILLNEED in device-sized chunks, then fill whatever the hint left out
                pagecache.prefetch_madvise(mf, ranges)
                pagecache.wait_resident(mf, ranges, timeout=2.0, stall=0.05)
                pagecache.ensure_resident(mf, ranges, threads=self.threads)
            else:  # mincore would lie (not the files' owner): read them in
                pagecache.prefetch_pread(mf, ranges, threads=self.threads)
        self.registry.acquire(self._segments[key])
        self._held[slot] = key
        return self.weights(key)

    def weights(self, key: ExpertKey) -> ExpertWeights:
        parts = {p.kind: p for p in self.store.catalogue.expert(*key).parts}
        if not self.on_gpu:
            return self.shards.weights(key)  # CPU tests: the same bytes through the mapping
        if "gate_up" in parts:
            return ExpertWeights(gate_up=self._view(parts["gate_up"]), down=self._view(parts["down"]))
        gate, up = parts["gate"], parts["up"]
        if gate.shard == up.shard and up.offset == gate.offset + gate.nbytes:  # safetensors' usual order
            both = ExpertPart("gate_up", gate.shard, gate.offset, gate.nbytes + up.nbytes, gate.dtype,
                              (gate.shape[0] + up.shape[0], gate.shape[1]), False)  # fmt: skip
            gate_up = self._view(both)
        else:
            gate_up = torch.cat([self._view(gate), self._view(up)])
            self.gathered_bytes += gate.nbytes + up.nbytes
        return ExpertWeights(gate_up=gate_up, down=self._view(parts["down"]))

    def _view(self, part: ExpertPart) -> torch.Tensor:
        """A CUDA tensor over the registered bytes (attribute 91: at their host address)."""
        mf = self.shards.files[part.shard]
        address = mf.base_address + part.offset
        raw = torch.as_tensor(DeviceArray(address, part.nbytes, mf), device=self.device)
        if raw.data_ptr() != address:
            raise VismmoeError(f"torch copied a registered range instead of viewing it on {self.device}")
        t = raw.view(TORCH_DTYPES[part.dtype]).view(part.shape)
        return t.t() if part.transposed else t

    def pin(self, keys: list[ExpertKey]) -> tuple[dict[ExpertKey, ExpertWeights], None]:
        return {key: self.fetch(key, self.capacity + i) for i, key in enumerate(keys)}, None

    # ---- compute's side ---------------------------------------------------------------------------------------
    def ready(self, key: ExpertKey, slot: int) -> None:
        """Nothing to check: registered pages cannot be reclaimed."""

    def done(self, key: ExpertKey, slot: int) -> None:
        if self.on_gpu:
            self.freed[slot].record(torch.cuda.current_stream(self.device))

    def release(self, key: ExpertKey, slot: int) -> None:
        """Unregister the evicted expert once the GPU is done with it, and drop the pages no one holds now."""
        if self.on_gpu:
            self.freed[slot].synchronize()
        held = self._held.pop(slot, key)
        for shard, offset, length in self.registry.release(self._segments[held]):
            mf = self.shards.files[shard]
            pagecache.release(mf, [(offset, min(length, mf.size - offset))], "dontneed")

    def after_load(
        self, files: ShardFiles, table: dict[str, TensorInfo], catalogue: ExpertCatalogue, pinned_layers: set[int]
    ) -> None:
        drop_loaded_shards(files, table)

    def close(self) -> None:
        for slot in list(self._held):
            self.release(self._held[slot], slot)
        self.registry.release_all()  # the pinned prefix's too
        for mf in self.shards.files.values():
            mf.close()

    def __del__(self) -> None:  # an engine dropped without close(): unregister before the mappings are unmapped
        with contextlib.suppress(Exception):
            self.close()


def mapping_anonymous_bytes(path: Path, smaps: str | None = None) -> int | None:
    """`Anonymous:` bytes of this process's mappings of `path` (/proc/self/smaps): the private copies a pin of a
    MAP_PRIVATE mapping makes (platform-facts.md §2.2); 0 for what this tier registers. None when `path` is not
    mapped."""
    text = Path("/proc/self/smaps").read_text() if smaps is None else smaps
    target, total, inside = str(Path(path).resolve()), None, False
    for line in text.splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a VMA header line
            inside = len(head) == 6 and head[5] == target
            if inside and total is None:
                total = 0
        elif inside and line.startswith("Anonymous:"):
            total = (total or 0) + int(line.split()[1]) * 1024
    return total


def make(store: ExpertStore, slots: int, *, pinned: int = 0, mirror: object = None) -> Tier:
    """Registered shard ranges where the device allows them; otherwise, with one line, the slot tier."""
    if store.device.type != "cuda":
        raise VismmoeError(f"--tier {REGISTERED_TIER} registers shard ranges with CUDA; it needs --device cuda")
    runtime, access = cuda_access(REGISTERED_TIER, store)
    chosen, note = igpu_tier(access, REGISTERED_TIER)
    if note:
        notice_once(f"igpu-tier:{note}", note)
    if chosen == REGISTERED_TIER:
        try:
            return UnifiedRegisteredTier(store, slots, runtime=runtime, pinned=pinned)
        except RegistrationRefused as e:
            notice_once(f"igpu-register:{e}", f"{e}: registered shard ranges are refused here, experts go to pinned "
                        "slots instead")  # fmt: skip
    return UnifiedSlotTier(store, slots, pinned=pinned, runtime=runtime)
