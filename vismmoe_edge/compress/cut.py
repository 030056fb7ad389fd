"""The visual-token cut in the middle of prefill: choose each image's kept tokens and cut every piece of
sequence state (hidden states, positions, the prefix KV cache, DeepStack features still to come) by the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import torch
from transformers import DynamicCache

from vismmoe_edge.compress.prune import (
    CompressionConfig,
    CompressionReport,
    cut_sequence,
    keep_mask,
    merge_groups,
    select_per_image,
)


class SaliencyCapture(Protocol):
    """Installed around the vision forward (a context manager); then one score per droppable visual token. Each
    model family's prefill ops make one (models/ops.py)."""

    def __enter__(self) -> SaliencyCapture: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def per_image(self) -> list[torch.Tensor]:
        """Per image, in [0, 1], over the tokens `droppable_tokens` lists (same order)."""
        ...


@dataclass
class CutResult:
    hidden: torch.Tensor
    positions: torch.Tensor
    visual_mask: torch.Tensor
    deepstack: list[torch.Tensor]
    report: CompressionReport


def _with_fixed_tokens(chosen: torch.Tensor, droppable: torch.Tensor, n: int) -> torch.Tensor:
    """The chosen tokens plus every token that may not be dropped, ascending, as indices into n visual tokens."""
    fixed = torch.ones(n, dtype=torch.bool)
    fixed[droppable] = False
    if not bool(fixed.any()):
        return chosen
    return torch.cat([chosen, fixed.nonzero().flatten()]).sort().values


def cut_visual_tokens(
    config: CompressionConfig,
    tokens_per_image: list[int],
    droppable: list[torch.Tensor],
    hidden: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    visual_mask: torch.Tensor,
    deepstack: list[torch.Tensor],
    saliency: SaliencyCapture | None,
    prefix_routes: dict[int, torch.Tensor],
    prefix_layers: list[int],
    cut_at: int,
) -> CutResult:
    """Choose each image's kept visual tokens and cut hidden states, positions, the prefix KV cache and the
    DeepStack features still to come, all by the same rows. Selection runs over each image's `droppable` tokens
    only (per image, ascending indices into its `tokens_per_image` visual tokens; the family's ops say which).

    `prefix_routes`: the pinned prefix layers' routed expert ids [S, k] by layer (what affinity keeps by)."""
    report = CompressionReport(method=config.method, visual_tokens=sum(tokens_per_image))
    seq_mask = visual_mask[0]
    visual_rows = seq_mask.nonzero().flatten()
    starts = [sum(tokens_per_image[:i]) for i in range(len(tokens_per_image))]
    candidates = [start + rows for start, rows in zip(starts, droppable, strict=True)]  # into all visual tokens
    counts = [len(rows) for rows in droppable]
    scores = [s.cpu() for s in saliency.per_image()] if saliency is not None else None
    if scores is not None and [len(s) for s in scores] != counts:
        raise RuntimeError(f"saliency covers {[len(s) for s in scores]} tokens per image, not {counts}")
    prefix_experts = None
    if config.method == "affinity":
        if not prefix_layers:
            report.note = "no pinned prefix: affinity has no prefix routing to use, so it keeps by saliency only"
        else:
            routed = torch.stack([prefix_routes[layer][visual_rows] for layer in prefix_layers], dim=1)  # [V, L, k]
            prefix_experts = [routed[rows.to(routed.device)].cpu() for rows in candidates]
    visual_hidden = [hidden[0, visual_rows[rows.to(visual_rows.device)]] for rows in candidates]
    chosen, groups = select_per_image(config, counts, scores, prefix_experts, visual_hidden)
    # Back from positions among the droppable tokens to indices into each image's visual tokens.
    chosen = [rows[c] for rows, c in zip(droppable, chosen, strict=True)]
    groups = [None if g is None else [rows[x] for x in g] for rows, g in zip(droppable, groups, strict=True)]
    filled = list(cache.layers[:cut_at])
    if any(g is not None for g in groups):
        merge_groups(hidden, filled, seq_mask, tokens_per_image, chosen, groups)
    kept = [_with_fixed_tokens(c, rows, n) for c, rows, n in zip(chosen, droppable, tokens_per_image, strict=True)]
    keep = keep_mask(seq_mask, tokens_per_image, kept)
    # DeepStack rows are in visual-token order: keep those of kept visual tokens, for layers still to come.
    kept_visual = keep[visual_rows]
    deepstack = [d if j < cut_at else d[kept_visual] for j, d in enumerate(deepstack)]
    hidden, positions = cut_sequence(keep, hidden, positions, filled)
    report.kept = kept
    report.kept_visual_mask = kept_visual
    report.kept_visual_tokens = int(kept_visual.sum())
    return CutResult(hidden, positions, visual_mask[:, keep], deepstack, report)
