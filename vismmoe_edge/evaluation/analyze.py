"""What `vismmoe-edge analyze` measures: what each visual-token compressor does to expert demand, layer by layer.

For the same questions and images, each compressor gets a freshly loaded engine (a cold cache) and runs every
prompt's prefill. Per MoE layer it reports: unique experts used per request, the share of activations taken by
the top 25% of experts (concentration), how well one layer's routing predicts the next (normalised mutual
information of the tokens' top-1 experts in consecutive layers: 1 = the next layer's expert is a function of
this one's, 0 = independent), on-demand expert loads and bytes read under the memory budget; and heatmaps of
expert use (layers x experts) for text tokens, all visual tokens and the kept visual tokens.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vismmoe_edge.compress.prune import CompressionConfig, keep_mask
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.evaluation.routing_stats import top_share
from vismmoe_edge.evaluation.vqa import VQAItem

CATEGORIES = ("text", "visual", "kept_visual")


def normalized_mutual_information(a: torch.Tensor, b: torch.Tensor) -> float:
    """NMI (arithmetic-mean normalisation) of two label vectors of equal length."""
    if len(a) == 0:
        return 0.0
    pairs = torch.stack([a, b], dim=1)
    _, joint = torch.unique(pairs, dim=0, return_counts=True)
    _, ca = torch.unique(a, return_counts=True)
    _, cb = torch.unique(b, return_counts=True)
    n = float(len(a))

    def entropy(counts: torch.Tensor) -> float:
        p = counts.double() / n
        return float(-(p * p.log()).sum())

    ha, hb, hab = entropy(ca), entropy(cb), entropy(joint)
    if ha + hb == 0:
        return 1.0
    return max(0.0, (ha + hb - hab) / ((ha + hb) / 2))


@dataclass
class CompressorStats:
    """Everything measured for one compressor over all prompts."""

    method: str
    num_layers: int
    num_experts: int
    counts: dict[str, torch.Tensor] = field(default_factory=dict)  # category -> [layers, experts]
    unique: list[list[int]] = field(default_factory=list)  # per request, per layer: unique experts (all tokens)
    unique_visual: list[list[int]] = field(default_factory=list)  # same, visual tokens only
    nmi: list[list[float]] = field(default_factory=list)  # per request, per consecutive layer pair
    misses: list[int] = field(default_factory=list)  # per layer, summed
    bytes_read: list[int] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    compress_ms: list[float] = field(default_factory=list)
    visual_tokens: list[int] = field(default_factory=list)
    kept_visual_tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = {c: torch.zeros(self.num_layers, self.num_experts, dtype=torch.long) for c in CATEGORIES}
        self.misses = [0] * self.num_layers
        self.bytes_read = [0] * self.num_layers

    def summary(self) -> dict[str, Any]:
        def mean_rows(rows: list[list[float]]) -> list[float]:
            return [round(statistics.fmean(col), 4) for col in zip(*rows, strict=True)] if rows else []

        all_counts = sum(self.counts[c] for c in ("text", "visual"))
        return {
            "method": self.method,
            "unique_experts_per_layer": mean_rows(self.unique),
            "unique_visual_experts_per_layer": mean_rows(self.unique_visual),
            "top25_share_per_layer": [round(float(s), 4) for s in top_share(all_counts)],
            "visual_top25_share_per_layer": [round(float(s), 4) for s in top_share(self.counts["visual"])],
            "next_layer_nmi_per_layer": mean_rows(self.nmi),
            "misses_per_layer": self.misses,
            "bytes_read_per_layer": self.bytes_read,
            "bytes_read": sum(self.bytes_read),
            "prefill_ms_median": round(statistics.median(self.prefill_ms), 2) if self.prefill_ms else 0.0,
            "compress_ms_median": round(statistics.median(self.compress_ms), 3) if self.compress_ms else 0.0,
            "visual_tokens_mean": statistics.fmean(self.visual_tokens) if self.visual_tokens else 0.0,
            "kept_visual_tokens_mean": statistics.fmean(self.kept_visual_tokens) if self.kept_visual_tokens else 0.0,
        }


def analyze_compressor(engine: Any, items: list[VQAItem], config: CompressionConfig, progress: bool) -> CompressorStats:
    """Prefill every prompt once with `config`, recording each MoE layer's routing and the pipeline's loads."""
    from tqdm import tqdm

    layers = engine.catalogue.moe_layers
    row_of = {layer: i for i, layer in enumerate(layers)}
    stats = CompressorStats(config.method, len(layers), engine.catalogue.num_experts)
    routes: dict[int, torch.Tensor] = {}

    def record(layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        routes[layer] = index.detach().cpu()

    engine.compression = config
    engine.experts.route_hooks.append(record)
    image_token = engine.model.config.image_token_id
    try:
        for item in tqdm(items, desc=f"analyze {config.method}", unit="prompt", disable=not progress):
            inputs = engine.encode(item.question, [item.load()])
            routes.clear()
            engine.experts.pipeline.reset_stats()
            start = time.perf_counter()
            engine.prefill(inputs)
            stats.prefill_ms.append((time.perf_counter() - start) * 1000)
            visual = (inputs.input_ids[0] == image_token).cpu()
            report = engine.last_compression
            per_image = engine.ops.visual_token_counts(engine.model, inputs.image_grid_thw)
            if report is not None and report.kept:
                kept_full = keep_mask(visual, per_image, report.kept)
                stats.compress_ms.append(report.seconds * 1000)
            else:
                kept_full = torch.ones_like(visual)
            stats.visual_tokens.append(int(visual.sum()))
            stats.kept_visual_tokens.append(int((visual & kept_full).sum()))
            _add_request(stats, routes, layers, row_of, visual, kept_full)
            for entry in engine.experts.pipeline.layer_log:
                stats.misses[row_of[entry.layer]] += entry.misses
                stats.bytes_read[row_of[entry.layer]] += entry.bytes_read
    finally:
        engine.experts.route_hooks.remove(record)
    return stats


def _add_request(
    stats: CompressorStats,
    routes: dict[int, torch.Tensor],
    layers: list[int],
    row_of: dict[int, int],
    visual: torch.Tensor,
    kept_full: torch.Tensor,
) -> None:
    """Attribute one prefill's routing rows to token categories; a layer after the cut saw only kept tokens."""
    unique, unique_visual, top1 = [], [], []
    for layer in layers:
        index = routes[layer]
        full = index.shape[0] == visual.shape[0]
        is_visual = visual if full else visual[kept_full]
        is_kept = (visual & kept_full) if full else is_visual
        row = row_of[layer]
        for name, rows in (("text", ~is_visual), ("visual", is_visual), ("kept_visual", is_kept)):
            stats.counts[name][row] += torch.bincount(index[rows].flatten(), minlength=stats.num_experts)
        unique.append(int(index.unique().numel()))
        unique_visual.append(int(index[is_visual].unique().numel()))
        # top-1 expert of every kept token (rows aligned across the cut)
        top1.append(index[kept_full, 0] if full else index[:, 0])
    stats.unique.append(unique)
    stats.unique_visual.append(unique_visual)
    stats.nmi.append([normalized_mutual_information(a, b) for a, b in zip(top1, top1[1:], strict=False)])


