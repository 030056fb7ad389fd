"""`vismmoe-edge calibrate`: run prompts and images through the engine and record the lookahead predictor's
training data (features and the routing of the following layers, per step and MoE layer) to an .npz file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import fail, load_options, plan_and_load
from vismmoe_edge.cli.options import (
    AffinityWeightOpt,
    BudgetOpt,
    CompressorOpt,
    DeviceOpt,
    KeepRatioOpt,
    ModelOpt,
    PinnedOpt,
    ProfileOpt,
    SalientRatioOpt,
    TierOpt,
)
from vismmoe_edge.errors import VismmoeError


def calibrate_command(
    out: Annotated[Path, typer.Option("--out", help="where to write the calibration data (.npz)")],
    model: ModelOpt = None,
    benchmark: Annotated[str, typer.Option("--benchmark", help="built-in prompts: shapes-vqa")] = "shapes-vqa",
    split: Annotated[str, typer.Option("--split", help="shapes-vqa split (train keeps test and shifted unseen)")] = (
        "train"
    ),
    data: Annotated[Path | None, typer.Option("--data", help="a folder of images with questions.jsonl")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="number of prompts")] = 500,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="decode steps per prompt")] = 8,
    min_new_tokens: Annotated[
        int, typer.Option("--min-new-tokens", min=0, help="decode at least this many steps (stop tokens masked)")
    ] = 0,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 decodes greedily")] = 0.0,
    compressor: CompressorOpt = "none",
    keep_ratio: KeepRatioOpt = 0.7,
    salient_ratio: SalientRatioOpt = 0.3,
    affinity_weight: AffinityWeightOpt = 2.0,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    profile: ProfileOpt = "auto",
    tier: TierOpt = "auto",
    device: DeviceOpt = "auto",
) -> None:
    """Record predictor training data: routing history, pooled hidden states and the visual summary at every
    MoE layer of every step, with the experts the next layers then used. Run it with the compressor you deploy."""
    from tqdm import tqdm

    from vismmoe_edge.compress.config import CompressionConfig
    from vismmoe_edge.evaluation.vqa import load_items
    from vismmoe_edge.predict.routing_features import FeatureRecorder
    from vismmoe_edge.sampling import SamplingConfig

    try:
        compression = CompressionConfig(compressor, keep_ratio, salient_ratio, affinity_weight)
        items = load_items(benchmark, split, data, limit=limit)
        options = load_options(locals(), predictor="none")  # calibration records routing: prefetch only adds I/O
        engine, plan_note = plan_and_load(model, options)
        recorder = FeatureRecorder(engine)
        for n, item in enumerate(tqdm(items, desc="calibrate", unit="prompt")):
            sampling = SamplingConfig(
                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, temperature=temperature, seed=n
            )
            engine.generate_from_inputs(engine.encode(item.question, [item.load()]), sampling)
        path = recorder.save(out)
        samples = len(recorder.samples["layer"])
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    if plan_note:
        typer.echo(plan_note, err=True)
    typer.echo(f"wrote {samples} samples from {len(items)} prompts to {path}")
