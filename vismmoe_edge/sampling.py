"""Next-token choice: greedy, or temperature and nucleus (top-p) sampling from a seeded generator."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# (tokens generated so far, this step's float32 CPU logits) -> the logits to sample from. The daemon's
# logit_bias, penalties and JSON constraints are these (vismmoe_edge/serve/constraints.py).
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # None: the checkpoint's EOS tokens
    min_new_tokens: int = 0  # stop tokens are masked until this many tokens exist (as transformers does)
    logits_processors: list[LogitsProcessor] = field(default_factory=list)  # applied in order, before the rest

    def validate(self) -> None:
        from vismmoe_edge.errors import VismmoeError

        if self.max_new_tokens < 1:
            raise VismmoeError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise VismmoeError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise VismmoeError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, config: SamplingConfig, stop_token_ids: list[int]):
        self.config = config
        self.stop_token_ids = stop_token_ids
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()
        self.generated: list[int] = []  # what the logits processors see

    def __call__(self, logits: torch.Tensor, produced: int) -> int:
        """logits [vocab] in float32; `produced` is how many tokens were generated before this one."""
        token = self._choose(logits, produced)
        self.generated.append(token)
        return token

    def _choose(self, logits: torch.Tensor, produced: int) -> int:
        logits = logits.float().cpu()
        if self.config.logits_processors:
            logits = logits.clone()  # processors work in place; the model's tensor stays untouched
            for process in self.config.logits_processors:
                logits = process(self.generated, logits)
        if produced < self.config.min_new_tokens and self.stop_token_ids:
            logits = logits.clone()
            logits[self.stop_token_ids] = float("-inf")
        if self.config.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.config.temperature, dim=-1)
        if self.config.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always survives)
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= self.config.top_p
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
