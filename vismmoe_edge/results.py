"""What a generation returns: its tokens, text, timings and expert traffic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vismmoe_edge.compress.prune import CompressionReport


@dataclass
class Timings:
    vision_s: float = 0.0
    compress_s: float = 0.0  # choosing the kept visual tokens and cutting the sequence
    prefill_s: float = 0.0  # vision tower and compression included
    decode_s: float = 0.0
    decode_tokens: int = 0
    prefix_reused_tokens: int = 0  # prompt positions whose KV came from the prefix cache (not prefilled)
    vision_cached_images: int = 0  # images whose vision-tower output came from the prefix cache
    suffix_graph_tokens: int = 0  # tokens after the reused prefix prefilled by a CUDA graph's replay (suffix_graph.py)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "vision_s": self.vision_s,
            "compress_s": self.compress_s,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "decode_tokens": self.decode_tokens,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "prefix_reused_tokens": self.prefix_reused_tokens,
            "vision_cached_images": self.vision_cached_images,
            "suffix_graph_tokens": self.suffix_graph_tokens,
        }


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    stop_reason: str  # "stop_token" or "max_new_tokens" or "cancelled"
    timings: Timings
    experts: dict[str, float] = field(default_factory=dict)
    compression: CompressionReport | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "compression": self.compression.as_dict() if self.compression is not None else None,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "stop_reason": self.stop_reason,
            "timings": self.timings.as_dict(),
            "experts": self.experts,
        }
