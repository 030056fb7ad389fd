"""Tiny random-weight DeepSeek-VL2 checkpoints in the ORIGINAL layout, built offline, for tests.

Keys and shapes are those of the released checkpoints: `language.model.layers.{l}.mlp.experts.{j}.{gate,up,
down}_proj.weight` per expert, `...mlp.shared_experts.*` (2 shared experts), a dense first layer
(`...layers.0.mlp.gate_proj`), `language.lm_head.weight`, the timm SigLIP tower (`vision.blocks.{i}.attn.qkv`,
`vision.pos_embed [1, N, C]`, unused `vision.attn_pool.*`), `projector.layers.{0,2}`, `image_newline`,
`view_seperator`. One variant per released structure: "tiny" (MHA, greedy softmax), "small" (MLA, greedy),
"base" (MLA with q compression, noaux_tc sigmoid + correction bias, here with 2 groups so that the group step
matters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vismmoe_edge.models.deepseek_vl2.config import DeepseekVL2Config, text_config_from, vision_config_from
from vismmoe_edge.models.deepseek_vl2.model import DeepseekVL2ForCausalLM
from vismmoe_edge.models.deepseek_vl2.processor import BOS, EOS, IMAGE_TOKEN, PAD, SPECIAL_TOKENS, DeepseekVL2Processor
from vismmoe_edge.testing.tokenizers import CORPUS, VOCAB_SIZE, train_bpe_tokenizer

TILE = 42  # 3x3 patches of 14 px: padded to 4x4 by the projector, 2x2 visual tokens per tile
CANDIDATES = [[42, 42], [42, 84], [84, 42], [84, 84], [126, 42], [42, 126]]
_EMBED_SCALE = 10.0  # as demo.py: lets greedy tokens vary with the prompt on random weights
_ROUTER_STD = 0.5  # far from ties, so that a last-bit difference cannot flip an expert choice
_TINY_LANGUAGE: dict[str, dict[str, Any]] = {
    "tiny": {"use_mla": False, "topk_method": "greedy"},
    "small": {"use_mla": True, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
              "qk_rope_head_dim": 8, "v_head_dim": 16, "topk_method": "greedy"},
    "base": {"use_mla": True, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
             "v_head_dim": 16, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
             "routed_scaling_factor": 2.0, "n_group": 2, "topk_group": 1},
}  # fmt: skip


def tiny_config_json(variant: str, vocab_size: int, image_token_id: int, num_layers: int = 5) -> dict[str, Any]:
    """config.json (original form) of a few-100k-parameter model with `variant`'s structure."""
    language = {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
        "n_shared_experts": 2, "num_experts_per_tok": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "bos_token_id": 0, "eos_token_id": 1,
        "kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0,
    } | _TINY_LANGUAGE[variant]  # fmt: skip
    return {
        "architectures": ["DeepseekVLV2ForCausalLM"],
        "model_type": "deepseek_vl_v2",
        "candidate_resolutions": CANDIDATES,
        "global_view_pos": "head",
        "tile_tag": "2D",
        "image_token_id": image_token_id,  # not in the hub file (the tokenizer has it); saves reading it
        "language_config": language,
        "vision_config": {
            "model_name": "siglip_so400m_patch14_384",
            "image_size": TILE,
            "patch_size": 14,
            "width": 32,
            "layers": 2,
            "heads": 2,
            "mlp_ratio": 3.7362,
        },  # fmt: skip
        "projector_config": {
            "projector_type": "downsample_mlp_gelu",
            "input_dim": 32,
            "n_embed": 64,
            "depth": 2,
            "mlp_ratio": 1,
            "downsample_ratio": 2,
        },  # fmt: skip
    }


def config_from_json(raw: dict[str, Any]) -> DeepseekVL2Config:
    path = Path("config.json")
    text, use_mla, topk_method = text_config_from(raw["language_config"], path)
    projector = raw["projector_config"]
    return DeepseekVL2Config(
        text_config=text,
        vision_config=vision_config_from(raw["vision_config"], path),
        projector_depth=projector["depth"],
        projector_mlp_ratio=projector["mlp_ratio"],
        downsample_ratio=projector["downsample_ratio"],
        image_token_id=raw["image_token_id"],
        use_mla=use_mla,
        topk_method=topk_method,
        candidate_resolutions=[tuple(r) for r in raw["candidate_resolutions"]],
        global_view_pos=raw["global_view_pos"],
    )


