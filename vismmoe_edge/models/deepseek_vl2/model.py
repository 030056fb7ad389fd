"""DeepSeek-VL2 (Tiny / Small / Base) from transformers' parts, loading the original checkpoint names.

transformers has no DeepSeek-VL2, so the model is assembled here, with module names chosen so that the state
dict *is* the original checkpoint's key set:
- `language`: transformers' `DeepseekV2ForCausalLM` (keys `language.model.layers.{l}...`, `language.lm_head`).
  Its MoE blocks keep their router and shared experts; `mlp.experts` becomes `OffloadedExperts`. Two changes
  for variants transformers' DeepSeek-V2 cannot express: `use_mla: false` (VL2-Tiny) swaps every layer's
  attention for transformers' `LlamaAttention` and the rotary embedding for Llama's (the original runs
  LlamaAttention there too), and `topk_method: noaux_tc` (VL2-Base) swaps the router for `NoauxTcRouter`.
- `vision`: transformers' `SiglipVisionModel`; the timm names of the original (`vision.blocks.{i}.attn.qkv`,
  ...) are renamed, and the fused qkv split into three byte ranges, in the tensor table (`select_tensors`).
- `projector` (downsample_mlp_gelu), `image_newline`, `view_seperator` (sic: the checkpoint's spelling).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, SiglipVisionModel
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.deepseek_vl2.config import DeepseekVL2Config


class NoauxTcRouter(nn.Module):
    """`noaux_tc` routing exactly as DeepSeek-VL2's MoEGate runs it: sigmoid scores, the correction bias added for
    choosing only, group-limited top-k, weights renormalised when top_k > 1 and norm_topk_prob, then scaled.

    Not transformers' DeepseekV3TopkRouter: that one masks dropped groups with -inf where the original masks
    with 0.0 (different picks once a biased score is negative) and renormalises even at top_k = 1.
    """

    def __init__(self, config: DeepseekV2Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden_states = hidden_states.view(-1, self.weight.shape[1])
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        group_scores = choice.view(-1, self.n_group, self.num_experts // self.n_group).topk(2, dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.repeat_interleave(self.num_experts // self.n_group, dim=1).bool()
        index = choice.masked_fill(~keep, 0.0).topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, index)
        if self.top_k > 1 and self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return logits, weights * self.routed_scaling_factor, index


class DownsampleProjector(nn.Module):
    """downsample_mlp_gelu: pad the patch grid to a multiple of `ratio`, concatenate each ratio x ratio block
    (F.unfold order: channel-major), then Linear-GELU-...-Linear; the checkpoint's `projector.layers.{i}`."""

    def __init__(self, input_dim: int, n_embed: int, depth: int, mlp_ratio: int, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        width = n_embed * mlp_ratio
        modules: list[nn.Module] = [nn.Linear(input_dim * ratio * ratio, width)]
        for _ in range(1, depth - 1):
            modules += [nn.GELU(), nn.Linear(width, width)]
        modules += [nn.GELU(), nn.Linear(width, n_embed)]
        self.layers = nn.Sequential(*modules)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tiles, hw, dim = x.shape
        side = math.isqrt(hw)
        pad = -side % self.ratio
        x = F.pad(x.reshape(tiles, side, side, dim), (0, 0, 0, pad, 0, pad))
        x = F.unfold(x.permute(0, 3, 1, 2), kernel_size=self.ratio, stride=self.ratio)  # [tiles, dim*r*r, L]
        return self.layers(x.permute(0, 2, 1))


def layout_image(
    features: torch.Tensor,
    height_tiles: int,
    width_tiles: int,
    newline: torch.Tensor,
    separator: torch.Tensor,
    global_first: bool,
) -> torch.Tensor:
    """One image's visual tokens in prompt order (tile_tag 2D): the global view's h rows of w tokens plus a
    newline, the view separator, then the local tiles stitched into (th*h) rows of (tw*w) tokens plus a newline.
    `features` is [1 + th*tw, h*w, D], global view first."""
    _, hw, dim = features.shape
    side = math.isqrt(hw)
    glob = torch.cat([features[0].view(side, side, dim), newline.expand(side, 1, dim)], dim=1).view(-1, dim)
    local = features[1:].view(height_tiles, width_tiles, side, side, dim).permute(0, 2, 1, 3, 4)
    local = local.reshape(height_tiles * side, width_tiles * side, dim)
    local = torch.cat([local, newline.expand(height_tiles * side, 1, dim)], dim=1).view(-1, dim)
    parts = [glob, separator[None], local] if global_first else [local, separator[None], glob]
    return torch.cat(parts)


def layout_index(height_tiles: int, width_tiles: int, side: int, global_first: bool) -> torch.Tensor:
    """For each of one image's visual tokens (prompt order): the row of its views' flattened projected tokens
    [(1 + th*tw) * side*side] (global view first, as pixel_values holds them) it comes from, or -1 for a newline
    or the view separator. `layout_image` itself lays out the row numbers, so the two cannot disagree."""
    views = 1 + height_tiles * width_tiles
    rows = torch.arange(views * side * side).view(views, side * side, 1)
    marker = torch.full((1,), -1, dtype=torch.long)
    return layout_image(rows, height_tiles, width_tiles, marker, marker, global_first).view(-1)


def llama_attention_config(text: DeepseekV2Config) -> LlamaConfig:
    """Plain multi-head attention of the `use_mla: false` variants, as the original's LlamaAttention sees it."""
    config = LlamaConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.hidden_size // text.num_attention_heads,
        attention_bias=text.attention_bias,
        max_position_embeddings=text.max_position_embeddings,
        rope_parameters=dict(text.rope_parameters),
    )
    config._attn_implementation = text._attn_implementation
    return config