def plot_heatmaps(results: list[CompressorStats], out_dir: Path, pinned_layers: int) -> list[Path]:
    """One PNG per compressor: expert-use shares per layer for text, all visual and kept visual tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise VismmoeError("heatmaps need matplotlib: pip install matplotlib (or pass --no-plots)") from e
    raw = next((r for r in results if r.method == "none"), results[0]).counts["visual"]
    paths = []
    for r in results:
        panels = (
            ("text tokens", r.counts["text"]),
            ("all visual tokens", raw),
            ("kept visual tokens", r.counts["kept_visual"]),
        )
        fig, axes = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
        for ax, (title, counts) in zip(axes, panels, strict=True):
            shares = counts.double() / counts.sum(dim=1, keepdim=True).clamp(min=1)
            im = ax.imshow(shares.numpy(), aspect="auto", cmap="magma", interpolation="nearest")
            ax.set_title(title)
            ax.set_xlabel("expert")
            if pinned_layers:
                ax.axhline(pinned_layers - 0.5, color="cyan", linewidth=1)
        axes[0].set_ylabel("MoE layer (line: end of the pinned prefix)")
        fig.colorbar(im, ax=axes, shrink=0.8, label="share of the layer's activations")
        fig.suptitle(f"expert use, compressor {r.method}")
        path = out_dir / f"heatmap-{r.method}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def format_table(summaries: list[dict[str, Any]], cut: int) -> list[str]:
    """One markdown row per compressor: means over the layers after the cut (where compression acts)."""
    from vismmoe_edge.units import format_bytes

    def after(values: list[float]) -> float:
        tail = values[cut:] or values
        return statistics.fmean(tail) if tail else math.nan

    lines = [
        "| compressor | visual tokens kept | unique experts/layer | visual unique/layer | top-25% share | "
        "next-layer NMI | on-demand loads | bytes read | prefill ms (median) | compressor ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(
            f"| {s['method']} | {s['kept_visual_tokens_mean']:.0f} / {s['visual_tokens_mean']:.0f} | "
            f"{after(s['unique_experts_per_layer']):.1f} | {after(s['unique_visual_experts_per_layer']):.1f} | "
            f"{after(s['top25_share_per_layer']):.1%} | {after(s['next_layer_nmi_per_layer']):.3f} | "
            f"{sum(s['misses_per_layer'])} | {format_bytes(s['bytes_read'])} | {s['prefill_ms_median']:.0f} | "
            f"{s['compress_ms_median']:.2f} |"
        )
    return lines


