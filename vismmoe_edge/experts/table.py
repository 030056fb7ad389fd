"""Where each expert's weights are now, on the device: `slots[layer, expert]` is a row of the slot pool's tensors,
or ABSENT.

A decode token reads the router's top-k straight through this table on the GPU, so the host need not learn the
routing before the experts run. The host writes the table only when residency changes (an expert arrived in a
slot, or left one); `sync` copies the whole table from the pipeline's state, which costs one 4-byte word per
(layer, expert): 24 KiB for 48 layers of 128 experts, one small DMA, queued on the compute stream so no token
reads a half-written table.

Rows of the table are decoder-layer indices (dense layers keep an all-ABSENT row, never read).

A second, static table (`map_host`) gives, for experts held slot-shaped in pinned host memory (the host mirror of
a checkpoint stored untransposed in the compute dtype), the addresses of their gate_up and down weights. Under
CUDA's unified virtual addressing a pinned host pointer is also a device pointer, so a kernel reads such an
expert in place over the bus, with no copy and no synchronisation: an expert absent from the slots but mapped is
no miss.
"""

from __future__ import annotations

import torch

from vismmoe_edge.experts.pipeline import ExpertPipeline

ABSENT = -1


class ExpertTable:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device) -> None:
        self.host = torch.full((num_layers, num_experts), ABSENT, dtype=torch.int32)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.slots = self.host.to(device)  # what the kernels read
        self.version = -1  # the pipeline residency version the device copy reflects
        self.host_addrs: torch.Tensor | None = None  # [layers, experts, 2] int64: gate_up and down, 0 = unmapped
        self.arriving: dict[tuple[int, int], object] = {}  # promoted experts -> their slot's fill event (CUDA)
        # the last host -> device copy, which a token launched ahead may still have queued: the pinned host table is
        # not rewritten before it has run
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def sync(self, pipeline: ExpertPipeline) -> bool:
        """Copy the pipeline's residency into the device table if it changed since the last sync; True if it did.

        Call between tokens on the compute thread. The caller keeps evictions away while a token may read the
        table: nothing prefetches in the background (engine.uses_device_decode), and the fetches of a redone
        token have all landed before it returns (they were Required), so no slot changes hands after the sync;
        a promotion that evicts while a token launched ahead is in flight fills the slot only after that token
        (ExpertPipeline.promote). The copy is queued behind the tokens in flight, which read the table as it was.
        """
        version = pipeline.residency_version
        landed = [key for key, event in self.arriving.items() if event is None or event.query()]  # type: ignore[attr-defined]
        for key in landed:
            del self.arriving[key]
        if version == self.version and not landed:
            return False
        pipeline.drain()
        resident = {k: s for k, s in pipeline.resident_slots().items() if k not in self.arriving}
        if self.copied is not None:
            self.copied.synchronize()
        self.host.fill_(ABSENT)
        if resident:
            keys = torch.tensor(list(resident), dtype=torch.long)
            self.host[keys[:, 0], keys[:, 1]] = torch.tensor(list(resident.values()), dtype=torch.int32)
        self.slots.copy_(self.host, non_blocking=True)  # stream-ordered before the next token reads it
        if self.copied is not None:
            self.copied.record()
        self.version = version
        return True

    def lookup(self, layer: int, index: torch.Tensor) -> torch.Tensor:
        """index [1, k] expert ids (device) -> [1, k] slots, ABSENT where not resident (device ops only)."""
        return self.slots[layer].index_select(0, index.view(-1)).view(index.shape)

    def map_host(self, mirror, catalogue, dtype: torch.dtype) -> int:  # type: ignore[no-untyped-def]
        """Fill `host_addrs` from a HostMirror whose experts are slot-shaped: parts gate_up then down (or gate, up,
        down), untransposed, in `dtype`. Returns how many experts were mapped (0: the layout does not allow it)."""
        if not mirror.slot_shaped(dtype):
            return 0
        addrs = torch.zeros(*self.host.shape, 2, dtype=torch.int64)
        mapped = 0
        for key in mirror.keys:
            parts = catalogue.expert(*key).parts
            base = mirror.expert(key).data_ptr()
            addrs[key[0], key[1], 0] = base
            addrs[key[0], key[1], 1] = base + sum(p.nbytes for p in parts[:-1])
            mapped += 1
        self.host_addrs = addrs.to(self.slots.device)
        return mapped
