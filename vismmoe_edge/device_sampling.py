"""The next token chosen on the device: what a decode graph ends with, so no logits cross the bus.

Greedy is an argmax. Sampling draws from the temperature-scaled, top-p-truncated distribution by the
exponential-race form of the Gumbel-max trick: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i (so no cumulative search, and no `torch.multinomial`, which syncs with the host). The knobs live
on the device, set once per request by fill kernels (their values travel as kernel arguments, so no pinned buffer
can be rewritten under a token still in flight), and the count of tokens produced, which masks the stop tokens
until `min_new_tokens`, is a device counter each token advances: a token can be launched before the host has
read the one before it (static_decode.StaticDecoder.token_step). Logits processors (penalties, JSON constraints)
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
        self.device = device
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.knobs = torch.tensor([0.0, 1.0, 0.0], device=device)  # temperature, top_p, min_new_tokens
        self.produced = torch.zeros(1, dtype=torch.long, device=device)  # tokens of the reply before this one
        self.stops = torch.zeros(vocab, dtype=torch.bool, device=device)  # masked while min_new_tokens is unmet
        self.generator = torch.Generator(device=device)
        self.sampling = False
        self._knobs: tuple[float, float, float] | None = None

    def configure(self, config: SamplingConfig) -> bool:
        """Host side: this request's knobs (a tiny temperature or top_p means greedy). Returns whether they changed;
        a change is queued behind every token already launched, so it applies from the next launch on."""
        self.sampling = config.temperature >= MIN_TEMPERATURE
        knobs = (max(config.temperature, MIN_TEMPERATURE), max(config.top_p, 1e-6), float(config.min_new_tokens))
        if knobs == self._knobs:
            return False
        for i, value in enumerate(knobs):
            self.knobs[i].fill_(value)
        self._knobs = knobs
        return True

    def count_from(self, produced: int) -> None:
        """Host side: the reply has `produced` tokens before the next one chosen (a fill kernel, stream-ordered)."""
        self.produced.fill_(produced)

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
        logits = logits.float().masked_fill(self.stops & (self.produced < self.knobs[2]), float("-inf"))
        self.produced += 1
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
