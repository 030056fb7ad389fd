"""A fixed slot pool: one preallocated tensor per weight kind, `[slots, 2I, H]` and `[slots, H, I]`.

On the CPU a fetch copies the expert's bytes from the mmapped shard straight into its slot. On CUDA the
bytes go mmap -> a pinned staging buffer (one per I/O thread, CPU memcpy) -> the slot, on a dedicated copy
stream, with one event per slot that compute waits on; mmapped shards are never registered with CUDA
(linux-io.md §10: MAP_PRIVATE mappings get copied, pinned or hang).
"""

from __future__ import annotations

import threading

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES, ExpertPart
from vismmoe_edge.experts.store import ExpertStore, ExpertWeights

ExpertKey = tuple[int, int]


class SlotPoolTier:
    def __init__(self, store: ExpertStore, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.store = store
        self.device = device
        self.dtype = dtype
        self.name = "gpu-slots" if device.type == "cuda" else "host-slots"
        loc = next(iter(store.catalogue.experts.values()))
        shapes = {p.kind: (p.shape[::-1] if p.transposed else p.shape) for p in loc.parts}
        inter_x2 = shapes["gate_up"][0] if "gate_up" in shapes else 2 * shapes["gate"][0]
        hidden, inter = shapes["down"]
        self.gate_up = torch.empty((slots, inter_x2, hidden), dtype=dtype, device=device)
        self.down = torch.empty((slots, hidden, inter), dtype=dtype, device=device)
        self.slot_bytes = (self.gate_up[0].numel() + self.down[0].numel()) * dtype.itemsize
        self._read_bytes = loc.nbytes
        self._local = threading.local()
        self.pool: SlotPoolTier | None = None  # set on CUDA: decode gathers a token's experts from the pool
        if device.type == "cuda":
            self.pool = self
            self.copy_stream = torch.cuda.Stream(device)
            self.events = [torch.cuda.Event() for _ in range(slots)]  # slot filled
            self.freed = [torch.cuda.Event() for _ in range(slots)]  # compute done reading the slot

    def read_bytes(self, key: ExpertKey) -> int:
        return self._read_bytes

    def fetch(self, key: ExpertKey, slot: int) -> ExpertWeights:
        loc = self.store.catalogue.expert(*key)
        if self.device.type == "cuda":
            # kernels queued on the compute stream may still read the slot's previous expert
            self.copy_stream.wait_event(self.freed[slot])
        rows = 0
        for part in loc.parts:
            if part.kind == "down":
                self._copy(part, self.down[slot])
            else:  # gate_up, or gate then up stacked into the gate_up slot
                height = part.shape[1] if part.transposed else part.shape[0]
                dest = self.gate_up[slot] if part.kind == "gate_up" else self.gate_up[slot, rows : rows + height]
                self._copy(part, dest)
                rows += height
        if self.device.type == "cuda":
            self.events[slot].record(self.copy_stream)
            self.copy_stream.synchronize()  # the staging buffer is reused by the next fetch on this thread
        return ExpertWeights(gate_up=self.gate_up[slot], down=self.down[slot])

    def _copy(self, part: ExpertPart, dest: torch.Tensor) -> None:
        src = self.store.files.view(part.shard, part.offset, part.nbytes, part.dtype, part.shape)
        if self.device.type != "cuda":
            dest.copy_(src.t() if part.transposed else src)
            return
        staging = self._staging(part.nbytes)[: part.nbytes].view(TORCH_DTYPES[part.dtype]).view(part.shape)
        staging.copy_(src)
        with torch.cuda.stream(self.copy_stream):
            if part.transposed or TORCH_DTYPES[part.dtype] != self.dtype:
                on_gpu = staging.to(self.device, non_blocking=True)
                dest.copy_(on_gpu.t() if part.transposed else on_gpu)
            else:
                dest.copy_(staging, non_blocking=True)

    def _staging(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "staging", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._local.staging = buf
        return buf

    def ready(self, key: ExpertKey, slot: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self.events[slot])

    def done(self, key: ExpertKey, slot: int) -> None:
        if self.device.type == "cuda":
            self.freed[slot].record(torch.cuda.current_stream(self.device))

    def release(self, key: ExpertKey, slot: int) -> None:
        """Nothing to free: the slot is overwritten by the next fetch."""
