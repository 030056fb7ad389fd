"""The memory a loaded model takes besides its experts, part by part, for the planner.

On a Jetson the CPU, the GPU and the page cache share one DRAM, and under a memory cgroup everything this process
charges (page cache included) counts against one limit. So the planner subtracts every part it can name from
the smaller of MemAvailable and what the cgroup leaves, before it sizes the pinned prefix and the cache:

- non-expert weights, held once: the language model's (attention, norms, routers, embeddings, lm_head) and the
  vision tower's, as the checkpoint stores them or as a planned conversion would (weights.py; their page cache
  is dropped after loading, loader.py);
- the KV cache for `context_tokens` positions;
- prefill activations for `prompt_tokens` tokens, or the vision tower's peak over one image where that is larger
  (an estimate, [I], below);
- the page cache of reads in flight (buffered reads are dropped right after they land in a slot);
- the prefix cache (prefix_cache.py): vision features and prompt-prefix KV kept across requests, by default room
  for one prompt of `prompt_tokens` positions (the daemon's longest prompt: the latest frame's prefill stays warm).

The estimates are upper-bound arithmetic from the config, not measurements; the profile's reserve (C_safe)
still covers the OS, the CUDA context and allocator slack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from vismmoe_edge.checkpoint_info import CheckpointInfo
from vismmoe_edge.planning.weights import WeightBytes, weight_bytes

# The serve daemon's default --max-prompt-tokens (4096) plus a reply: one capacity step of the static decoder.
DEFAULT_CONTEXT_TOKENS = 4096 + 512
DEFAULT_PROMPT_TOKENS = 4096
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
    vision_peak_bytes: int = 0  # of activation_bytes: the vision tower's peak over the largest image, if larger
    prefix_cache_bytes: int = 0  # the bound of the prefix cache (vision features and prefix KV across requests)

    @property
    def total_bytes(self) -> int:
        return (
            self.language_weights_bytes
            + self.vision_weights_bytes
            + self.kv_cache_bytes
            + self.activation_bytes
            + self.io_in_flight_bytes
            + self.prefix_cache_bytes
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total_bytes": self.total_bytes}


def kv_bytes_per_token(checkpoint: CheckpointInfo, itemsize: int) -> int:
    """Keys and values of every decoder layer for one position."""
    text = checkpoint.config.text_config
    heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    if getattr(text, "kv_lora_rank", None):  # DeepSeek's MLA caches the up-projected heads in transformers
        head_dim = int(getattr(text, "qk_nope_head_dim", 0) + getattr(text, "qk_rope_head_dim", 0)) or head_dim
    return int(text.num_hidden_layers) * 2 * heads * head_dim * itemsize


def vision_feature_bytes_per_token(checkpoint: CheckpointInfo, itemsize: int) -> int:
    """One visual token's vision-tower output as the prefix cache keeps it: the merged embedding and, for Qwen's
    DeepStack, one more hidden-sized row per injected layer."""
    text = checkpoint.config.text_config
    vision = getattr(checkpoint.config, "vision_config", None)
    deepstack = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    return (1 + deepstack) * int(text.hidden_size) * itemsize


def default_prefix_cache_bytes(checkpoint: CheckpointInfo, prompt_tokens: int, itemsize: int) -> int:
    """Room for one prompt of `prompt_tokens` positions: its KV and, were every position an image's, its vision
    features. The cache then always keeps the latest request's prefill (one frame, many questions)."""
    per_token = kv_bytes_per_token(checkpoint, itemsize) + vision_feature_bytes_per_token(checkpoint, itemsize)
    return prompt_tokens * per_token


def vision_peak_bytes(checkpoint: CheckpointInfo, image_tokens: int, itemsize: int) -> int:
    """The vision tower's live tensors over `image_tokens` merged tokens of images [I]: 4 patches per token
    (2 x 2 merge), ~8 hidden-sized tensors and the MLP per patch (attention runs through SDPA's fused kernels,
    which do not hold the score matrix). Bounded by the images' size, and freed before the language model's
    prefill, so the plan counts the larger of this and the prefill's activations."""
    vision = getattr(checkpoint.config, "vision_config", None)
    if vision is None or not getattr(vision, "hidden_size", None):
        return 0
    per_patch = 8 * int(vision.hidden_size) + int(getattr(vision, "intermediate_size", 0) or 0)
    return 4 * image_tokens * per_patch * itemsize


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
    prompt_tokens: int | None = None,
    weights: WeightBytes | None = None,
    prefix_cache_bytes: int | None = None,
) -> RuntimeParts:
    """The non-expert parts at the compute dtype `device` gets by default (float16 becomes float32 on the CPU).
    `weights`: the parts' bytes after a planned conversion (weights.weight_bytes); default: as stored.
    `prompt_tokens` defaults to DEFAULT_PROMPT_TOKENS, or the context when that is shorter. `prefix_cache_bytes`:
    the prefix cache's bound (0: off); default: one prompt's worth (default_prefix_cache_bytes)."""
    stored = checkpoint.stored_dtype
    itemsize = 4 if device == "cpu" and str(stored) == "torch.float16" else stored.itemsize
    if weights is None:
        weights = weight_bytes(checkpoint, float_scale=itemsize / stored.itemsize)
    prompt = min(DEFAULT_PROMPT_TOKENS, context_tokens) if prompt_tokens is None else prompt_tokens
    fetches = IO_IN_FLIGHT_FETCHES if device == "cuda" else 1
    language = activation_bytes(checkpoint, prompt, itemsize)
    vision = vision_peak_bytes(checkpoint, prompt, itemsize)
    return RuntimeParts(
        language_weights_bytes=weights.language_bytes,
        vision_weights_bytes=weights.vision_bytes,
        kv_cache_bytes=context_tokens * kv_bytes_per_token(checkpoint, itemsize),
        activation_bytes=max(language, vision),
        io_in_flight_bytes=fetches * weights.bytes_per_expert,
        context_tokens=context_tokens,
        prompt_tokens=prompt,
        vision_peak_bytes=vision,
        prefix_cache_bytes=default_prefix_cache_bytes(checkpoint, prompt, itemsize)
        if prefix_cache_bytes is None
        else prefix_cache_bytes,
    )
