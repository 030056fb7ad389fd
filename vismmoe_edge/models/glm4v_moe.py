"""GLM-4.5V: build transformers' own model without its routed experts, and load everything else.

The skeleton is transformers' `Glm4vMoeForConditionalGeneration` with parameters on the meta device. Decoder
layers >= `first_k_dense_replace` are MoE blocks (`Glm4vMoeTextMoE`): their `mlp.experts` is swapped for
`OffloadedExperts`, while the router (`mlp.gate`: fp32 weight + `e_score_correction_bias` buffer), the shared
experts and the dense MLPs of the first layers stay resident. The block itself still runs the router and adds
the shared experts, so the experts we fetch are exactly the ones the model's own router chose.

The processor is `Glm4vProcessor` without its video processor (which needs torchvision, as Qwen's does;
notes/transformers-vlmoe.md §4.4), with the PIL image processor. GLM has 3-row M-RoPE and no DeepStack.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from transformers import Glm4vMoeConfig, Glm4vMoeForConditionalGeneration
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo, build_expert_catalogue
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.models.config_json import read_config_json
from vismmoe_edge.models.family import ModelFamily
from vismmoe_edge.models.ops import MRopeOps, SaliencyCapture, VisualFeatures
from vismmoe_edge.models.processing import load_processor
from vismmoe_edge.models.resident import build_offloaded

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


def catalogue_for(config: Glm4vMoeConfig, table: dict[str, TensorInfo]) -> ExpertCatalogue:
    text = config.text_config
    return build_expert_catalogue(
        table,
        num_experts=text.n_routed_experts,
        hidden=text.hidden_size,
        inter=text.moe_intermediate_size,
        expected_layers=moe_layer_indices(config),
    )


def build_model(
    config: Glm4vMoeConfig,
    table: dict[str, TensorInfo],
    catalogue: ExpertCatalogue,
    files: ShardFiles,
    runtime: ExpertRuntime,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> Glm4vMoeForConditionalGeneration:
    """The full model with every non-expert weight loaded and routed experts served by `runtime`."""
    return build_offloaded(
        Glm4vMoeForConditionalGeneration, config, table, catalogue, files, runtime, dtype=dtype, device=device,
        tied_head=bool(config.tie_word_embeddings),
    )  # fmt: skip


class ImageOnlyGlm4vProcessor(Glm4vProcessor):
    """`Glm4vProcessor` without the video processor (which needs torchvision).

    `ProcessorMixin` reads the sub-processor list from this signature, so omitting `video_processor` here is
    what makes construction and `from_pretrained` work.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


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
    read_config=read_config,
    select_tensors=select_tensors,
    catalogue_for=catalogue_for,
    build_model=build_model,
    load_processor=load_glm4v_processor,
    shared_experts=lambda config: int(config.text_config.n_shared_experts),
    ops=Glm4vMoeOps(),
)
