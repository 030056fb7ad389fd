"""Tiny random-weight Qwen3-VL-MoE checkpoints built offline, with their offline processor (tests and tools).

Their outputs are noise, but shapes, layouts, routing and the processor are those of the real model, so the
expert reader, the engine and the server can be tested without any download. The runtime never imports this.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from vismmoe_edge.demo import INDEX_NAME, demo_cache_dir, umask
from vismmoe_edge.models.qwen3_vl_moe import ImageOnlyProcessor
from vismmoe_edge.testing.tokenizers import CORPUS, VOCAB_SIZE, train_bpe_tokenizer

SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


# Qwen3-VL vision geometry: a merged visual token covers (PATCH * MERGE)^2 pixels.
PATCH_SIZE = 16


TEMPORAL_PATCH_SIZE = 2


MERGE_SIZE = 2


# Qwen-style template, content-list format. Strings are also accepted so text-only callers stay simple.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def build_offline_tokenizer(corpus: Sequence[str] = CORPUS, vocab_size: int = VOCAB_SIZE) -> Qwen2Tokenizer:
    """The Qwen-style offline tokenizer of the demo and test checkpoints."""
    return train_bpe_tokenizer(corpus, vocab_size, SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def build_offline_processor(
    *, min_pixels: int, max_pixels: int, tokenizer: Qwen2Tokenizer | None = None
) -> ImageOnlyProcessor:
    """A complete Qwen3-VL-style processor built from nothing; identical output on every call."""
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    return ImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer if tokenizer is not None else build_offline_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


# 224x160 -> 10x14 patches of 16 px -> 35 merged visual tokens; larger images are capped at 64 tokens.
DEMO_MIN_PIXELS = 32 * 32 * 4


DEMO_MAX_PIXELS = 32 * 32 * 64


DEMO_MODEL_NAME = "demo-random-v1"


DEMO_MARKER = "VISMMOE_DEMO.json"


LAYOUTS = ("v5", "hub", "per_expert")


# With std-0.02 init everywhere, attention averages over the prompt drown the current token and greedy
# decoding repeats one token forever. Embeddings 10x larger (std 0.2) let the current token steer the next.
_EMBED_SCALE = 10.0


# Never emitted by real models during decode; a random model that emits them confuses image-token counting.
_UNGENERATABLE = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


_EXPERT_KEY = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<name>gate_up_proj|down_proj)$")


def tiny_config(
    *,
    num_layers: int = 6,
    num_experts: int = 16,
    top_k: int = 4,
    hidden: int = 128,
    moe_intermediate: int = 48,
    vocab_size: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    vision_overrides: dict[str, object] | None = None,
    **text_overrides: object,
) -> Qwen3VLMoeConfig:
    """A ~3 M-parameter Qwen3-VL-MoE config with the special ids of `tokenizer` (default: the offline one)."""
    if hidden in (moe_intermediate, 2 * moe_intermediate):
        # The hub and v5 expert layouts are indistinguishable by shape then (docs/platform-facts.md §4.3).
        raise ValueError(f"hidden={hidden} must differ from moe_intermediate and 2*moe_intermediate")
    tok = tokenizer if tokenizer is not None else build_offline_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    vocab = vocab_size if vocab_size is not None else len(tok)
    if vocab < len(tok):
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer ({len(tok)} tokens)")
    heads, kv_heads, head_dim = 4, 2, 32
    text_config = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,  # dense MLP size; unused unless mlp_only_layers is set
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # mrope_section must sum to head_dim // 2; 5.24 always interleaves T/H/W frequencies.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        **text_overrides,
    }
    vision_config = {
        "depth": 4,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": hidden,
        "num_position_embeddings": 256,  # a 16x16 grid, bilinearly interpolated to any image size
        "deepstack_visual_indexes": [1, 2, 3],
        **(vision_overrides or {}),
    }
    return Qwen3VLMoeConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
        tie_word_embeddings=False,
        experts_implementation="eager",  # the reference path; not saved to config.json
    )


def build_tiny_checkpoint(
    out_dir: Path,
    *,
    seed: int = 0,
    layout: str = "v5",
    dtype: torch.dtype = torch.float32,
    max_shard_size: str = "200KB",
    min_pixels: int = DEMO_MIN_PIXELS,
    max_pixels: int = DEMO_MAX_PIXELS,
    **config_overrides: object,
) -> Path:
    """Write a random tiny Qwen3-VL-MoE checkpoint (several shards + index) and its processor to `out_dir`.

    `layout`: "v5" as `save_pretrained` writes it (`gate_up_proj [E,2I,H]`, `down_proj [E,H,I]`); "hub" with
    those transposed (`[E,H,2I]`, `[E,I,H]`, as upstream checkpoints ship); "per_expert" with one
    `experts.{j}.{gate,up,down}_proj.weight` per expert (transformers cannot load it).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    out_dir = Path(out_dir)
    processor = build_offline_processor(min_pixels=min_pixels, max_pixels=max_pixels)
    config = tiny_config(tokenizer=processor.tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).eval()
    _liven_greedy(model, processor.tokenizer)
    model.to(dtype)
    eos = processor.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = processor.tokenizer.pad_token_id
    model.generation_config.do_sample = False
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size=max_shard_size)
    processor.save_pretrained(out_dir)
    if layout == "hub":
        _rewrite_shards(out_dir, _to_hub)
    elif layout == "per_expert":
        _rewrite_shards(out_dir, _to_per_expert)
    return out_dir


