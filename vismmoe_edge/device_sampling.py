"""The next token chosen on the device: what a decode graph ends with, so no logits cross the bus.

Greedy is an argmax. Sampling draws from the temperature-scaled, top-p-truncated distribution by the
exponential-race form of the Gumbel-max trick: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i (so no cumulative search, and no `torch.multinomial`, which syncs with the host). The host sets
its knobs between tokens in pinned scalars copied in by the graph. Logits processors (penalties, JSON constraints)
need the host, so a request that has any keeps the host sampler (sampling.py).
"""

from __future__ import annotations

import torch

from vismmoe_edge.sampling import SamplingConfig

# Below this a temperature is greedy: dividing by it overflows float32 logits (1e4 / 1e-6 ~ 1e10 is fine, but
# softmax of it is a one-hot anyway, and 0 would be a division by zero).
MIN_TEMPERATURE = 1e-5


class DeviceSampler:
    """`choose(logits)` writes the next token into `self.token` ([1, 1] long, device); fixed shapes throughout."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        on_gpu = device.type == "cuda"
        self.device = device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.knobs = torch.tensor([0.0, 1.0, 0.0], device=device)  # temperature, top_p, mask the stop tokens
        self.host_knobs = torch.tensor([0.0, 1.0, 0.0], pin_memory=on_gpu)
        self.stops = torch.zeros(vocab, dtype=torch.bool, device=device)  # masked while min_new_tokens is unmet
        self.generator = torch.Generator(device=device)
        self.sampling = False

    def configure(self, config: SamplingConfig, produced: int) -> None:
        """Host side, before a token: this request's knobs (a tiny temperature or top_p means greedy)."""
        self.sampling = config.temperature >= MIN_TEMPERATURE
        top_p = max(config.top_p, 1e-6)
        mask_stops = float(produced < config.min_new_tokens)
        self.host_knobs.copy_(torch.tensor([max(config.temperature, MIN_TEMPERATURE), top_p, mask_stops]))

    def set_stops(self, stop_token_ids: list[int]) -> None:
        """Host side, once per request (a copy into the buffer the graph reads)."""
        stops = torch.zeros(self.stops.shape[0], dtype=torch.bool)
        stops[[t for t in stop_token_ids if 0 <= t < stops.shape[0]]] = True
        self.stops.copy_(stops)

    def seed(self, seed: int | None) -> None:
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def choose(self, logits: torch.Tensor) -> None:
        """Device ops only (the graph's tail). Greedy when not sampling; both branches are fixed at capture."""
        self.knobs.copy_(self.host_knobs, non_blocking=True)
        logits = logits.float().masked_fill(self.stops & (self.knobs[2] > 0), float("-inf"))
        if not self.sampling:
            self.token.copy_(torch.argmax(logits).view(1, 1))
            return
        probs = torch.softmax(logits / self.knobs[0], dim=-1)
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.knobs[1]  # the first always stays
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        race = torch.empty_like(sorted_probs).exponential_(generator=self.generator)
        # index_select, not order[argmax]: indexing by a 0-d CUDA tensor may read it on the host
        self.token.copy_(order.index_select(0, torch.argmax(sorted_probs / race).view(1)).view(1, 1))
