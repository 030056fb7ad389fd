"""DeepSeek-VL2's config.json (model_type `deepseek_vl_v2`), read into transformers' configs plus a few fields.

The original file nests `language_config` (DeepSeek-V2/V3 MoE), `vision_config` (a timm SigLIP ViT) and
`projector_config`, beside `candidate_resolutions`, `tile_tag` and `global_view_pos`. We map the language part
onto transformers' `DeepseekV2Config` and the vision part onto `SiglipVisionConfig`; what transformers'
DeepSeek-V2 cannot express (plain MHA, `noaux_tc` routing) is kept in `DeepseekVL2Config` and handled by
models/deepseek_vl2.py. Anything we would run differently from the original is refused with one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import DeepseekV2Config, SiglipVisionConfig

from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.errors import VismmoeError

MODEL_TYPE = "deepseek_vl_v2"
ARCHITECTURE = "DeepseekVLV2ForCausalLM"
IMAGE_TOKEN = "<image>"

# SigLIP-SO400M/14 at 384 px, as deepseek_vl2/models/siglip_vit.py defines it; a config may override any of it.
SIGLIP_SO400M_384 = {"image_size": 384, "patch_size": 14, "width": 1152, "layers": 27, "heads": 16, "mlp_ratio": 3.7362}
ROUTING = {  # topk_method -> the scoring function it runs with here
    "greedy": "softmax",
    "group_limited_greedy": "softmax",
    "noaux_tc": "sigmoid",
}
# Placeholder MLA sizes for MHA variants: transformers' DeepSeek-V2 layer always builds MLA attention, which we
# replace by Llama attention before any weight is loaded (the placeholders never hold a parameter).
_MHA_PLACEHOLDER = {
    "kv_lora_rank": 8,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
}


@dataclass
class DeepseekVL2Config:
    """What the model and the engine need; `text_config` is transformers' own DeepSeek-V2 config."""

    text_config: DeepseekV2Config
    vision_config: SiglipVisionConfig
    projector_depth: int
    projector_mlp_ratio: int
    downsample_ratio: int
    image_token_id: int
    use_mla: bool
    topk_method: str
    candidate_resolutions: list[tuple[int, int]] = field(default_factory=lambda: [(384, 384)])
    global_view_pos: str = "head"
    model_type: str = MODEL_TYPE
    tie_word_embeddings: bool = False

    def get_text_config(self) -> DeepseekV2Config:
        return self.text_config

    @property
    def tokens_per_side(self) -> int:
        """Visual tokens along one side of a tile: ceil(27 / 2) = 14 for 384 px / patch 14 / downsample 2."""
        patches = self.vision_config.image_size // self.vision_config.patch_size
        return -(-patches // self.downsample_ratio)


def _dict(raw: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise VismmoeError(f"{path}: {key} must be a JSON object; re-download config.json")
    return value


def image_token_id_of(directory: Path, raw: dict[str, Any]) -> int:
    """`<image>`'s id: config.json's image_token_id (our demos write it), else the tokenizer's added tokens."""
    if isinstance(raw.get("image_token_id"), int):
        return int(raw["image_token_id"])
    path = directory / "tokenizer.json"
    try:
        added = json.loads(path.read_text()).get("added_tokens", [])
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VismmoeError(f"{path}: cannot read the tokenizer to find {IMAGE_TOKEN} ({e}); re-download it") from e
    for token in added:
        if token.get("content") == IMAGE_TOKEN:
            return int(token["id"])
    raise VismmoeError(f"{path}: the tokenizer has no {IMAGE_TOKEN} token; DeepSeek-VL2's tokenizer ships one")


def text_config_from(lang: dict[str, Any], path: Path) -> tuple[DeepseekV2Config, bool, str]:
    """transformers' DeepseekV2Config for the original language_config, its use_mla and its topk_method."""
    use_mla = bool(lang.get("use_mla", True))
    topk_method = lang.get("topk_method", "greedy")
    scoring = lang.get("scoring_func", "softmax" if topk_method != "noaux_tc" else "sigmoid")
    if topk_method not in ROUTING or ROUTING[topk_method] != scoring:
        raise VismmoeError(
            f"{path}: routing topk_method={topk_method!r} with scoring_func={scoring!r} is not supported; "
            "vismmoe-edge runs greedy/group_limited_greedy with softmax and noaux_tc with sigmoid"
        )
    if scoring == "softmax" and lang.get("norm_topk_prob", False) and lang.get("num_experts_per_tok", 1) > 1:
        raise VismmoeError(f"{path}: norm_topk_prob with softmax routing is not supported (no DeepSeek-VL2 uses it)")
    if lang.get("rope_scaling") is not None:
        raise VismmoeError(f"{path}: rope_scaling {lang['rope_scaling']} is not supported; DeepSeek-VL2 has none")
    if lang.get("moe_layer_freq", 1) != 1:
        raise VismmoeError(f"{path}: moe_layer_freq {lang['moe_layer_freq']} is not supported (DeepSeek-VL2 uses 1)")
    if lang.get("n_routed_experts") in (None, 0) or not lang.get("n_shared_experts"):
        raise VismmoeError(f"{path}: language_config has no routed or no shared experts; not a DeepSeek-VL2 MoE")
    if not lang.get("lm_head", True) or lang.get("rm_head", False) or lang.get("tie_word_embeddings", False):
        raise VismmoeError(f"{path}: only an untied lm_head is supported (lm_head: true, rm_head: false)")
    attention = {k: lang.get(k, d) for k, d in (("kv_lora_rank", 512), ("q_lora_rank", 1536), ("qk_nope_head_dim", 128),
                                                ("qk_rope_head_dim", 64), ("v_head_dim", 128))}  # fmt: skip
    n_group = lang.get("n_group") or 1
    try:
        config = DeepseekV2Config(
            vocab_size=lang["vocab_size"],
            hidden_size=lang["hidden_size"],
            intermediate_size=lang["intermediate_size"],
            moe_intermediate_size=lang["moe_intermediate_size"],
            num_hidden_layers=lang["num_hidden_layers"],
            num_attention_heads=lang["num_attention_heads"],
            num_key_value_heads=lang.get("num_key_value_heads") or lang["num_attention_heads"],
            n_routed_experts=lang["n_routed_experts"],
            n_shared_experts=lang["n_shared_experts"],
            num_experts_per_tok=lang["num_experts_per_tok"],
            first_k_dense_replace=lang.get("first_k_dense_replace", 0),
            # transformers' router knows greedy and group_limited_greedy; noaux_tc swaps in our router
            topk_method="greedy" if topk_method == "noaux_tc" else topk_method,
            n_group=n_group,
            topk_group=lang.get("topk_group") or n_group,
            routed_scaling_factor=float(lang.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(lang.get("norm_topk_prob", False)),
            rms_norm_eps=float(lang.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=lang.get("max_position_embeddings", 4096),
            rope_parameters={"rope_type": "default", "rope_theta": float(lang.get("rope_theta", 10000.0))},
            hidden_act=lang.get("hidden_act", "silu"),
            attention_bias=bool(lang.get("attention_bias", False)),
            bos_token_id=lang.get("bos_token_id", 0),
            eos_token_id=lang.get("eos_token_id", 1),
            pad_token_id=lang.get("pad_token_id"),
            tie_word_embeddings=False,
            **(attention if use_mla else _MHA_PLACEHOLDER),
        )
    except (TypeError, ValueError, KeyError) as e:
        raise VismmoeError(f"{path}: invalid language_config ({type(e).__name__}: {e})") from e
    if config.n_routed_experts % config.n_group or not 0 < config.topk_group <= config.n_group:
        raise VismmoeError(f"{path}: {config.n_routed_experts} experts in {config.n_group} groups cannot be routed")
    return config, use_mla, topk_method


def vision_config_from(vision: dict[str, Any], path: Path) -> SiglipVisionConfig:
    """The timm ViT of siglip_vit.py as transformers' SiglipVisionConfig: no class token, no pooling head."""
    name = vision.get("model_name", "siglip_so400m_patch14_384")
    if name != "siglip_so400m_patch14_384" and "width" not in vision:
        raise VismmoeError(
            f"{path}: vision model {name!r} is not supported; DeepSeek-VL2 uses siglip_so400m_patch14_384"
        )
    v = SIGLIP_SO400M_384 | {k: vision[k] for k in SIGLIP_SO400M_384 if k in vision}
    if vision.get("class_token", False) or not all(isinstance(v[k], int) for k in ("image_size", "width", "layers")):
        raise VismmoeError(f"{path}: vision_config {name!r} has a class token or a non-integer size; not supported")
    return SiglipVisionConfig(
        hidden_size=v["width"],
        intermediate_size=int(v["width"] * v["mlp_ratio"]),  # timm's Mlp(hidden_features=int(dim * mlp_ratio))
        num_hidden_layers=v["layers"],
        num_attention_heads=v["heads"],
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        hidden_act="gelu_pytorch_tanh",  # siglip_vit.py: nn.GELU(approximate='tanh')
        layer_norm_eps=1e-6,
        vision_use_head=False,  # ignore_head: the attention-pool head is never run
    )


def read_config(directory: Path) -> DeepseekVL2Config:
    raw = read_config_json(directory)
    path = directory / "config.json"
    if raw.get("model_type") != MODEL_TYPE:
        raise VismmoeError(f"{path}: model_type is {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
    architectures = raw.get("architectures") or [ARCHITECTURE]
    if ARCHITECTURE not in architectures:  # DeepSeek-OCR reuses model_type deepseek_vl_v2 with another vision stack
        raise VismmoeError(f"{path}: architecture {', '.join(architectures)} is not supported; "
                           f"vismmoe-edge runs {ARCHITECTURE} (DeepSeek-VL2)")  # fmt: skip
    if raw.get("tile_tag", "2D") != "2D":
        raise VismmoeError(f"{path}: tile_tag {raw['tile_tag']!r} is not supported; DeepSeek-VL2 uses 2D")
    if raw.get("global_view_pos", "head") not in ("head", "tail"):
        raise VismmoeError(f"{path}: global_view_pos must be head or tail, not {raw['global_view_pos']!r}")
    projector = _dict(raw, "projector_config", path)
    if projector.get("projector_type", "downsample_mlp_gelu") != "downsample_mlp_gelu" or projector.get(
        "token_pooling", False
    ):
        raise VismmoeError(f"{path}: projector {projector.get('projector_type')!r} is not supported; "
                           "DeepSeek-VL2 uses downsample_mlp_gelu")  # fmt: skip
    text, use_mla, topk_method = text_config_from(_dict(raw, "language_config", path), path)
    vision = vision_config_from(_dict(raw, "vision_config", path), path)
    size = vision.image_size
    try:
        candidates = [(int(w), int(h)) for w, h in raw.get("candidate_resolutions", [[size, size]])]
    except (TypeError, ValueError) as e:
        raise VismmoeError(f"{path}: candidate_resolutions must be [[width, height], ...] ({e})") from e
    if not candidates or any(w % size or h % size or w <= 0 or h <= 0 for w, h in candidates):
        raise VismmoeError(f"{path}: candidate_resolutions must be positive multiples of the tile size {size}")
    n_embed = projector.get("n_embed", text.hidden_size)
    if n_embed != text.hidden_size or projector.get("input_dim", vision.hidden_size) != vision.hidden_size:
        raise VismmoeError(f"{path}: projector_config input_dim/n_embed do not match the vision width / hidden_size")
    return DeepseekVL2Config(
        text_config=text,
        vision_config=vision,
        projector_depth=int(projector.get("depth", 2)),
        projector_mlp_ratio=int(projector.get("mlp_ratio", 1)),
        downsample_ratio=int(projector.get("downsample_ratio", 2)),
        image_token_id=image_token_id_of(directory, raw),
        use_mla=use_mla,
        topk_method=topk_method,
        candidate_resolutions=candidates,
        global_view_pos=raw.get("global_view_pos", "head"),
    )