def original_state_dict(model: DeepseekVL2ForCausalLM) -> dict[str, torch.Tensor]:
    """Our in-memory names -> the released checkpoint's: per-expert experts, timm vision names, fused qkv."""
    out: dict[str, torch.Tensor] = {}
    vision_layers = model.config.vision_config.num_hidden_layers
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for j, w in enumerate(tensor):
                out[f"{prefix}.{j}.gate_proj.weight"] = w[:inter].clone()
                out[f"{prefix}.{j}.up_proj.weight"] = w[inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for j, w in enumerate(tensor):
                out[f"{name.removesuffix('.down_proj')}.{j}.down_proj.weight"] = w.clone()
        elif name.startswith("vision."):
            out |= _timm_name(name, tensor)
        else:
            out[name] = tensor
    for i in range(vision_layers):  # fuse q, k, v back into timm's qkv
        for kind in ("weight", "bias"):
            parts = [out.pop(f"vision.blocks.{i}.attn.{p}.{kind}") for p in "qkv"]
            out[f"vision.blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)
    width = model.config.vision_config.hidden_size
    out["vision.attn_pool.latent"] = torch.randn(1, 1, width)  # built by the original, never run
    out["vision.attn_pool.q.weight"] = torch.randn(width, width)
    return out


def _timm_name(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    rest = name.removeprefix("vision.")
    if rest.startswith("embeddings.patch_embedding."):
        return {"vision.patch_embed.proj." + rest.rsplit(".", 1)[1]: tensor}
    if rest == "embeddings.position_embedding.weight":
        return {"vision.pos_embed": tensor[None]}
    if rest.startswith("post_layernorm."):
        return {"vision.norm." + rest.rsplit(".", 1)[1]: tensor}
    _, _, i, module, *tail = rest.split(".")  # encoder.layers.{i}.{module}...
    renames = {"layer_norm1": "norm1", "layer_norm2": "norm2"}
    if module == "self_attn":
        proj, kind = tail
        key = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "out_proj": "proj"}[proj]
        return {f"vision.blocks.{i}.attn.{key}.{kind}": tensor}
    return {f"vision.blocks.{i}.{renames.get(module, module)}.{'.'.join(tail)}": tensor}


def save_sharded(state: dict[str, torch.Tensor], out_dir: Path, shards: int = 3) -> None:
    """Several safetensors files plus model.safetensors.index.json, as the hub ships them."""
    names = sorted(state)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: state[n] for n in names[s::shards]}
        save_file(part, str(out_dir / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@torch.no_grad()
def _liven(model: DeepseekVL2ForCausalLM, image_token_id: int) -> None:
    """Random weights that exercise every part: greedy tokens that vary, routers far from ties, a nonzero bias."""
    lm = model.language.model
    lm.embed_tokens.weight.mul_(_EMBED_SCALE)
    model.language.lm_head.weight[image_token_id] = 0.0  # a random model emitting <image> confuses token counts
    for layer in lm.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            gate.weight.normal_(0.0, _ROUTER_STD)
            if hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn_like(gate.e_score_correction_bias) * 0.05)
    model.image_newline.normal_()
    model.view_seperator.normal_()
    model.vision.embeddings.position_embedding.weight.normal_(0.0, 0.5)


def build_tiny_deepseek_vl2_checkpoint(out_dir: Path, variant: str = "tiny", *, seed: int = 0, **kwargs: Any) -> Path:
    """Write a random tiny DeepSeek-VL2 checkpoint of `variant`'s structure (original keys) and its processor."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_offline_deepseek_vl2_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    raw = tiny_config_json(variant, len(tokenizer), image_token_id, **kwargs)
    torch.manual_seed(seed)
    model = DeepseekVL2ForCausalLM(config_from_json(raw)).eval()
    _liven(model, image_token_id)
    save_sharded(original_state_dict(model), out_dir)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    eos = tokenizer.convert_tokens_to_ids(EOS)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(generation))
    DeepseekVL2Processor(tokenizer, CANDIDATES, patch_size=14, downsample_ratio=2).save_pretrained(out_dir)
    return out_dir


def build_offline_deepseek_vl2_tokenizer(corpus: tuple[str, ...] = CORPUS, vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE with DeepSeek's special tokens (BOS 0, EOS 1); deterministic."""
    tokenizer = train_bpe_tokenizer(corpus, vocab_size, SPECIAL_TOKENS, eos_token=EOS, pad_token=PAD)
    tokenizer.add_special_tokens({"bos_token": BOS})
    return tokenizer
