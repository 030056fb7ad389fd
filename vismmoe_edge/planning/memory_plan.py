"""The memory a loaded model takes besides its experts, part by part, for the planner.

On a Jetson the CPU, the GPU and the page cache share one DRAM, and under a memory cgroup everything this process
charges (page cache included) counts against one limit. So the planner subtracts every part it can name from
the smaller of MemAvailable and what the cgroup leaves, before it sizes the pinned prefix and the cache:

- non-expert weights, held once: the language model's (attention, norms, routers, embeddings, lm_head) and the
  vision tower's, as the checkpoint stores them (their page cache is dropped after loading, loader.py);
- the KV cache for `context_tokens` positions;
- prefill activations for `prompt_tokens` tokens (an estimate, [I], below);
- the page cache of reads in flight (buffered reads are dropped right after they land in a slot).

The estimates are upper-bound arithmetic from the config, not measurements; the profile's reserve (C_safe)
still covers the OS, the CUDA context and allocator slack.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.checkpoint_info import CheckpointInfo

# The serve daemon's default --max-prompt-tokens (4096) plus a reply: one capacity step of the static decoder.
DEFAULT_CONTEXT_TOKENS = 4096 + 512
DEFAULT_PROMPT_TOKENS = 4096
VISION_KEY = re.compile(r"(^|\.)(visual|vision|vision_model|vision_tower|projector)\.")
IO_IN_FLIGHT_FETCHES = 4  # the CUDA pipeline's I/O threads, each with at most one expert's buffered read


@dataclass(frozen=True)
class RuntimeParts:
    """Bytes of each non-expert part, as the plan prints them."""

    language_weights_bytes: int
    vision_weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    io_in_flight_bytes: int
    context_tokens: int
    prompt_tokens: int

    @property
    def total_bytes(self) -> int:
        return (
            self.language_weights_bytes
            + self.vision_weights_bytes
            + self.kv_cache_bytes
            + self.activation_bytes
            + self.io_in_flight_bytes
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total_bytes": self.total_bytes}


def vision_weights_bytes(checkpoint: CheckpointInfo) -> int:
    return sum(i.nbytes for n, i in checkpoint.resident_tensors.items() if VISION_KEY.search(n))


def kv_bytes_per_token(checkpoint: CheckpointInfo, itemsize: int) -> int:
    """Keys and values of every decoder layer for one position."""
    text = checkpoint.config.text_config
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    if getattr(text, "kv_lora_rank", None):  # DeepSeek's MLA caches the up-projected heads in transformers
        head_dim = int(getattr(text, "qk_nope_head_dim", 0) + getattr(text, "qk_rope_head_dim", 0)) or head_dim
    return int(text.num_hidden_layers) * 2 * heads * head_dim * itemsize


def activation_bytes(checkpoint: CheckpointInfo, tokens: int, itemsize: int) -> int:
    """Peak live tensors of one prefill layer over `tokens` [I]: per token, the residual and ~7 hidden-sized
    temporaries (norms, q/k/v/o, the MoE output) and, per routed (token, expert) pair, the gathered input, the
    gate_up product, the activation and the expert output (pool_compute.prefill_experts). The vision tower runs
    before the language model, so its peak (4 patches per visual token, ~8 hidden-sized tensors and the MLP per
    patch) counts only where it is larger."""
    text = checkpoint.config.text_config
    hidden, inter, k = int(text.hidden_size), int(text.moe_intermediate_size), int(text.num_experts_per_tok)
    per_token = 8 * hidden + k * (2 * hidden + 3 * inter)
    vision = getattr(checkpoint.config, "vision_config", None)
    per_patch = 0
    if vision is not None and getattr(vision, "hidden_size", None):
        per_patch = 4 * (8 * int(vision.hidden_size) + int(getattr(vision, "intermediate_size", 0) or 0))
    return tokens * max(per_token, per_patch) * itemsize


def runtime_parts(
    checkpoint: CheckpointInfo,
    *,
    device: str,
    context_tokens: int = DEFAULT_CONTEXT_TOKENS,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
) -> RuntimeParts:
    """The non-expert parts at the compute dtype `device` gets by default (float16 becomes float32 on the CPU)."""
    stored = TORCH_DTYPES[checkpoint.catalogue.dtype].itemsize
    itemsize = 4 if device == "cpu" and checkpoint.catalogue.dtype == "F16" else stored
    vision = vision_weights_bytes(checkpoint)
    resident = sum(i.nbytes for i in checkpoint.resident_tensors.values())
    fetches = IO_IN_FLIGHT_FETCHES if device == "cuda" else 1
    return RuntimeParts(
        language_weights_bytes=(resident - vision) * itemsize // stored,
        vision_weights_bytes=vision * itemsize // stored,
        kv_cache_bytes=context_tokens * kv_bytes_per_token(checkpoint, itemsize),
        activation_bytes=activation_bytes(checkpoint, prompt_tokens, itemsize),
        io_in_flight_bytes=fetches * checkpoint.catalogue.expert_bytes,
        context_tokens=context_tokens,
        prompt_tokens=prompt_tokens,
    )
