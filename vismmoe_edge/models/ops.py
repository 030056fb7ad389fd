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
from typing import Any, Protocol

import torch

from vismmoe_edge.compress.cut import SaliencyCapture
from vismmoe_edge.errors import VismmoeError


@dataclass
class VisualFeatures:
    embeds: torch.Tensor  # [V, H]: merged visual tokens of every image, in prompt order
    deepstack: list[torch.Tensor] = field(default_factory=list)  # one [V, H] per early decoder layer; [] if none


class PrefillOps(Protocol):
    model_type: str
    supports_compression: bool  # whether engine._compress understands this family's positions and features
    # whether static_decode.StaticDecoder's layer body (norm, attention, norm, routed experts with no shared
    # experts or second router) is this family's decoder layer
    static_decode: bool
    # whether the processor turns a prompt's images into tokens only by expanding each image placeholder to the
    # image's visual-token count (grid t*h*w / merge**2), so seen_frames.py can rebuild the prompt without pixels
    expands_image_placeholders: bool

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures: ...

    def video_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        """The vision tower's tokens of every clip, in prompt order (families whose processor takes video)."""
        ...

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
        self,
        model: Any,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        grid: torch.Tensor | None,
        video_grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """M-RoPE positions [3, 1, N] of a prompt with images and clips."""
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
    static_decode = False
    expands_image_placeholders = False

    def rope_positions(
        self,
        model: Any,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        grid: torch.Tensor | None,
        video_grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        positions, _ = model.model.get_rope_index(
            input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=grid, video_grid_thw=video_grid
        )
        return positions

    def video_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        raise VismmoeError(f"{self.model_type} takes no video input here yet (Qwen3-VL-MoE does)")

    def rotary(self, language_model: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return language_model.rotary_emb(hidden, positions)

    def visual_token_counts(self, model: Any, grid: torch.Tensor) -> list[int]:
        merge = int(model.model.visual.spatial_merge_size)  # one LLM token per merge x merge patches
        return [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]

    def droppable_tokens(self, model: Any, grid: torch.Tensor) -> list[torch.Tensor]:
        return [torch.arange(n) for n in self.visual_token_counts(model, grid)]  # every token is a patch group


def join_in_prompt_order(
    images: VisualFeatures, videos: VisualFeatures, image_mask: torch.Tensor, video_mask: torch.Tensor
) -> VisualFeatures:
    """Images' and clips' visual tokens (and DeepStack features) as one sequence in prompt order, as
    transformers' Qwen3VLMoeModel.forward joins them when a prompt holds both. The masks are [N] bool."""
    is_image = image_mask[image_mask | video_mask]

    def join(image_rows: torch.Tensor, video_rows: torch.Tensor) -> torch.Tensor:
        out = image_rows.new_zeros(is_image.shape[0], image_rows.shape[-1])
        out[is_image] = image_rows
        out[~is_image] = video_rows.to(out.dtype)
        return out

    deepstack = [join(a, b) for a, b in zip(images.deepstack, videos.deepstack, strict=True)]
    return VisualFeatures(join(images.embeds, videos.embeds), deepstack)


def visual_features(
    ops: PrefillOps, model: Any, inputs: Any, input_ids: torch.Tensor, grid: torch.Tensor | None, dtype: torch.dtype
) -> tuple[VisualFeatures, torch.Tensor]:
    """The vision tower's tokens for a prompt's images and clips (PromptInputs; pixels at `dtype` on the prompt's
    device), joined in prompt order, and the mask [1, N] of their placeholders."""
    device = input_ids.device
    image_mask = input_ids == model.config.image_token_id
    if inputs.pixel_values is not None:
        images = ops.image_features(model, inputs.pixel_values.to(device, dtype), grid)
    if inputs.pixel_values_videos is None:
        return images, image_mask
    clips = ops.video_features(model, inputs.pixel_values_videos.to(device, dtype), inputs.video_grid_thw.to(device))
    video_mask = input_ids == model.config.video_token_id
    if inputs.pixel_values is None:
        return clips, video_mask
    return join_in_prompt_order(images, clips, image_mask[0], video_mask[0]), image_mask | video_mask
