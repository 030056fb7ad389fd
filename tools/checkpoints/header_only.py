#!/usr/bin/env python3
"""Write a header-only Qwen3-VL-MoE checkpoint: real safetensors headers and sizes, sparse (unwritten) data.

`vismmoe-edge info` and `plan` read only config.json, the index and each shard's header, so a directory whose
shards are sparse files of the right length plans exactly like the downloaded model, on any disk, in a second.
The default config is Qwen/Qwen3-VL-30B-A3B-Instruct's (https://huggingface.co/Qwen/Qwen3-VL-30B-A3B-Instruct,
config.json): 48 layers of 128 experts (top-8, moe_intermediate 768), hidden 2048, 32 query / 4 KV heads of 128,
vocabulary 151,936, untied lm_head; vision tower depth 27, hidden 1152, MLP 4304, 16 heads, patch 16, DeepStack
after blocks 8/16/24. Tensor names and shapes come from transformers' own class built on the meta device; the
experts are stored fused ([E, 2I, H] / [E, H, I], what transformers 5 saves), everything in bf16.

The data is zeros when read (sparse files): never run or quantize such a directory; it exists to plan.

CLI: python tools/checkpoints/header_only.py OUT [--layers 48]
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from pathlib import Path
from typing import Any

QWEN3_VL_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_moe_text",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        "rope_theta": 5000000,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    "vision_config": {
        "model_type": "qwen3_vl_moe",
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
        "hidden_act": "gelu_pytorch_tanh",
        "initializer_range": 0.02,
    },
}
SHARD_BYTES = 4 * 10**9


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the model's state dict holds, name -> shape, from transformers' class on the meta device."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig.from_dict(config))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]]) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)  # sparse: the data is never written
    return offset


def write_header_only(out: Path, config: dict[str, Any] = QWEN3_VL_30B_A3B, layers: int | None = None) -> Path:
    """The header-only checkpoint of `config` (optionally with fewer decoder layers) in `out` (created)."""
    config = json.loads(json.dumps(config))
    if layers is not None:
        config["text_config"]["num_hidden_layers"] = layers
    shapes = tensor_shapes(config)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * 2
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size += nbytes
    out.mkdir(parents=True, exist_ok=False)
    weight_map, total = {}, 0
    for k, group in enumerate(groups, 1):
        shard = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
        total += _write_shard(out / shard, group)
        weight_map.update(dict.fromkeys((name for name, _ in group), shard))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 48)")
    args = parser.parse_args()
    out = write_header_only(args.out, layers=args.layers)
    total = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"{out}: {total / 1e9:.1f} GB of sparse shards (header-only)")


if __name__ == "__main__":
    main()
