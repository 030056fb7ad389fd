"""The three released DeepSeek-VL2 sizes as config.json data (the original form), for `info`-style planning,
for checking that read_config accepts them, and as the structure the tiny test checkpoints copy.

Sources (docs/deepseek-vl2.md has the detail): the hub config.json files could not be fetched here (no
network, not in the code index). VL2-Tiny's language_config matches, field by field, the DeepSeek-OCR
config.json found in the code index (DeepSeek-OCR reuses VL2-Tiny's decoder). The vision/projector blocks
follow siglip_vit.py's `siglip_so400m_patch14_384` preset and modeling_deepseek_vl_v2.py's defaults. Small's
and Base's language numbers were first written from memory, then checked field by field against the DeepSeek-VL2
variant fixtures in alibaba/rtp-llm's tests (found in the code index), which corrected two: Small's vocabulary
is 129280 (not 102400) and Base has no q compression (q_lora_rank null, not 1536). The candidate resolution
list is from memory.
"""

from __future__ import annotations

from typing import Any

# Every (w, h) multiple of 384 with at most 9 tiles: 23 entries, ordered as in the hub files (from memory).
CANDIDATE_RESOLUTIONS = [
    [384, 384], [384, 768], [768, 384], [384, 1152], [1152, 384], [384, 1536], [1536, 384], [768, 768],
    [384, 1920], [1920, 384], [384, 2304], [2304, 384], [768, 1152], [1152, 768], [384, 2688], [2688, 384],
    [384, 3072], [3072, 384], [768, 1536], [1536, 768], [384, 3456], [3456, 384], [1152, 1152],
]  # fmt: skip

_VISION = {"model_name": "siglip_so400m_patch14_384", "image_size": 384, "patch_size": 14, "width": 1152,
           "layers": 27, "heads": 16, "mlp_ratio": 3.7362, "global_pool": "map", "ignore_head": True,
           "class_token": False}  # fmt: skip
_COMMON = {"bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1, "n_shared_experts": 2,
           "num_experts_per_tok": 6, "max_position_embeddings": 4096, "rope_theta": 10000.0, "lm_head": True,
           "rm_head": False, "hidden_act": "silu"}  # fmt: skip

LANGUAGE = {
    "tiny": _COMMON | {  # MHA (use_mla false) + greedy softmax routing
        "vocab_size": 129280, "hidden_size": 1280, "intermediate_size": 6848, "moe_intermediate_size": 896,
        "num_hidden_layers": 12, "num_attention_heads": 10, "num_key_value_heads": 10, "n_routed_experts": 64,
        "use_mla": False, "kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
        "v_head_dim": 0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    },
    "small": _COMMON | {  # MLA without q compression + greedy softmax routing (DeepSeek-V2-Lite-like)
        "vocab_size": 129280, "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
        "use_mla": True, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    },
    "base": _COMMON | {  # MLA + noaux_tc sigmoid routing with the correction bias
        "vocab_size": 129280, "hidden_size": 2560, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 32, "num_key_value_heads": 32, "n_routed_experts": 72,
        "use_mla": True, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "routed_scaling_factor": 2.0, "n_group": 1, "topk_group": 1,
    },
}  # fmt: skip


def variant_config(name: str) -> dict[str, Any]:
    """config.json of DeepSeek-VL2-{Tiny,Small,Base} in the original form."""
    language = LANGUAGE[name]
    return {
        "architectures": ["DeepseekVLV2ForCausalLM"],
        "model_type": "deepseek_vl_v2",
        "candidate_resolutions": CANDIDATE_RESOLUTIONS,
        "global_view_pos": "head",
        "tile_tag": "2D",
        "language_config": dict(language),
        "vision_config": dict(_VISION),
        "projector_config": {"projector_type": "downsample_mlp_gelu", "input_dim": 1152,
                             "n_embed": language["hidden_size"], "depth": 2, "mlp_ratio": 1, "downsample_ratio": 2},
    }  # fmt: skip
