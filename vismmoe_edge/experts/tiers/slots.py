"""A fixed slot pool: one preallocated tensor per weight kind, `[slots, 2I, H]` and `[slots, H, I]`, holding every
resident expert (the cache's slots first, then the pinned prefix's), so that a layer's experts are computed in one
batched call from their slot ids (pool_compute.py).

On the CPU a fetch copies the expert's bytes from the mmapped shard straight into its slot. On CUDA a fetch is
one DMA into the slot on a copy stream, with one event per slot that compute waits on, from:
- the pinned host tier (host_mirror.py), when host RAM holds every streamed expert: queued from whatever thread
  asks, nothing copied by the CPU;
- else a pinned staging buffer that the page-cache pread pool (native threads) fills from the shard: two per
  I/O thread, so that one fills while the other's DMA runs.
Parts stored transposed (the hub layout) or in another dtype arrive in a GPU scratch buffer and are transposed
or converted there. Mmapped shards are never registered with CUDA (docs/platform-facts.md §2: MAP_PRIVATE mappings get
copied, pinned or hang).
"""

from __future__ import annotations

import threading

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES, ExpertPart
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.pipeline import TierDefaults
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights
from vismmoe_edge.experts.tiers.host_mirror import HostMirror

ExpertKey = tuple[int, int]


