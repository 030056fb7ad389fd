"""Which experts a reply will keep using: the prompt's routing, its last tokens weighing most.

The "popularity" policy ranks a prefill's experts by the share of the prompt's tokens routed to each
(ExpertPipeline.begin_layer), and that ranking decides which experts stay in the slots when the decode starts.
The tokens just before the reply predict its routing better than the prompt's first ones (the system prompt, the
top of an image): a token `half_life` tokens before the last weighs half as much. On the replayed DeepSeek-V2-Lite
trace at the 20 GiB geometry of tools/bench/discrete.py, a half-life of 128 tokens cut the experts a decode token
reads over the bus by 8-13% against plain counts (medians over 127 prompts, 16 to 256 decode tokens;
docs/benchmarks.md, "Fewer bus bytes at 20 GiB: the prompt's last tokens first"). VISMMOE_PROMPT_HALF_LIFE sets
it; 0 counts every token alike, as before.
"""

from __future__ import annotations

import math

import torch

from vismmoe_edge.errors import VismmoeError

PROMPT_HALF_LIFE_TOKENS = 128.0


def prompt_half_life(value: str | None) -> float:
    """VISMMOE_PROMPT_HALF_LIFE: unset for the default, else tokens >= 0 (0: every token alike)."""
    if value is None or value.strip() == "":
        return PROMPT_HALF_LIFE_TOKENS
    try:
        tokens = float(value)
    except ValueError:
        tokens = -1.0
    if not math.isfinite(tokens) or tokens < 0:
        raise VismmoeError(f"VISMMOE_PROMPT_HALF_LIFE={value!r}: use a number of tokens >= 0 (0 weighs every "
                           "prompt token alike)")  # fmt: skip
    return tokens


def prompt_shares(index: torch.Tensor, half_life: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the experts a step routed to, their shares) from its routing `index` [T, k] on the host: the weighted
    fraction of the step's tokens routed to each, the last token weighing 1 and one `half_life` tokens before it
    1/2 (0: each token 1, the plain fraction). One token: a share of 1 for each of its experts."""
    tokens = index.shape[0]
    if tokens == 1:  # a decode step, once a layer: no weights to build (they cost ~50 us a layer on the host)
        experts = torch.unique(index)
        return experts, torch.ones(experts.numel(), dtype=torch.float64)
    if half_life > 0:
        age = torch.arange(tokens - 1, -1, -1, dtype=torch.float64)
        weight = torch.exp2(-age / half_life)
    else:
        weight = torch.ones(tokens, dtype=torch.float64)
    weight = weight / weight.sum()
    experts, slot = torch.unique(index, return_inverse=True)  # top-k names an expert at most once a token
    shares = torch.zeros(experts.numel(), dtype=torch.float64)
    shares.index_add_(0, slot.reshape(-1), weight.repeat_interleave(index.shape[1]))
    return experts, shares
