"""What a model family gives the loader, declared once per family module (qwen3_vl_moe, glm4v_moe, deepseek_vl2);
the expert catalogue and the model builder every family shares are written here once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo, build_expert_catalogue
from vismmoe_edge.experts.compute import ExpertRuntime
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.models.ops import PrefillOps
from vismmoe_edge.models.resident import build_offloaded


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    architecture: str
    model_class: type  # built with parameters on the meta device, routed experts swapped out
    read_config: Callable[[Path], Any]
    moe_layers: Callable[[Any], list[int]]  # decoder layers with routed experts
    routed_experts: Callable[[Any], int]  # routed experts per MoE layer
    shared_experts: Callable[[Any], int]  # always-on experts per MoE layer
    tied_head: Callable[[Any], bool]  # lm_head shares the embedding matrix
    load_processor: Callable[[Path], Any]
    ops: PrefillOps
    select_tensors: Callable[[Any, dict[str, TensorInfo]], dict[str, TensorInfo]] = lambda config, table: table
    fused_experts: bool = False  # transformers' class holds each layer's experts as [E, 2I, H] and [E, H, I]

    def catalogue_for(self, config: Any, table: dict[str, TensorInfo]) -> ExpertCatalogue:
        """Every routed expert's byte ranges; the checkpoint must hold experts for exactly the MoE layers."""
        text = config.text_config
        return build_expert_catalogue(
            table,
            num_experts=self.routed_experts(config),
            hidden=text.hidden_size,
            inter=text.moe_intermediate_size,
            expected_layers=self.moe_layers(config),
        )

    def build_model(
        self,
        config: Any,
        table: dict[str, TensorInfo],
        catalogue: ExpertCatalogue,
        files: ShardFiles,
        runtime: ExpertRuntime,
        *,
        dtype: torch.dtype,
        device: torch.device,
        host_embedding: bool = False,
    ) -> Any:
        """The full model with every non-expert weight loaded and routed experts served by `runtime`
        (`host_embedding`: the token embedding in mapped host memory, models/host_embedding.py)."""
        return build_offloaded(
            self.model_class, config, table, catalogue, files, runtime, dtype=dtype, device=device,
            tied_head=self.tied_head(config), host_embedding=host_embedding,
        )  # fmt: skip