class DeepseekVL2ForCausalLM(nn.Module):
    """The whole model; `.model.language_model` / `.model.visual` / `.lm_head` are what the engine walks."""

    # As transformers' DeepSeek models: routers stay fp32 under bf16/fp16 (matched by substring).
    _keep_in_fp32_modules_strict = ["gate.weight", "gate.e_score_correction_bias"]

    def __init__(self, config: DeepseekVL2Config) -> None:
        super().__init__()
        self.config = config
        text = config.text_config
        self.vision = SiglipVisionModel(config.vision_config)
        self.projector = DownsampleProjector(
            config.vision_config.hidden_size, text.hidden_size, config.projector_depth,
            config.projector_mlp_ratio, config.downsample_ratio,
        )  # fmt: skip
        self.image_newline = nn.Parameter(torch.zeros(text.hidden_size))
        self.view_seperator = nn.Parameter(torch.zeros(text.hidden_size))
        self.language = DeepseekV2ForCausalLM(text)
        lm = self.language.model
        if not config.use_mla:
            mha = llama_attention_config(text)
            for i, layer in enumerate(lm.layers):
                layer.self_attn = LlamaAttention(mha, i)
            lm.rotary_emb = LlamaRotaryEmbedding(mha)  # (cos, sin) for rotate_half RoPE over the whole head
        if config.topk_method == "noaux_tc":
            for layer in lm.layers[text.first_k_dense_replace :]:
                layer.mlp.gate = NoauxTcRouter(text)

    @property
    def model(self) -> SimpleNamespace:
        return SimpleNamespace(language_model=self.language.model, visual=self.vision)

    @property
    def lm_head(self) -> nn.Linear:
        return self.language.lm_head

    def image_features(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """Visual tokens [V, H] of every image in prompt order. `pixel_values` [tiles, 3, S, S] holds each image's
        global view then its local tiles; `grid` [images, 3] is (1, height tiles, width tiles) per image."""
        features = self.projector(self.vision(pixel_values).last_hidden_state)
        counts = [1 + int(h) * int(w) for _, h, w in grid.tolist()]
        if sum(counts) != features.shape[0]:
            raise ValueError(f"images need {sum(counts)} tiles, pixel_values holds {features.shape[0]}")
        out = []
        for (_, h, w), tiles in zip(grid.tolist(), features.split(counts), strict=True):
            out.append(
                layout_image(tiles, int(h), int(w), self.image_newline, self.view_seperator,
                             self.config.global_view_pos == "head")
            )  # fmt: skip
        return torch.cat(out)


# ---- the original timm names of the vision tower, as SiglipVisionModel names --------------------------------
_BLOCK = re.compile(r"^vision\.blocks\.(\d+)\.(norm1|norm2|attn\.proj|mlp\.fc1|mlp\.fc2)\.(weight|bias)$")
_BLOCK_MODULES = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj"}  # else same
_TOP = {  # timm name -> SiglipVisionModel name, outside the blocks
    "vision.patch_embed.proj.weight": "vision.embeddings.patch_embedding.weight",
    "vision.patch_embed.proj.bias": "vision.embeddings.patch_embedding.bias",
    "vision.norm.weight": "vision.post_layernorm.weight",
    "vision.norm.bias": "vision.post_layernorm.bias",
}
_QKV = re.compile(r"^vision\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)$")
_UNUSED = re.compile(r"^vision\.attn_pool\.")  # the attention-pool head: built by the original, never run


def split_rows(info: TensorInfo, names: list[str]) -> list[TensorInfo]:
    """A tensor cut into len(names) equal blocks of rows: each block is one contiguous byte range of the file."""
    rows = info.shape[0] // len(names)
    per = info.nbytes // len(names)
    return [
        replace(info, name=name, shape=(rows, *info.shape[1:]), offset=info.offset + i * per, nbytes=per)
        for i, name in enumerate(names)
    ]


def siglip_names(table: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The vision tensors under SiglipVisionModel's names: fused qkv split into q/k/v (timm's reshape to
    [3, heads, head_dim] puts q rows first), pos_embed [1, N, C] seen as the embedding table [N, C]."""
    out: dict[str, TensorInfo] = {}
    for name, info in table.items():
        if _UNUSED.match(name):
            continue
        if m := _QKV.match(name):
            if info.shape[0] % 3:
                raise VismmoeError(f"{info.shard}: tensor {name} has shape {list(info.shape)}, not 3 stacked blocks")
            prefix = f"vision.encoder.layers.{m[1]}.self_attn"
            out |= {i.name: i for i in split_rows(info, [f"{prefix}.{p}_proj.{m[2]}" for p in "qkv"])}
            continue
        if name == "vision.pos_embed":
            out["vision.embeddings.position_embedding.weight"] = replace(
                info, name="vision.embeddings.position_embedding.weight", shape=info.shape[-2:]
            )
            continue
        if m := _BLOCK.match(name):
            name = f"vision.encoder.layers.{m[1]}.{_BLOCK_MODULES.get(m[2], m[2])}.{m[3]}"
        name = _TOP.get(name, name)
        out[name] = replace(info, name=name)
    return out


def select_tensors(config: DeepseekVL2Config, table: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    return siglip_names(table)


def moe_layer_indices(config: DeepseekVL2Config) -> list[int]:
    text = config.text_config
    return list(range(text.first_k_dense_replace, text.num_hidden_layers))


