"""DeepSeek-VL2's prefill ops: 1-D positions, the tiled vision path, compression over patch tokens only."""

from __future__ import annotations

from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.deepseek_vl2.model import layout_index
from vismmoe_edge.models.ops import NoDeepStack, SaliencyCapture, VisualFeatures


class DeepseekVL2Ops(NoDeepStack):
    """DeepSeek-VL2: 1-D RoPE positions 0..N-1 (carried as three equal rows, so that the engine's position
    bookkeeping stays one shape), no DeepStack. The tiled image layout is the model's own `image_features`.

    Compression drops only patch tokens: an image's newline tokens (one per token row of the global view and of
    the stitched local tiles) and its view separator carry no image content and mark the 2-D layout, so they are
    always kept. A cut keeps the 1-D positions of the kept tokens; decode continues after the uncompressed
    numbering."""

    model_type = "deepseek_vl_v2"
    supports_compression = True
    static_decode = False  # a shared expert beside the routed ones: the eager layer
    expands_image_placeholders = False  # tiles, newlines and separators: not one run of placeholders

    def image_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        return VisualFeatures(model.image_features(pixel_values, grid))

    def _layouts(self, model: Any, grid: torch.Tensor) -> list[torch.Tensor]:
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

    def video_features(self, model: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> VisualFeatures:
        raise VismmoeError("DeepSeek-VL2 takes no video input")

    def rope_positions(
        self,
        model: Any,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        grid: torch.Tensor | None,
        video_grid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return torch.arange(input_ids.shape[1], device=input_ids.device).view(1, 1, -1).expand(3, 1, -1)

    def rotary(self, language_model: Any, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return language_model.rotary_emb(hidden, positions[0])  # [1, N]: DeepSeek-V2 / Llama rotary take 1-D ids
