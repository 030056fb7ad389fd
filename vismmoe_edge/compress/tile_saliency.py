"""Visual-token saliency for DeepSeek-VL2: the attention each patch receives inside its own tile view.

DeepSeek-VL2's SigLIP tower runs every tile view (an image's global view and each of its local tiles) as one
batch element: full bidirectional attention over that view's side x side patches (27 x 27 at 384 px), with no
class token and no rotary embedding. A pre-hook on the last encoder layer's attention recomputes q and k with
the layer's own projections and scores each patch by the attention it receives, averaged over heads and over
the queries of its view (`attention_received`, chunked as for Qwen).

The projector zero-pads each view's patch grid to a multiple of the downsample ratio and concatenates each
ratio x ratio block into one token (F.unfold order, blocks in raster order), so a token's score is the mean of
the real patches of its block: padding is not a patch and receives no attention.
"""

from __future__ import annotations

import math
from types import TracebackType

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from vismmoe_edge.compress.saliency import attention_received, normalize01


def pool_to_tokens(patch_scores: Tensor, ratio: int) -> Tensor:
    """[views, side*side] patch scores -> [views, t*t] token scores, t = ceil(side / ratio): the mean over the
    real patches of each ratio x ratio block of the zero-padded grid, blocks in raster order."""
    views, hw = patch_scores.shape
    side = math.isqrt(hw)
    if side * side != hw:
        raise ValueError(f"{hw} patches per view is not a square grid")
    t = -(-side // ratio)
    padded = torch.zeros(views, t * ratio, t * ratio, dtype=patch_scores.dtype, device=patch_scores.device)
    padded[:, :side, :side] = patch_scores.view(views, side, side)
    real = torch.zeros(t * ratio, t * ratio, dtype=patch_scores.dtype, device=patch_scores.device)
    real[:side, :side] = 1.0
    sums = padded.view(views, t, ratio, t, ratio).sum(dim=(2, 4))  # [views, t, t]
    counts = real.view(t, ratio, t, ratio).sum(dim=(1, 3))  # real patches per block, >= 1
    return (sums / counts).reshape(views, t * t)


class TileSaliency:
    """Per-image saliency over DeepSeek-VL2's patch tokens (newline and view-separator tokens excluded).

        with TileSaliency(model.vision, views_per_image, layouts, ratio=2) as sal:
            model.image_features(pixel_values, grid)
        scores = sal.per_image()  # one tensor per image, over its patch tokens in prompt order, in [0, 1]

    `layouts[i]` maps image i's visual tokens (prompt order) to rows of its views' flattened tokens
    [views * t*t] (global view first, as pixel_values holds them), -1 for a newline or the separator
    (deepseek_vl2.layout_index). Scores are min-max normalised per image, over all its views together: every
    view's scores are a mean of one softmax over that view's patches, so views are on the same scale.
    """

    def __init__(
        self, vision: nn.Module, views_per_image: list[int], layouts: list[Tensor], *, ratio: int, chunk: int = 1024
    ) -> None:
        if len(views_per_image) != len(layouts):
            raise ValueError(f"{len(views_per_image)} images in views_per_image, {len(layouts)} layouts")
        self.attn: nn.Module = vision.encoder.layers[-1].self_attn
        self.views_per_image = views_per_image
        self.layouts = layouts
        self.ratio = ratio
        self.chunk = chunk
        self._handle: RemovableHandle | None = None
        self._views: Tensor | None = None  # [views, patches] float32: attention received per patch

    def install(self) -> TileSaliency:
        if self._handle is not None:
            raise RuntimeError("TileSaliency is already installed")
        self._handle = self.attn.register_forward_pre_hook(self._on_attn, with_kwargs=True)
        return self

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> TileSaliency:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    @torch.no_grad()
    def _on_attn(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]  # [views, patches, C]
        views, n, _ = hidden.shape
        # Same ops as SiglipAttention.forward (transformers 5.24), stopping before attention.
        q = module.q_proj(hidden).view(views, n, module.num_heads, module.head_dim).transpose(1, 2)
        k = module.k_proj(hidden).view(views, n, module.num_heads, module.head_dim).transpose(1, 2)
        self._views = torch.stack([attention_received(q[v], k[v], chunk=self.chunk) for v in range(views)])

    def patch_scores(self) -> Tensor:
        """[views, patches]: attention received by each patch of every view in the last forward."""
        if self._views is None:
            raise RuntimeError("no vision forward was captured")
        return self._views

    def per_image(self) -> list[Tensor]:
        tokens = pool_to_tokens(self.patch_scores(), self.ratio)  # [views, t*t]
        if sum(self.views_per_image) != tokens.shape[0]:
            raise RuntimeError(f"images have {sum(self.views_per_image)} views, the tower saw {tokens.shape[0]}")
        out: list[Tensor] = []
        for image_tokens, layout in zip(tokens.split(self.views_per_image), self.layouts, strict=True):
            rows = layout[layout >= 0].to(image_tokens.device)
            out.append(normalize01(image_tokens.reshape(-1)[rows]))
        return out
