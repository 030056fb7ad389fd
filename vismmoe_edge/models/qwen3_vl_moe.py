"""Qwen3-VL-MoE: transformers' own model without its routed experts, its processor and its prefill ops.

The skeleton is transformers' `Qwen3VLMoeForConditionalGeneration` with parameters on the meta device; each
MoE layer's `mlp.experts` is swapped for `OffloadedExperts`, so routed experts are never allocated. The
processor is `Qwen3VLProcessor` without its video processor (which needs torchvision; notes/transformers-vlmoe.md
§4.4). Qwen adds DeepStack features to the hidden states after the first decoder layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo, build_expert_catalogue
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.models.config_json import read_config_json
from vismmoe_edge.models.family import ModelFamily, keep_all_tensors
from vismmoe_edge.models.ops import MRopeOps, SaliencyCapture, VisualFeatures
from vismmoe_edge.models.processing import load_processor
from vismmoe_edge.models.resident import build_offloaded

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


def catalogue_for(config: Qwen3VLMoeConfig, table: dict[str, TensorInfo]) -> ExpertCatalogue:
    text = config.text_config
    return build_expert_catalogue(
        table,
        num_experts=text.num_experts,
        hidden=text.hidden_size,
        inter=text.moe_intermediate_size,
        expected_layers=moe_layer_indices(config),
    )


def moe_layer_indices(config: Qwen3VLMoeConfig) -> list[int]:
    text = config.text_config
    return [
        i
        for i in range(text.num_hidden_layers)
        if i not in text.mlp_only_layers and text.num_experts > 0 and (i + 1) % text.decoder_sparse_step == 0
    ]


def build_model(
    config: Qwen3VLMoeConfig,
    table: dict[str, TensorInfo],
    catalogue: ExpertCatalogue,
    files: ShardFiles,
    runtime: ExpertRuntime,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> Qwen3VLMoeForConditionalGeneration:
    """The full model with every non-expert weight loaded and routed experts served by `runtime`."""
    tied = bool(config.get_text_config().tie_word_embeddings)
    return build_offloaded(
        Qwen3VLMoeForConditionalGeneration, config, table, catalogue, files, runtime, dtype=dtype, device=device,
        tied_head=tied,
    )  # fmt: skip


class ImageOnlyProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without the video processor (which needs torchvision).

    `ProcessorMixin` reads the sub-processor list from this signature, so omitting `video_processor` here
    is what makes construction and `from_pretrained` work.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


def load_qwen3_vl_processor(model_dir: Path) -> ImageOnlyProcessor:
    """Load the processor saved beside a Qwen3-VL-MoE checkpoint (ours, or a Hugging Face directory)."""
    return load_processor(model_dir, ImageOnlyProcessor)


class Qwen3VLMoeOps(MRopeOps):
    model_type = "qwen3_vl_moe"
    supports_compression = True

    def saliency(self, model: Any, grid: torch.Tensor) -> SaliencyCapture:
        from vismmoe_edge.compress.saliency import VisionSaliency

        return VisionSaliency(model.model.visual)

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        vision = model.model.get_image_features(pixel_values, grid)
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
        if index < len(deepstack) and visual_mask is not None:
            return language_model._deepstack_process(hidden, visual_mask, deepstack[index])
        return hidden


FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    read_config=read_config,
    select_tensors=keep_all_tensors,
    catalogue_for=catalogue_for,
    build_model=build_model,
    load_processor=load_qwen3_vl_processor,
    shared_experts=lambda config: 0,
    ops=Qwen3VLMoeOps(),
)
