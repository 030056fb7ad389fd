"""Tiny random-weight GLM-4.5V checkpoints and their offline processor, built offline, for tests.

`save_pretrained` writes them as GLM-4.5V ships: per-expert tensors
(`...mlp.experts.{j}.{gate,up,down}_proj.weight`, transformers' default `save_original_format=True` reverts
its fused in-memory experts), with shared experts, routers with `e_score_correction_bias`, and
`first_k_dense_replace` dense layers first.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration, PreTrainedTokenizerBase, Qwen2Tokenizer
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

from vismmoe_edge.models.glm4v_moe import ImageOnlyGlm4vProcessor
from vismmoe_edge.testing.tokenizers import CORPUS, train_bpe_tokenizer

# GLM-4.5V's control tokens; image placeholders are <|begin_of_image|><|image|>...<|end_of_image|>.
SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]


STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # as GLM-4.5V's generation_config lists them


# GLM-4.5V vision geometry: a merged visual token covers (PATCH * MERGE)^2 pixels.
PATCH_SIZE = 14


TEMPORAL_PATCH_SIZE = 2


MERGE_SIZE = 2


# GLM-style template, content-list format; strings are accepted too.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)


_VOCAB_SIZE = 400


def build_offline_glm4v_tokenizer(corpus: tuple[str, ...] = CORPUS, vocab_size: int = _VOCAB_SIZE) -> Qwen2Tokenizer:
    """A byte-level BPE (GLM-4's tokenizer is byte-level BPE too) with GLM's special tokens; deterministic."""
    return train_bpe_tokenizer(
        corpus, vocab_size, SPECIAL_TOKENS, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def build_offline_glm4v_processor(
    *, min_pixels: int, max_pixels: int, tokenizer: Qwen2Tokenizer | None = None
) -> ImageOnlyGlm4vProcessor:
    """A complete GLM-4.5V-style processor built from nothing. Pixel bounds count both temporal copies of an
    image (GLM's smart_resize multiplies by temporal_patch_size)."""
    image_processor = Glm4vImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    return ImageOnlyGlm4vProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer if tokenizer is not None else build_offline_glm4v_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )

# 224x160 -> 12x16 patches of 14 px (smart_resize to multiples of 28) -> 48 merged visual tokens; at most 64.
GLM_MIN_PIXELS = 2 * 28 * 28 * 4  # GLM counts both temporal copies of an image
GLM_MAX_PIXELS = 2 * 28 * 28 * 64

_EMBED_SCALE = 10.0  # as in demo.py: lets greedy tokens vary with the prompt on random weights
_MEDIA_TOKENS = (
    "<|image|>",
    "<|video|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
_UNGENERATABLE = _MEDIA_TOKENS  # a random model that emits them confuses image-token counting


def tiny_glm4v_config(
    *,
    num_layers: int = 6,
    first_k_dense_replace: int = 1,
    num_experts: int = 16,
    top_k: int = 4,
    n_group: int = 2,
    topk_group: int = 1,
    hidden: int = 128,
    moe_intermediate: int = 48,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **text_overrides: object,
) -> Glm4vMoeConfig:
    """A few-M-parameter GLM-4.5V config; group-limited routing (2 groups, 1 kept) and a routed scaling factor
    other than 1, so that the router's every step matters."""
    tok = tokenizer if tokenizer is not None else build_offline_glm4v_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", *_MEDIA_TOKENS)}
    heads, kv_heads = 4, 2  # head_dim = hidden / heads = 32; half of it rotates (partial_rotary_factor 0.5)
    text_config = {
        "vocab_size": len(tok),
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,  # the dense MLP of the first layers
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "n_routed_experts": num_experts,
        "num_experts_per_tok": top_k,
        "n_shared_experts": 1,
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": first_k_dense_replace,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        # 16 rotary dims -> 8 frequencies, split T/H/W as mrope_section (GLM-4.5V: [8, 12, 12] of 32)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
            "partial_rotary_factor": 0.5,
        },
        "tie_word_embeddings": False,
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        **text_overrides,
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_heads": 2,
        "patch_size": 14,
        "image_size": 112,  # an 8x8 learned position grid, bicubically resampled to any image
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden,
    }
    return Glm4vMoeConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image|>"],
        video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"],
        image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"],
        video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
        experts_implementation="eager",  # the reference path; not saved to config.json
    )


def build_tiny_glm4v_checkpoint(
    out_dir: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "200KB",
    min_pixels: int = GLM_MIN_PIXELS,
    max_pixels: int = GLM_MAX_PIXELS,
    **config_overrides: object,
) -> Path:
    """Write a random tiny GLM-4.5V checkpoint (several shards + index, per-expert tensors) and its processor."""
    out_dir = Path(out_dir)
    processor = build_offline_glm4v_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    config = tiny_glm4v_config(tokenizer=processor.tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = Glm4vMoeForConditionalGeneration(config).eval()
    _liven(model, processor.tokenizer)
    model.to(dtype)
    model.generation_config.eos_token_id = processor.tokenizer.convert_tokens_to_ids(list(STOP_TOKENS))
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)  # save_original_format=True: per-expert keys
    processor.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _liven(model: Glm4vMoeForConditionalGeneration, tokenizer: PreTrainedTokenizerBase) -> None:
    """Random weights that exercise every part: greedy tokens that vary, and a router bias that is not zero."""
    model.model.language_model.embed_tokens.weight.mul_(_EMBED_SCALE)
    model.lm_head.weight[tokenizer.convert_tokens_to_ids(list(_UNGENERATABLE))] = 0.0
    for layer in model.model.language_model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            # init leaves it zero; a real one shifts selection (and only selection) between experts
            gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.05)
