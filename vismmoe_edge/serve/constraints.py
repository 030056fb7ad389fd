"""Logits processors for the request fields that change sampling: logit_bias, presence and frequency penalties,
and response_format (JSON, enforced token by token with llguidance).

Each processor is called by the Sampler with the tokens generated so far and the step's float32 CPU logits, and
returns the logits to sample from (vismmoe_edge/sampling.py). This module imports torch: the worker imports it
only when a request needs it.

llguidance (Microsoft's low-level guidance, Rust; used by vLLM, SGLang and llama.cpp) computes the set of tokens
that keep the output inside a JSON Schema in tens of microseconds per token, has abi3 wheels for aarch64 and
x86_64 and no dependencies (docs/benchmarks.md, "Constrained decoding", compares it with outlines-core and
lm-format-enforcer on the demo model).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import torch

from vismmoe_edge.serve.protocol import ApiError, bad_request

# Compact JSON: a grammar that allows free whitespace lets a small model emit spaces until max_tokens.
GRAMMAR_DEFAULTS = {"whitespace_flexible": False}


class LogitBias:
    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.ids] += self.values
        return logits


class Penalties:
    """OpenAI's: logit[j] -= frequency * count[j] + presence * (count[j] > 0), over the tokens generated so far."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence = presence
        self.frequency = frequency
        self.counts: Counter[int] = Counter()
        self.seen = 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.counts.update(generated[self.seen :])
        self.seen = len(generated)
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= self.frequency * counts + self.presence
        return logits


class JsonGrammars:
    """What one model's tokenizer needs for JSON constraints, built once per daemon."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:  # pragma: no cover - a dependency of the package
            raise bad_request(
                "response_format needs the llguidance package: pip install llguidance", "response_format"
            ) from None
        self.llguidance = llguidance
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.stop_ids or None)

    def compile(self, response_format: dict[str, Any]) -> str:
        """The grammar for a parsed response_format; an unsupported or invalid schema is a 400."""
        schema = response_format.get("schema") if response_format["type"] == "json_schema" else {"type": "object"}
        matcher_cls = self.llguidance.LLMatcher
        try:
            grammar = matcher_cls.grammar_from_json_schema(json.dumps(schema), defaults=GRAMMAR_DEFAULTS)
            is_error, messages = matcher_cls.validate_grammar_with_warnings(grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            raise bad_request(f"response_format: the schema cannot be used ({e})", "response_format") from None
        if is_error:
            detail = "; ".join(messages)[:300]
            raise bad_request(f"response_format: the schema cannot be used ({detail})", "response_format")
        return grammar

    def processor(self, grammar: str) -> JsonConstraint:
        return JsonConstraint(self, grammar)


class JsonConstraint:
    """Masks every token that would leave the grammar; once the JSON is complete, only a stop token is left."""

    def __init__(self, grammars: JsonGrammars, grammar: str) -> None:
        self.matcher = grammars.llguidance.LLMatcher(grammars.tokenizer, grammar)
        self.stop_ids = torch.tensor(grammars.stop_ids, dtype=torch.long)
        self.vocab_size = grammars.vocab_size
        self.bitmask = np.full((grammars.vocab_size + 31) // 32, -1, dtype=np.int32)
        self.seen = 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in generated[self.seen :]:
            if not self.matcher.consume_token(token):
                raise ApiError(500, f"constrained decoding lost track: {self.matcher.get_error()}", type="server_error")
        self.seen = len(generated)
        if self.matcher.is_stopped():  # complete: nothing may follow
            allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        else:
            self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
            bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: logits.shape[0]]
            allowed = torch.from_numpy(bits.astype(bool))
            if allowed.shape[0] < logits.shape[0]:
                allowed = torch.cat([allowed, torch.zeros(logits.shape[0] - allowed.shape[0], dtype=torch.bool)])
        if self.matcher.is_accepting() or self.matcher.is_stopped():
            allowed[self.stop_ids] = True  # the model's own stop tokens end a complete reply
        logits.masked_fill_(~allowed, float("-inf"))
        return logits
