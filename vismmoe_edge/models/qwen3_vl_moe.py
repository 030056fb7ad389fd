"""Qwen3-VL-MoE: transformers' own model without its routed experts, its processor and its prefill ops.

The skeleton is transformers' `Qwen3VLMoeForConditionalGeneration` with parameters on the meta device; each
MoE layer's `mlp.experts` is swapped for `OffloadedExperts`, so routed experts are never allocated. The
processor is `Qwen3VLProcessor` loaded without its video processor (which needs torchvision;
platform-facts.md §4.1); that is attached afterwards (models/video_processing.py). Qwen adds DeepStack
features to the hidden states after the first decoder layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.family import ModelFamily
from vismmoe_edge.models.ops import MRopeOps, SaliencyCapture, VisualFeatures
from vismmoe_edge.models.processing import image_only, load_processor
from vismmoe_edge.models.video_processing import attach_video_processor

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
MODEL_TYPE = "qwen3_vl_moe"


def read_config(directory: Path) -> Qwen3VLMoeConfig:
    raw = read_config_json(directory)
    path = directory / "config.json"
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != MODEL_TYPE and ARCHITECTURE not in architectures:
        found = ", ".join(architectures) or raw.get("model_type", "unknown")
        raise VismmoeError(f"{directory}: unsupported architecture {found}; vismmoe-edge runs {ARCHITECTURE}")
    try:
        return Qwen3VLMoeConfig.from_dict(raw)
    except (TypeError, ValueError, KeyError) as e:
        raise VismmoeError(f"{path}: invalid {MODEL_TYPE} config ({e})") from e


def moe_layer_indices(config: Qwen3VLMoeConfig) -> list[int]:
    text = config.text_config
    return [
        i
        for i in range(text.num_hidden_layers)
        if i not in text.mlp_only_layers and text.num_experts > 0 and (i + 1) % text.decoder_sparse_step == 0
    ]


ImageOnlyProcessor = image_only(Qwen3VLProcessor, "ImageOnlyProcessor")


def load_qwen3_vl_processor(model_dir: Path) -> ImageOnlyProcessor:
    """Load the processor saved beside a Qwen3-VL-MoE checkpoint (ours, or a Hugging Face directory), with
    transformers' video processor attached after loading (models/video_processing.py says why after)."""
    return attach_video_processor(load_processor(model_dir, ImageOnlyProcessor), model_dir)


class Qwen3VLMoeOps(MRopeOps):
    model_type = "qwen3_vl_moe"
    supports_compression = True
    static_decode = True  # norm, attention, norm, routed experts: StaticDecoder's layer body
    expands_image_placeholders = True  # Qwen3VLProcessor.replace_image_token (tests/test_seen_frames.py)

    def saliency(self, model: Any, grid: torch.Tensor) -> SaliencyCapture:
        from vismmoe_edge.compress.saliency import VisionSaliency

        return VisionSaliency(model.model.visual, rotary=apply_rotary_pos_emb_vision)

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        vision = model.model.get_image_features(pixel_values, grid)
        deepstack = [torch.cat(features) for features in vision.deepstack_features]
        return VisualFeatures(torch.cat(vision.pooler_output), deepstack)

    def video_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        vision = model.model.get_video_features(pixel_values, grid)
        deepstack = [torch.cat(features) for features in vision.deepstack_features]
        return VisualFeatures(torch.cat(vision.pooler_output), deepstack)

    def after_layer(
        self,
        language_model: Any,
        index: int,
        hidden: torch.Tensor,
        visual_mask: torch.Tensor | None,
        deepstack: list[torch.Tensor],
    ) -> torch.Tensor:
        # (a prompt part with no visual token, e.g. after a reused prefix, adds nothing: no masked read to wait for)
        if index < len(deepstack) and visual_mask is not None and deepstack[index].shape[0] > 0:
            return language_model._deepstack_process(hidden, visual_mask, deepstack[index])
        return hidden


FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    model_class=Qwen3VLMoeForConditionalGeneration,
    read_config=read_config,
    moe_layers=moe_layer_indices,
    routed_experts=lambda config: int(config.text_config.num_experts),
    shared_experts=lambda config: 0,
    tied_head=lambda config: bool(config.get_text_config().tie_word_embeddings),
    load_processor=load_qwen3_vl_processor,
    ops=Qwen3VLMoeOps(),
    fused_experts=True,
)
