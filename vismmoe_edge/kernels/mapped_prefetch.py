"""Reading the next layer's likely host experts into HBM while this layer computes: the device token's lookahead.

A device token that reads experts in place from pinned host memory (moe_decode.mapped_decode) keeps the bus busy
only inside each layer's expert GEMVs: a layer's reads start after its router, and the bus idles through the
attention, norms and router of every layer (run 17's profile at 20 GiB: ~11.4 ms of bus reads in a 16.7 ms
token). Here, right after layer m's router, a second stream predicts layer m+1's experts from layer m's MoE input
through layer m+1's router weights (the next layer's gate: the residual stream changes little across one layer,
which is what makes it a good guess) and copies up to `per_layer` of the predicted experts that no GPU slot holds
from the host tier into a staging area in HBM, while the main stream runs layer m's experts and layer m+1's
attention. Layer m+1's expert GEMVs then find a staged expert in HBM (`_gemv_mapped_kernel` looks the staged ids
up) and read only the experts nobody predicted over the bus. A wrong guess costs its bytes on the bus and nothing
else: every routed expert is still read from wherever it is, so the tokens are those of reading in place.

Two staging areas are used in turn (layer m+1 writes one while layer m's GEMVs may still read the other), so a
layer's copy waits for nothing but its own prediction. The copies are plain loads and stores by a few programs
(`_stage_kernel`): a DMA's addresses are fixed when a graph is captured, and these depend on the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vismmoe_edge.switches import count_setting

# Programs a staged expert is copied by: each moves CHUNK elements at a time, so 9.44 MB (30B-A3B bf16) is ~288
# loop steps of 16 KiB per program; enough bytes in flight to keep PCIe's latency covered (~50 GB/s needs ~80 KB
# in flight at ~1.5 us), few enough programs to leave the SMs to the main stream's kernels.
COPY_PROGRAMS = 32
CHUNK = 8192


@dataclass
class Staging:
    """Two areas of `per_layer` expert records each (the host mirror's layout: gate_up then down, untransposed) and
    the ids staged in each (-1: none)."""

    records: torch.Tensor  # [2, per_layer, expert elements] in the compute dtype
    ids: torch.Tensor  # [2, per_layer] int32
    gate_up_elements: int  # where a record's down part starts

    @classmethod
    def allocate(cls, per_layer: int, expert_elements: int, gate_up_elements: int, dtype: torch.dtype,
                 device: torch.device) -> Staging:  # fmt: skip
        records = torch.zeros(2, per_layer, expert_elements, dtype=dtype, device=device)
        return cls(records, torch.full((2, per_layer), -1, dtype=torch.int32, device=device), gate_up_elements)

    @property
    def per_layer(self) -> int:
        return self.records.shape[1]


def predict_and_stage(
    x: torch.Tensor, router_next: torch.Tensor, table_next: torch.Tensor, host_next: torch.Tensor, top_k: int,
    staging: Staging, area: int,
) -> None:  # fmt: skip
    """x [1, H] (layer m's MoE input), layer m+1's router weight [E, H], its slot-table row [E] and host row [E, 2]
    -> the first `per_layer` of the next layer's predicted top-k that are in no slot but in host memory, copied
    into staging area `area`, their ids in `staging.ids[area]` (the rest -1). Device work only: graph-capturable."""
    predicted = torch.topk(F.linear(x, router_next), top_k, dim=-1).indices.view(-1)
    records = staging.records[area]
    _kernel()[(staging.per_layer, COPY_PROGRAMS)](
        predicted, table_next, host_next, staging.ids[area], records, records.shape[1], records.stride(0),
        CANDIDATES=top_k, CANDIDATES_P2=1 << (top_k - 1).bit_length(), CHUNK=CHUNK,
    )  # fmt: skip


_compiled = None


def _kernel():  # type: ignore[no-untyped-def]
    """The copy kernel, defined on first use (importing triton costs ~1 s, and CPU hosts have none)."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    @triton.jit
    def _stage_kernel(predicted, table_row, host_row, ids, records, NUMEL, stride_record, CANDIDATES: tl.constexpr,
                      CANDIDATES_P2: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
        # program (p, c): the p-th predicted expert that is in no slot and mapped, its c-th share of the chunks
        p = tl.program_id(0)
        j = tl.arange(0, CANDIDATES_P2)
        expert = tl.load(predicted + j, mask=j < CANDIDATES, other=0).to(tl.int64)
        absent = tl.load(table_row + expert, mask=j < CANDIDATES, other=0) < 0
        address = tl.load(host_row + expert * 2, mask=j < CANDIDATES, other=0)
        wanted = absent & (address != 0) & (j < CANDIDATES)
        rank = tl.cumsum(wanted.to(tl.int32), axis=0) - 1  # among the wanted, in the prediction's order
        mine = wanted & (rank == p)
        found = tl.max(mine.to(tl.int32), axis=0) > 0
        chosen = tl.sum(tl.where(mine, expert, 0), axis=0)
        source = tl.sum(tl.where(mine, address, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(ids + p, tl.where(found, chosen, -1).to(tl.int32))
        if found:
            src = source.to(tl.pointer_type(records.dtype.element_ty))
            dst = records + p * stride_record
            for start in range(tl.program_id(1) * CHUNK, NUMEL, tl.num_programs(1) * CHUNK):
                offs = start + tl.arange(0, CHUNK)
                tl.store(dst + offs, tl.load(src + offs, mask=offs < NUMEL), mask=offs < NUMEL)

    _compiled = _stage_kernel
    return _compiled


# Experts staged a layer at most, by default none until a GPU run measures the lookahead against reading in place
# alone (tools/bench/discrete.py's device-mapped-lookahead-2 row); VISMMOE_MAPPED_LOOKAHEAD sets it.
LOOKAHEAD_PER_LAYER = 0


def lookahead_per_layer(value: str | None) -> int:
    """VISMMOE_MAPPED_LOOKAHEAD: unset for the default, else a count >= 0 (one-line error otherwise)."""
    return count_setting("VISMMOE_MAPPED_LOOKAHEAD", value, LOOKAHEAD_PER_LAYER,
                         "experts staged a layer; 0 turns the lookahead off")  # fmt: skip


class Lookahead:
    """The device token's lookahead: the staging areas, the stream the copies run on, one event a MoE layer (its
    records are in), and the MoE input the prediction reads (a copy: the token's own tensor may be reused while the
    second stream still reads it)."""

    def __init__(self, staging: Staging, stream: torch.cuda.Stream, layers: int, x_like: torch.Tensor) -> None:
        self.staging = staging
        self.stream = stream
        self.events = [torch.cuda.Event() for _ in range(layers)]
        self.x = torch.zeros_like(x_like)

    def staged(self, m: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """MoE layer m's staged records, for mapped_decode; the main stream first waits for their copies. The
        first MoE layer of a token has none (nothing ran before it in this token)."""
        if m == 0:
            return None
        torch.cuda.current_stream(self.x.device).wait_event(self.events[m])
        area = m % 2
        return self.staging.ids[area], self.staging.records[area], self.staging.gate_up_elements

    def stage_next(
        self, m: int, x: torch.Tensor, router_next: torch.Tensor, table_next: torch.Tensor, host_next: torch.Tensor,
        top_k: int,
    ) -> None:  # fmt: skip
        """After MoE layer m's router (and `staged(m)`, which ordered the last reader of `self.x` before this):
        predict layer m+1's experts and stage them on the second stream."""
        self.x.copy_(x)
        self.stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(self.stream):
            predict_and_stage(self.x, router_next, table_next, host_next, top_k, self.staging, (m + 1) % 2)
            self.events[m + 1].record(self.stream)
