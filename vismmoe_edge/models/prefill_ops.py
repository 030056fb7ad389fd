"""What differs between model families inside the engine's prefill loop, behind one small interface.

Qwen3-VL-MoE and GLM-4.5V share the loop's shape (embed, scatter visual tokens, 3-row M-RoPE positions,
cos/sin once, decoder layers, norm, lm_head). They differ in what the vision tower returns (Qwen adds
DeepStack features injected after the first decoder layers; GLM has none) and in whether visual-token
compression is supported yet. Everything here calls transformers' own methods of the loaded model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class VisualFeatures:
    embeds: torch.Tensor  # [V, H]: merged visual tokens of every image, in prompt order
    deepstack: list[torch.Tensor] = field(default_factory=list)  # one [V, H] per early decoder layer; [] if none


class PrefillOps(Protocol):
    model_type: str
    supports_compression: bool  # whether engine._compress understands this family's positions and features

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures: ...

    def rope_positions(
        self, model: Any, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, grid: torch.Tensor
    ) -> torch.Tensor:
        """M-RoPE positions [3, 1, N] of a prompt with images."""
        ...

    def rotary(self, language_model: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(cos, sin) for `positions`, computed once and shared by every layer."""
        ...

    def after_layer(
        self,
        language_model: Any,
        index: int,
        hidden: torch.Tensor,
        visual_mask: torch.Tensor | None,
        deepstack: list[torch.Tensor],
    ) -> torch.Tensor:
        """What the family adds to the hidden states after decoder layer `index` (DeepStack), or nothing."""
        ...


class MRopeOps:
    """The shared part: `get_rope_index` and the text model's own rotary embedding, as transformers calls them."""

    model_type = ""
    supports_compression = False

    def rope_positions(
        self, model: Any, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, grid: torch.Tensor
    ) -> torch.Tensor:
        positions, _ = model.model.get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid)
        return positions

    def rotary(self, language_model: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return language_model.rotary_emb(hidden, positions)


class Qwen3VLMoeOps(MRopeOps):
    model_type = "qwen3_vl_moe"
    supports_compression = True

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


class Glm4vMoeOps(MRopeOps):
    model_type = "glm4v_moe"
    supports_compression = False  # engine._compress and VisionSaliency assume Qwen's vision tower for now

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        vision = model.model.get_image_features(pixel_values, grid)
        return VisualFeatures(torch.cat(vision.pooler_output))  # no DeepStack

    def after_layer(
        self,
        language_model: Any,
        index: int,
        hidden: torch.Tensor,
        visual_mask: torch.Tensor | None,
        deepstack: list[torch.Tensor],
    ) -> torch.Tensor:
        return hidden


OPS: dict[str, type[MRopeOps]] = {"qwen3_vl_moe": Qwen3VLMoeOps, "glm4v_moe": Glm4vMoeOps}


def ops_for_model(model: Any) -> PrefillOps:
    """The ops of a loaded transformers model, by its config's model_type (Qwen3-VL-MoE when unknown)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return OPS.get(model_type or "", Qwen3VLMoeOps)()
