"""What a model family gives the loader: its config reader, tensor selection, expert catalogue, model builder,
processor loader and prefill ops. Each family module (qwen3_vl_moe, glm4v_moe, deepseek_vl2) defines one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.models.ops import PrefillOps


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


def keep_all_tensors(config: Any, table: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    return table
