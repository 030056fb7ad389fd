"""Visual-token saliency: how much attention each token receives in the vision tower's last block.

Qwen3-VL's vision tower lays out each frame's patches block-major: patch index = ((gh * W/m + gw) * m + mh) * m + mw
for a grid of H x W patches and merge size m (the image processor's `patchify` transposes to (gh, gw, mh, mw), and
`get_vision_position_ids` / the patch merger assume the same). So every m*m consecutive patches form one LLM token,
and LLM tokens come in raster order of the (H/m, W/m) grid, frame after frame. GLM-4.5V's tower does the same (its
processor's patchify, `get_vision_position_ids`, and a downsample over view(-1, m, m, C)); tests check both.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from types import TracebackType

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


def attention_received(q: Tensor, k: Tensor, *, chunk: int = 1024) -> Tensor:
    """Mean over heads and queries of softmax(q k^T / sqrt(d)) along keys: [heads, N, d] x2 -> [N] (float32).

    Queries are processed `chunk` at a time, so at most one [heads, chunk, N] buffer exists.
    """
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [heads, N, d], got {tuple(q.shape)} and {tuple(k.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    heads, n, d = q.shape
    total = torch.zeros(n, dtype=torch.float32, device=q.device)
    if n == 0:
        return total
    kt = k.float().transpose(1, 2)  # [heads, d, N]
    scale = d**-0.5
    for start in range(0, n, chunk):
        logits = torch.matmul(q[:, start : start + chunk].float(), kt)  # [heads, c, N]
        logits.mul_(scale)
        # Softmax in place: exp(x - max), then weight each row by 1/rowsum inside the reduction below,
        # so no second [heads, c, N] buffer is allocated.
        logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        inv_rowsum = logits.sum(dim=-1).reciprocal_()  # [heads, c]
        total += torch.einsum("hc,hcn->n", inv_rowsum, logits)
    return total / (heads * n)


def merge_to_llm_tokens(patch_scores: Tensor, grid_thw: tuple[int, int, int], merge: int = 2) -> Tensor:
    """Mean of each group of merge*merge consecutive patches (one LLM token): [t*h*w] -> [t*h*w // merge**2]."""
    t, h, w = (int(x) for x in grid_thw)
    if h % merge or w % merge:
        raise ValueError(f"grid {t}x{h}x{w} is not divisible by merge size {merge}")
    if patch_scores.shape != (t * h * w,):
        raise ValueError(f"expected {t * h * w} patch scores for grid {t}x{h}x{w}, got {tuple(patch_scores.shape)}")
    return patch_scores.reshape(-1, merge * merge).mean(dim=1)


def normalize01(x: Tensor) -> Tensor:
    """Min-max scale to [0, 1]; a constant (or empty) input gives all zeros."""
    x = x.float()
    if x.numel() == 0:
        return x.clone()
    lo, hi = x.min(), x.max()
    span = hi - lo
    if span <= 0:
        return torch.zeros_like(x)
    return (x - lo) / span


RotaryFn = Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


class VisionSaliency:
    """Capture per-image token saliency from a Qwen3-VL(-MoE) or GLM-4.5V vision tower's last attention block.

        with VisionSaliency(model.model.visual, rotary=apply_rotary_pos_emb_vision) as sal:
            visual(pixel_values, grid_thw=grid)
        scores = sal.per_image()  # one [t*h*w // merge**2] tensor in [0, 1] per image

    A pre-hook on `blocks[-1].attn` recomputes q and k from the block's own inputs (qkv linear, head split,
    the rotary embedding it is given) and scores each attention segment (`cu_seqlens`, one per frame) while the
    forward runs; the forward itself is untouched. Each forward of the tower replaces the previous capture.
    Both towers' attention blocks share that code (qkv, num_heads, cu_seqlens, (cos, sin)); `rotary` is the
    family's own apply_rotary_pos_emb_vision (the family module passes it).
    """

    def __init__(self, visual: nn.Module, *, rotary: RotaryFn, chunk: int = 1024) -> None:
        self.visual = visual
        self.rotary = rotary
        self.attn: nn.Module = visual.blocks[-1].attn
        self.merge = int(visual.spatial_merge_size)
        self.chunk = chunk
        self._handles: list[RemovableHandle] = []
        self._grid_thw: Tensor | None = None
        self._segments: list[Tensor] | None = None  # per attention segment, patch scores (float32)

    # -- installation ---------------------------------------------------------------------------------

    def install(self) -> VisionSaliency:
        if self._handles:
            raise RuntimeError("VisionSaliency is already installed")
        self._handles = [
            self.visual.register_forward_pre_hook(self._on_visual, with_kwargs=True),
            self.attn.register_forward_pre_hook(self._on_attn, with_kwargs=True),
        ]
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> VisionSaliency:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    # -- hooks ----------------------------------------------------------------------------------------

    def _on_visual(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        if grid is None:
            raise ValueError("VisionSaliency needs grid_thw passed to the vision tower")
        self._grid_thw = grid.detach().to("cpu", torch.int64).reshape(-1, 3)
        self._segments = None

    @torch.no_grad()
    def _on_attn(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        cu_seqlens = kwargs["cu_seqlens"] if "cu_seqlens" in kwargs else args[1]
        pos = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[2]
        n = hidden.shape[0]
        # Same ops as Qwen3VLMoeVisionAttention / Glm4vMoeVisionAttention.forward (transformers 5.24), stopping
        # before attention.
        q, k, _ = module.qkv(hidden).reshape(n, 3, module.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = pos
        q, k = self.rotary(q, k, cos, sin)  # [N, heads, d], back in the model's dtype
        q, k = q.transpose(0, 1), k.transpose(0, 1)  # [heads, N, d]
        self._segments = [
            attention_received(q[:, s:e], k[:, s:e], chunk=self.chunk) for s, e in pairwise(cu_seqlens.tolist())
        ]

    # -- results --------------------------------------------------------------------------------------

    def per_image(self) -> list[Tensor]:
        """Saliency over each image's LLM tokens (float32, on the model's device), min-max normalised per image."""
        if self._segments is None or self._grid_thw is None:
            raise RuntimeError("no vision forward was captured")
        out: list[Tensor] = []
        seg = 0
        for t, h, w in self._grid_thw.tolist():
            # transformers gives each frame its own attention segment (get_vision_cu_seqlens).
            frames = self._segments[seg : seg + t]
            seg += t
            patches = torch.cat(frames) if frames else torch.zeros(0)
            out.append(normalize01(merge_to_llm_tokens(patches, (t, h, w), self.merge)))
        if seg != len(self._segments):
            raise RuntimeError(f"grid_thw describes {seg} attention segments, cu_seqlens has {len(self._segments)}")
        return out