@torch.no_grad()
def _liven_greedy(model: Qwen3VLMoeForConditionalGeneration, tokenizer: PreTrainedTokenizerBase) -> None:
    """Rescale random weights so greedy decoding varies with the prompt instead of repeating one token."""
    model.model.language_model.embed_tokens.weight.mul_(_EMBED_SCALE)
    # A zero lm_head row gives logit 0, which never beats the max of hundreds of random logits.
    model.lm_head.weight[tokenizer.convert_tokens_to_ids(list(_UNGENERATABLE))] = 0.0


def _to_hub(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if _EXPERT_KEY.match(key):
        return {key: t.transpose(1, 2).contiguous()}
    return {key: t}


def _to_per_expert(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    m = _EXPERT_KEY.match(key)
    if m is None:
        return {key: t}
    prefix = m["prefix"]
    out: dict[str, torch.Tensor] = {}
    if m["name"] == "down_proj":  # [E, H, I]
        for j in range(t.shape[0]):
            out[f"{prefix}.{j}.down_proj.weight"] = t[j].contiguous()
        return out
    inter = t.shape[1] // 2  # gate_up [E, 2I, H]: gate = first I rows, up = last I rows
    for j in range(t.shape[0]):
        out[f"{prefix}.{j}.gate_proj.weight"] = t[j, :inter].contiguous()
        out[f"{prefix}.{j}.up_proj.weight"] = t[j, inter:].contiguous()
    return out


def _rewrite_shards(model_dir: Path, convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
    """Apply `convert` to every tensor, shard by shard, keeping shard membership and fixing the index."""
    index_path = model_dir / INDEX_NAME
    index = json.loads(index_path.read_text())
    weight_map: dict[str, str] = {}
    for shard in sorted(set(index["weight_map"].values())):
        path = model_dir / shard
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                tensors.update(convert(key, f.get_tensor(key)))
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path)
        weight_map.update(dict.fromkeys(tensors, shard))
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


@contextmanager
def _atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temp dir beside `final`; rename it into place on success so readers never see half a build."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700; the cache should look like any other dir
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process won the race (final exists and is non-empty): keep theirs.
            if not (final / INDEX_NAME).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_random_demo_model() -> Path:
    """Build the random demo checkpoint once (bf16, 6 layers, 16 experts, top-4) and return its directory."""
    final = demo_cache_dir() / DEMO_MODEL_NAME
    if (final / INDEX_NAME).is_file():
        return final
    if final.exists():  # a leftover without an index is not ours to trust
        shutil.rmtree(final)
    with _atomic_dir(final) as tmp:
        build_tiny_checkpoint(tmp, layout="v5", dtype=torch.bfloat16, seed=1234, num_layers=6, max_shard_size="1MB")
        marker = {
            "name": DEMO_MODEL_NAME,
            "random_weights": True,
            "note": "Random weights for demos and tests: the model's answers are meaningless.",
        }
        (tmp / DEMO_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return final
