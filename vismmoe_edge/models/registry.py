"""Which model family a checkpoint is (by config.json's model_type), and the family's loading functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.config_json import read_config_json
from vismmoe_edge.models.prefill_ops import DeepseekVL2Ops, Glm4vMoeOps, PrefillOps, Qwen3VLMoeOps


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    architecture: str
    read_config: Callable[[Path], Any]
    select_tensors: Callable[[Any, dict[str, TensorInfo]], dict[str, TensorInfo]]  # drop what the model ignores
    catalogue_for: Callable[[Any, dict[str, TensorInfo]], ExpertCatalogue]
    build_model: Callable[..., Any]
    load_processor: Callable[[Path], Any]
    shared_experts: Callable[[Any], int]  # always-on experts per MoE layer
    ops: PrefillOps


def _qwen3_vl_moe() -> ModelFamily:
    from vismmoe_edge.models import qwen3_vl_moe
    from vismmoe_edge.processor import load_processor

    return ModelFamily(
        model_type=qwen3_vl_moe.MODEL_TYPE,
        architecture=qwen3_vl_moe.ARCHITECTURE,
        read_config=qwen3_vl_moe.read_config,
        select_tensors=lambda config, table: table,
        catalogue_for=qwen3_vl_moe.catalogue_for,
        build_model=qwen3_vl_moe.build_model,
        load_processor=load_processor,
        shared_experts=lambda config: 0,
        ops=Qwen3VLMoeOps(),
    )


def _glm4v_moe() -> ModelFamily:
    from vismmoe_edge.models import glm4v_moe
    from vismmoe_edge.processor_glm4v import load_glm4v_processor

    return ModelFamily(
        model_type=glm4v_moe.MODEL_TYPE,
        architecture=glm4v_moe.ARCHITECTURE,
        read_config=glm4v_moe.read_config,
        select_tensors=glm4v_moe.select_tensors,
        catalogue_for=glm4v_moe.catalogue_for,
        build_model=glm4v_moe.build_model,
        load_processor=load_glm4v_processor,
        shared_experts=lambda config: int(config.text_config.n_shared_experts),
        ops=Glm4vMoeOps(),
    )


def _deepseek_vl2() -> ModelFamily:
    from vismmoe_edge.models import deepseek_vl2
    from vismmoe_edge.processor_deepseek_vl2 import load_deepseek_vl2_processor

    return ModelFamily(
        model_type=deepseek_vl2.MODEL_TYPE,
        architecture=deepseek_vl2.ARCHITECTURE,
        read_config=deepseek_vl2.read_config,
        select_tensors=deepseek_vl2.select_tensors,
        catalogue_for=deepseek_vl2.catalogue_for,
        build_model=deepseek_vl2.build_model,
        load_processor=load_deepseek_vl2_processor,
        shared_experts=lambda config: int(config.text_config.n_shared_experts),
        ops=DeepseekVL2Ops(),
    )


# model_type -> (architecture, factory); factories import transformers' model classes only when chosen
FAMILIES: dict[str, tuple[str, Callable[[], ModelFamily]]] = {
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", _qwen3_vl_moe),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", _glm4v_moe),
    "deepseek_vl_v2": ("DeepseekVLV2ForCausalLM", _deepseek_vl2),
}


def model_family(directory: Path) -> ModelFamily:
    """The family of the checkpoint in `directory`, from config.json's model_type (or its architectures)."""
    raw = read_config_json(directory)
    architectures = raw.get("architectures") or []
    for model_type, (architecture, factory) in FAMILIES.items():
        if raw.get("model_type") == model_type or architecture in architectures:
            return factory()
    found = ", ".join(architectures) or raw.get("model_type", "unknown")
    supported = " or ".join(architecture for architecture, _ in FAMILIES.values())
    raise VismmoeError(f"{directory}: unsupported architecture {found}; vismmoe-edge runs {supported}")