class SlotPoolTier(TierDefaults):
    def __init__(
        self,
        store: ExpertStore,
        slots: int,
        device: torch.device,
        dtype: torch.dtype,
        *,
        pinned: int = 0,
        mirror: HostMirror | None = None,
    ) -> None:
        self.store = store
        self.device = device
        self.dtype = dtype  # the compute dtype (of the activations, and of the weights where not quantized)
        self.on_gpu = device.type == "cuda"
        self.name = "gpu-slots" if self.on_gpu else "host-slots"
        self.capacity = slots  # slots [0, capacity) cache streamed experts; [capacity, +pinned) hold the prefix
        total = slots + pinned
        self._allocate(total)
        self.pool = self  # every resident expert is in the pool's tensors: compute gathers by slot
        self.pinned_slot: dict[ExpertKey, int] = {}
        self.mirror = mirror
        self._local = threading.local()
        self._files: dict[object, pagecache.MappedFile] = {}
        self._files_lock = threading.Lock()
        if self.on_gpu:
            self.events = [torch.cuda.Event() for _ in range(total)]  # slot filled
            self.freed = [torch.cuda.Event() for _ in range(total)]  # compute done reading the slot
            self._streams_lock = threading.Lock()

    def _allocate(self, total: int) -> None:
        """The slots' storage: `[total, 2I, H]` and `[total, H, I]` at the compute dtype."""
        loc = next(iter(self.store.catalogue.experts.values()))
        shapes = {p.kind: (p.shape[::-1] if p.transposed else p.shape) for p in loc.parts}
        inter_x2 = shapes["gate_up"][0] if "gate_up" in shapes else 2 * shapes["gate"][0]
        hidden, inter = shapes["down"]
        self.gate_up = torch.empty((total, inter_x2, hidden), dtype=self.dtype, device=self.device)
        self.down = torch.empty((total, hidden, inter), dtype=self.dtype, device=self.device)
        self.slot_bytes = (self.gate_up[0].numel() + self.down[0].numel()) * self.dtype.itemsize
        self._read_bytes = loc.nbytes

    def read_bytes(self, key: ExpertKey) -> int:
        return self._read_bytes

    def can_fetch_inline(self, key: ExpertKey) -> bool:
        """A fetch that only queues a DMA from pinned host memory: cheap enough for the compute thread."""
        return self.on_gpu and self.mirror is not None and key in self.mirror

    def pin(self, keys: list[ExpertKey]) -> tuple[dict[ExpertKey, ExpertWeights], None]:
        weights = pin_after_cache(self, keys)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return weights, None

    # ---- a fetch (any thread) -----------------------------------------------------------------------------
    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights:
        loc = self.store.catalogue.expert(*key)
        if not self.on_gpu:
            self._fill_slot(loc.parts, slot, self._mapped_view)
            return self.weights(slot)
        stream = self._copy_stream()
        stream.wait_event(self.freed[slot])  # kernels queued before may still read the slot's previous expert
        with torch.cuda.stream(stream):
            if self.mirror is not None and key in self.mirror:
                self._fill_slot(loc.parts, slot, lambda part: self.mirror.part(key, part))  # type: ignore[union-attr]
            else:
                staging, dma_done = self._staging_for(loc.nbytes)
                self._read_into(loc.parts, staging)
                self._fill_slot(loc.parts, slot, _carve(staging, loc.parts))
                dma_done.record(stream)
            self.events[slot].record(stream)
        return self.weights(slot)

    def weights(self, slot: int) -> ExpertWeights:
        return ExpertWeights(gate_up=self.gate_up[slot], down=self.down[slot])

    def _fill_slot(self, parts: tuple[ExpertPart, ...], slot: int, source) -> None:  # type: ignore[no-untyped-def]
        rows = 0
        for part in parts:
            if part.kind == "down":
                dest = self.down[slot]
            else:  # gate_up, or gate then up stacked into the gate_up slot
                height = part.shape[1] if part.transposed else part.shape[0]
                dest = self.gate_up[slot] if part.kind == "gate_up" else self.gate_up[slot, rows : rows + height]
                rows += height
            src = source(part)
            if self.on_gpu and (part.transposed or TORCH_DTYPES[part.dtype] != self.dtype):
                scratch = self._scratch(part.nbytes)[: part.nbytes].view(TORCH_DTYPES[part.dtype]).view(part.shape)
                scratch.copy_(src, non_blocking=True)  # the DMA, then the transpose or conversion on the GPU
                src = scratch
            dest.copy_(src.t() if part.transposed else src, non_blocking=self.on_gpu)

    def _mapped_view(self, part: ExpertPart) -> torch.Tensor:
        return self.store.files.view(part.shard, part.offset, part.nbytes, part.dtype, part.shape)

    # ---- per-thread state on CUDA ------------------------------------------------------------------------------
    def _copy_stream(self) -> torch.cuda.Stream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            with self._streams_lock:
                stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    def _scratch(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    def _staging_for(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The next of this thread's two pinned staging buffers, once the DMA that last read it has finished, and
        the event to record after this fetch's DMA."""
        local = self._local
        if getattr(local, "staging", None) is None or local.staging[0].numel() < nbytes:
            local.staging = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            local.staging_done = [torch.cuda.Event(), torch.cuda.Event()]
            local.staging_next = 0
        b = local.staging_next
        local.staging_done[b].synchronize()
        local.staging_next = b ^ 1
        return local.staging[b], local.staging_done[b]

    def _read_into(self, parts: tuple[ExpertPart, ...], staging: torch.Tensor) -> None:
        """pread the expert's byte ranges from the shards into the staging buffer (native threads, no GIL)."""
        offset = 0
        for part in parts:
            with self._files_lock:
                mf = self._files.get(part.shard)
                if mf is None:
                    mf = self._files[part.shard] = pagecache.MappedFile(part.shard)
                    mf.set_random()
            pagecache.read_into(mf, [(part.offset, part.nbytes)], [staging[offset : offset + part.nbytes]])
            offset += part.nbytes

    # ---- compute's side ---------------------------------------------------------------------------------------
    def ready(self, key: ExpertKey, slot: int) -> None:
        if self.on_gpu:
            torch.cuda.current_stream(self.device).wait_event(self.events[slot])

    def done(self, key: ExpertKey, slot: int) -> None:
        if self.on_gpu:
            self.freed[slot].record(torch.cuda.current_stream(self.device))

    def release(self, key: ExpertKey, slot: int) -> None:
        """Nothing to free: the slot is overwritten by the next fetch."""

    def close(self) -> None:
        for mf in self._files.values():
            mf.close()
        self._files.clear()


def pin_after_cache(tier, keys: list[ExpertKey]) -> dict:  # type: ignore[no-untyped-def]
    """Fetch the pinned prefix into a slot tier's slots after the cache's (they are never evicted)."""
    weights = {}
    for i, key in enumerate(keys):
        slot = tier.capacity + i
        weights[key] = tier.fetch(key, slot)
        tier.pinned_slot[key] = slot
    return weights


def _carve(staging: torch.Tensor, parts: tuple[ExpertPart, ...]):  # type: ignore[no-untyped-def]
    """part -> its bytes in the staging buffer, as stored (the parts were read back to back)."""
    offsets, at = {}, 0
    for part in parts:
        offsets[id(part)] = at
        at += part.nbytes

    def view(part: ExpertPart) -> torch.Tensor:
        start = offsets[id(part)]
        return staging[start : start + part.nbytes].view(TORCH_DTYPES[part.dtype]).view(part.shape)

    return view
