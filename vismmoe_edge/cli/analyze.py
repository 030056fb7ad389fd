"""`vismmoe-edge analyze`: what each visual-token compressor does to expert demand, layer by layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import fail, load_options
from vismmoe_edge.cli.options import (
    AffinityWeightOpt,
    BudgetOpt,
    DeviceOpt,
    KeepRatioOpt,
    ModelOpt,
    PinnedOpt,
    ProfileOpt,
    SalientRatioOpt,
    TierOpt,
)
from vismmoe_edge.errors import VismmoeError

COMPRESSORS = "none,random,saliency,zip,affinity"  # compress.prune.METHODS, without importing torch for --help


def analyze_command(
    benchmark: Annotated[str, typer.Option("--benchmark", help="built-in prompts: shapes-vqa")] = "shapes-vqa",
    split: Annotated[str, typer.Option("--split", help="shapes-vqa split: test, shifted or validation")] = "test",
    data: Annotated[Path | None, typer.Option("--data", help="a folder of images with questions.jsonl")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="number of prompts")] = 20,
    compressors: Annotated[
        str, typer.Option("--compressors", help="comma-separated: none,random,saliency,zip,affinity")
    ] = COMPRESSORS,
    keep_ratio: KeepRatioOpt = 0.7,
    salient_ratio: SalientRatioOpt = 0.3,
    affinity_weight: AffinityWeightOpt = 2.0,
    model: ModelOpt = None,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    profile: ProfileOpt = "auto",
    tier: TierOpt = "auto",
    device: DeviceOpt = "auto",
    out: Annotated[Path, typer.Option("--out", help="folder for analysis.json and the heatmaps")] = Path("analysis"),
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="write the heatmap PNGs")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print the JSON summary instead of the table")] = False,
) -> None:
    """Per layer and per compressor: unique experts, concentration, next-layer predictability, on-demand loads
    under the memory budget; heatmaps of expert use for text, visual and kept visual tokens."""
    from vismmoe_edge.checkpoint_info import inspect_checkpoint
    from vismmoe_edge.compress.config import METHODS, CompressionConfig
    from vismmoe_edge.evaluation.analyze import analyze_compressor, format_table, plot_heatmaps
    from vismmoe_edge.evaluation.vqa import load_items
    from vismmoe_edge.options import load_resolved, resolve

    try:
        methods = [m.strip() for m in compressors.split(",") if m.strip()]
        if not methods:
            raise VismmoeError(f"--compressors: name at least one of {', '.join(METHODS)}")
        configs = [CompressionConfig(m, keep_ratio, salient_ratio, affinity_weight) for m in methods]
        items = load_items(benchmark, split, data, limit=limit)
        checkpoint = inspect_checkpoint(model)
        options = load_options(locals(), predictor="none")  # the demand compressors cause, not a predictor's
        resolved = resolve(options, checkpoint)
        memory_budget, pinned_layers, tier, plan_note = (
            resolved.memory_budget_bytes, resolved.pinned_layers, resolved.tier, resolved.note
        )  # fmt: skip
        results = []
        for config in configs:  # a fresh engine each: every compressor starts from the same cold cache
            engine = load_resolved(checkpoint, options, resolved)
            results.append(analyze_compressor(engine, items, config, progress=not as_json))
            engine.experts.pipeline.close()
        out.mkdir(parents=True, exist_ok=True)
        summaries = [r.summary() for r in results]
        cut = pinned_layers
        record = {
            "model": str(engine.model_dir),
            "prompts": len(items),
            "keep_ratio": keep_ratio,
            "salient_ratio": salient_ratio,
            "affinity_weight": affinity_weight,
            "pinned_layers": pinned_layers,
            "memory_budget_bytes": memory_budget,
            "tier": tier,
            "compressors": summaries,
        }
        (out / "analysis.json").write_text(json.dumps(record, indent=1) + "\n")
        table = format_table(summaries, cut)
        (out / "analysis.md").write_text("\n".join(table) + "\n")
        pngs = plot_heatmaps(results, out, pinned_layers) if plots else []
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    if as_json:
        typer.echo(json.dumps(record))
        return
    if plan_note:
        typer.echo(plan_note, err=True)
    typer.echo(
        f"{len(items)} prompts, keep ratio {keep_ratio}, {pinned_layers} pinned layers "
        "(means over the layers after them):"
    )
    for line in table:
        typer.echo(line)
    typer.echo(f"wrote {out / 'analysis.json'}" + (f" and {len(pngs)} heatmaps" if pngs else ""))
