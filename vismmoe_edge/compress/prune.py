"""Dropping visual tokens mid-prefill: choose the kept set per image, then cut the sequence state consistently.

At the cut (right after the pinned prefix) the sequence state is: hidden states [1, S, H], M-RoPE positions
[3, 1, S], the prefix layers' KV cache [1, kv_heads, S, d] each, and the DeepStack features still to be injected
[V, H] (one row per visual token). Every one of them loses the same rows; positions keep their original values,
so the kept tokens stay where they were in the image and decode continues the uncompressed numbering.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vismmoe_edge.compress.config import METHODS, CompressionConfig  # noqa: F401 - METHODS: re-exported
from vismmoe_edge.compress.select import affinity_keep, random_keep, saliency_keep, zip_keep


@dataclass
class CompressionReport:
    method: str
    visual_tokens: int = 0
    kept_visual_tokens: int = 0
    seconds: float = 0.0  # selection only (saliency is computed inside the vision tower)
    note: str = ""
    kept: list[Tensor] = field(default_factory=list)  # per image: kept indices into its visual tokens
    kept_visual_mask: Tensor | None = None  # [all visual tokens] bool, in prompt order

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "visual_tokens": self.visual_tokens,
            "kept_visual_tokens": self.kept_visual_tokens,
            "seconds": self.seconds,
            "note": self.note,
        }


def select_per_image(
    config: CompressionConfig,
    tokens_per_image: list[int],
    saliency: list[Tensor] | None,
    prefix_experts: list[Tensor] | None,
    visual_hidden: list[Tensor],
) -> tuple[list[Tensor], list[list[Tensor] | None]]:
    """Kept indices (ascending, into each image's visual tokens) and, for zip, the groups merged into each.

    prefix_experts: per image [N, L, k] expert ids from the pinned-prefix layers (None or L == 0: no prefix).
    """
    generator = torch.Generator().manual_seed(config.seed)
    kept: list[Tensor] = []
    groups: list[list[Tensor] | None] = []
    for i, n in enumerate(tokens_per_image):
        merged = None
        if config.method == "random":
            keep = random_keep(n, config.keep_ratio, generator)
        elif config.method == "saliency":
            keep = saliency_keep(saliency[i], config.keep_ratio)
        elif config.method == "zip":
            keep, merged = zip_keep(saliency[i], visual_hidden[i], config.keep_ratio)
        else:
            experts = prefix_experts[i] if prefix_experts is not None else torch.zeros(n, 0, 1, dtype=torch.long)
            keep = affinity_keep(
                saliency[i], experts, config.keep_ratio, config.salient_ratio, config.affinity_weight
            )
        kept.append(keep.cpu())
        groups.append(merged)
    return kept, groups


def keep_mask(visual_mask: Tensor, tokens_per_image: list[int], kept: list[Tensor]) -> Tensor:
    """[S] bool over the whole sequence: every text token, and the kept visual tokens of each image."""
    mask = ~visual_mask.clone()
    positions = visual_mask.nonzero().flatten()
    start = 0
    for n, keep in zip(tokens_per_image, kept, strict=True):
        mask[positions[start + keep.to(positions.device)]] = True
        start += n
    return mask


def merge_groups(
    hidden: Tensor,
    cache_layers: list,
    visual_mask: Tensor,
    tokens_per_image: list[int],
    kept: list[Tensor],
    groups: list[list[Tensor] | None],
) -> None:
    """VisionZip-style merging, in place: each kept token becomes the mean of its group (hidden states and the
    prefix layers' keys and values alike, so later layers and decode see one consistent token)."""
    positions = visual_mask.nonzero().flatten()
    start = 0
    for n, image_kept, image_groups in zip(tokens_per_image, kept, groups, strict=True):
        if image_groups is not None:
            for target_index, group in zip(image_kept.tolist(), image_groups, strict=True):
                if len(group) < 2:
                    continue
                rows = positions[start + group.to(positions.device)]
                target = int(positions[start + target_index])
                hidden[0, target] = hidden[0, rows].mean(dim=0)
                for layer in cache_layers:
                    layer.keys[0, :, target] = layer.keys[0, :, rows].mean(dim=1)
                    layer.values[0, :, target] = layer.values[0, :, rows].mean(dim=1)
        start += n


def cut_sequence(keep: Tensor, hidden: Tensor, positions: Tensor, cache_layers: list) -> tuple[Tensor, Tensor]:
    """Keep the rows `keep` ([S] bool) of the hidden states, positions and every filled cache layer."""
    index = keep.nonzero().flatten()
    for layer in cache_layers:
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)
    return hidden.index_select(1, index), positions.index_select(2, index)
