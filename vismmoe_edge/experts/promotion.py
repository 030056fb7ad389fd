"""After a device token: bring experts it read in place from the host tier into GPU slots, for later tokens.

The token's routing arrives in pinned memory with the token (StaticDecoder.token_step). Experts the table did not
have in a slot were read over the bus; up to `limit` of them per token are fetched into slots (ExpertPipeline
.promote: a free slot, or the slot of a less valuable expert), the DMAs overlapping the next tokens. A promoted
expert joins the device table once its slot's fill event has completed, and an evicted one stays readable from
the host meanwhile, so no token waits for a promotion.
"""

from __future__ import annotations

import torch

from vismmoe_edge.experts.pipeline import ExpertPipeline
from vismmoe_edge.experts.table import ExpertTable
from vismmoe_edge.switches import count_setting

# Experts promoted per token at most, by default none. On real routing at a 20 GiB bf16 budget (30% of the experts
# in slots), a promoted expert is rarely read again before it is evicted: the H200's run 8 decoded 35.7 tok/s
# without promotion against 29.3 with 8 a token (DeepSeek-V2-Lite trace replayed; sampled routing 48.5 vs 49.6),
# at the same hit rate, and tools/bench/promotion_sim.py counts 886 MB a token moved without, 971 with 8
# (docs/benchmarks.md, run 8). A workload whose decode keeps returning to the same few experts may set
# VISMMOE_PROMOTIONS_PER_TOKEN (8 x 9.44 MB is ~1.5 ms of DMA at 50 GB/s, beside the token's own reads).
PROMOTIONS_PER_TOKEN = 0


def promotions_per_token(value: str | None) -> int:
    """VISMMOE_PROMOTIONS_PER_TOKEN: unset for the default, else a count >= 0 (one-line error otherwise)."""
    return count_setting("VISMMOE_PROMOTIONS_PER_TOKEN", value, PROMOTIONS_PER_TOKEN, "0 turns promotion off")


def promote_host_reads(
    pipeline: ExpertPipeline,
    table: ExpertTable,
    moe_layers: list[int],
    routing: torch.Tensor,
    *,
    limit: int = PROMOTIONS_PER_TOKEN,
) -> int:
    """routing [moe layers, k] (host): this token's experts. Returns how many promotions were queued."""
    events = pipeline.tier.events  # CUDA slot tiers: one fill event per slot
    queued = 0
    for m, layer in enumerate(moe_layers):
        for expert in routing[m].tolist():
            if queued >= limit:
                return queued
            key = (layer, expert)
            if int(table.host[layer, expert]) >= 0 or key in table.arriving:
                continue  # read from a slot, or already on its way
            slot = pipeline.promote(layer, expert)
            if slot is not None:
                table.arriving[key] = None if events is None else events[slot]
                queued += 1
    return queued


def count_host_reads(table: ExpertTable, moe_layers: list[int], routing: torch.Tensor) -> int:
    """routing [moe layers, k] (host): how many of this token's experts the table has in no slot, i.e. were read in
    place over the bus (a diagnostic: with a token launched ahead the table is one sync newer than the token's,
    so a promotion that landed in between is not counted)."""
    rows = table.host[torch.tensor(moe_layers, dtype=torch.long)]  # [moe layers, experts]
    return int((rows.gather(1, routing.long()) < 0).sum())
