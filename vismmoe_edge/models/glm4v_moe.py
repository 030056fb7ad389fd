"""GLM-4.5V: build transformers' own model without its routed experts, and load everything else.

The skeleton is transformers' `Glm4vMoeForConditionalGeneration` with parameters on the meta device. Decoder
layers >= `first_k_dense_replace` are MoE blocks (`Glm4vMoeTextMoE`): their `mlp.experts` is swapped for
`OffloadedExperts`, while the router (`mlp.gate`: fp32 weight + `e_score_correction_bias` buffer), the shared
experts and the dense MLPs of the first layers stay resident. The block itself still runs the router and adds
the shared experts, so the experts we fetch are exactly the ones the model's own router chose.

The processor is `Glm4vProcessor` without its video processor (which needs torchvision, as Qwen's does;
docs/platform-facts.md §4.1), with the PIL image processor. GLM has 3-row M-RoPE and no DeepStack.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.family import ModelFamily
from vismmoe_edge.models.ops import MRopeOps, SaliencyCapture, VisualFeatures
from vismmoe_edge.models.processing import image_only, load_processor

ARCHITECTURE = "Glm4vMoeForConditionalGeneration"
MODEL_TYPE = "glm4v_moe"

_TEXT_LAYER = re.compile(r"(?:^|\.)layers\.(?P<layer>\d+)\.")  # the vision tower has `blocks`, not layers


def read_config(directory: Path) -> Glm4vMoeConfig:
    raw = read_config_json(directory)
    path = directory / "config.json"
    try:
        config = Glm4vMoeConfig.from_dict(raw)
    except (TypeError, ValueError, KeyError) as e:
        raise VismmoeError(f"{path}: invalid {MODEL_TYPE} config ({e})") from e
    text = config.text_config
    if text.n_routed_experts % text.n_group or not 0 < text.topk_group <= text.n_group:
        raise VismmoeError(
            f"{path}: {text.n_routed_experts} routed experts in {text.n_group} groups, {text.topk_group} kept: "
            "the router's group-limited top-k cannot run on that"
        )
    return config


def select_tensors(config: Glm4vMoeConfig, table: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """The tensors the model uses: GLM-4.5V checkpoints may carry a multi-token-prediction layer after the last
    decoder layer (`layers.46`), which transformers ignores on load; so do we."""
    layers = config.text_config.num_hidden_layers
    return {
        name: info
        for name, info in table.items()
        if (m := _TEXT_LAYER.search(name)) is None or int(m["layer"]) < layers
    }


def moe_layer_indices(config: Glm4vMoeConfig) -> list[int]:
    text = config.text_config
    return list(range(text.first_k_dense_replace, text.num_hidden_layers)) if text.n_routed_experts > 0 else []


ImageOnlyGlm4vProcessor = image_only(Glm4vProcessor, "ImageOnlyGlm4vProcessor")


def load_glm4v_processor(model_dir: Path) -> ImageOnlyGlm4vProcessor:
    """Load the processor saved beside a GLM-4.5V checkpoint (ours, or a Hugging Face directory)."""
    return load_processor(model_dir, ImageOnlyGlm4vProcessor)


class Glm4vMoeOps(MRopeOps):
    model_type = "glm4v_moe"
    supports_compression = True  # Qwen's patch order and block API; 3-row M-RoPE; no DeepStack to cut

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        vision = model.model.get_image_features(pixel_values, grid)
        return VisualFeatures(torch.cat(vision.pooler_output))  # no DeepStack

    def saliency(self, model: Any, grid: torch.Tensor) -> SaliencyCapture:
        from transformers.models.glm4v_moe.modeling_glm4v_moe import apply_rotary_pos_emb_vision

        from vismmoe_edge.compress.saliency import VisionSaliency

        return VisionSaliency(model.model.visual, rotary=apply_rotary_pos_emb_vision)


FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    model_class=Glm4vMoeForConditionalGeneration,
    read_config=read_config,
    moe_layers=moe_layer_indices,
    routed_experts=lambda config: int(config.text_config.n_routed_experts),
    shared_experts=lambda config: int(config.text_config.n_shared_experts),
    tied_head=lambda config: bool(config.tie_word_embeddings),
    load_processor=load_glm4v_processor,
    ops=Glm4vMoeOps(),
    select_tensors=select_tensors,
)
