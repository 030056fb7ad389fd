"""Qwen3-VL-MoE: build transformers' own model without its routed experts, and load everything else.

The skeleton is transformers' `Qwen3VLMoeForConditionalGeneration` with parameters on the meta device; each
MoE layer's `mlp.experts` is swapped for `OffloadedExperts`, so routed experts are never allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo, build_expert_catalogue
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.models.config_json import read_config_json
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
