"""What differs between model families inside the engine's prefill loop, behind one small interface.

Qwen3-VL-MoE and GLM-4.5V share the loop's shape (embed, scatter visual tokens, 3-row M-RoPE positions,
cos/sin once, decoder layers, norm, lm_head). They differ in what the vision tower returns (Qwen adds
DeepStack features injected after the first decoder layers; GLM has none). DeepSeek-VL2 has 1-D positions
and its own tiled vision path. Everything here calls the loaded model's own methods.

For visual-token compression each family also says how many LLM tokens each image takes, which of them may be
dropped (DeepSeek-VL2's newline and view-separator tokens are kept) and how to score those from its vision tower.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import torch


@dataclass
class VisualFeatures:
    embeds: torch.Tensor  # [V, H]: merged visual tokens of every image, in prompt order
    deepstack: list[torch.Tensor] = field(default_factory=list)  # one [V, H] per early decoder layer; [] if none


class SaliencyCapture(Protocol):
    """Installed around the vision forward (a context manager); then one score per droppable visual token."""

    def __enter__(self) -> SaliencyCapture: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def per_image(self) -> list[torch.Tensor]:
        """Per image, in [0, 1], over the tokens `droppable_tokens` lists (same order)."""
        ...


class PrefillOps(Protocol):
    model_type: str
    supports_compression: bool  # whether engine._compress understands this family's positions and features

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures: ...

    def visual_token_counts(self, model: Any, grid: torch.Tensor) -> list[int]:
        """LLM tokens of each image (its image-token placeholders), in prompt order."""
        ...

    def droppable_tokens(self, model: Any, grid: torch.Tensor) -> list[torch.Tensor]:
        """Per image, ascending indices into its visual tokens that compression may drop (the others are kept)."""
        ...

    def saliency(self, model: Any, grid: torch.Tensor) -> SaliencyCapture:
        """A capture of the vision tower's last-block attention, scoring each image's droppable tokens."""
        ...

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


class NoDeepStack:
    """Families whose vision tower adds nothing to the decoder's hidden states after a layer."""

    def after_layer(
        self,
        language_model: Any,
        index: int,
        hidden: torch.Tensor,
        visual_mask: torch.Tensor | None,
        deepstack: list[torch.Tensor],
    ) -> torch.Tensor:
        return hidden


class MRopeOps(NoDeepStack):
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

    def visual_token_counts(self, model: Any, grid: torch.Tensor) -> list[int]:
        merge = int(model.model.visual.spatial_merge_size)  # one LLM token per merge x merge patches
        return [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]

    def droppable_tokens(self, model: Any, grid: torch.Tensor) -> list[torch.Tensor]:
        return [torch.arange(n) for n in self.visual_token_counts(model, grid)]  # every token is a patch group


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


class DeepseekVL2Ops(NoDeepStack):
    """DeepSeek-VL2: 1-D RoPE positions 0..N-1 (carried as three equal rows, so that the engine's position
    bookkeeping stays one shape), no DeepStack. The tiled image layout is the model's own `image_features`.

    Compression drops only patch tokens: an image's newline tokens (one per token row of the global view and of
    the stitched local tiles) and its view separator carry no image content and mark the 2-D layout, so they are
    always kept. A cut keeps the 1-D positions of the kept tokens; decode continues after the uncompressed
    numbering."""

    model_type = "deepseek_vl_v2"
    supports_compression = True

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        return VisualFeatures(model.image_features(pixel_values, grid))

    def _layouts(self, model: Any, grid: torch.Tensor) -> list[torch.Tensor]:
        from vismmoe_edge.models.deepseek_vl2 import layout_index

        side, head = model.config.tokens_per_side, model.config.global_view_pos == "head"
        return [layout_index(int(h), int(w), side, head) for _, h, w in grid.tolist()]

    def visual_token_counts(self, model: Any, grid: torch.Tensor) -> list[int]:
        return [len(layout) for layout in self._layouts(model, grid)]

    def droppable_tokens(self, model: Any, grid: torch.Tensor) -> list[torch.Tensor]:
        return [(layout >= 0).nonzero().flatten() for layout in self._layouts(model, grid)]

    def saliency(self, model: Any, grid: torch.Tensor) -> SaliencyCapture:
        from vismmoe_edge.compress.tile_saliency import TileSaliency

        views = [1 + int(h) * int(w) for _, h, w in grid.tolist()]
        return TileSaliency(model.vision, views, self._layouts(model, grid), ratio=model.config.downsample_ratio)

    def rope_positions(
        self, model: Any, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, grid: torch.Tensor
    ) -> torch.Tensor:
        return torch.arange(input_ids.shape[1], device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)

    def rotary(self, language_model: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return language_model.rotary_emb(hidden, positions[0])  # [1, N]: DeepSeek-V2 / Llama rotary take 1-D ids


OPS: dict[str, type] = {"qwen3_vl_moe": Qwen3VLMoeOps, "glm4v_moe": Glm4vMoeOps, "deepseek_vl_v2": DeepseekVL2Ops}


def ops_for_model(model: Any) -> PrefillOps:
    """The ops of a loaded transformers model, by its config's model_type (Qwen3-VL-MoE when unknown)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return OPS.get(model_type or "", Qwen3VLMoeOps)()
