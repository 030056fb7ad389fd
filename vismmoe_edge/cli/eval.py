"""`vismmoe-edge eval`: exact-match VQA accuracy per question family through the engine, plus expert traffic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from vismmoe_edge.cli.common import fail, load_options, plan_and_load
from vismmoe_edge.cli.options import (
    AffinityWeightOpt,
    BudgetOpt,
    CompressorOpt,
    DeviceOpt,
    DtypeOpt,
    HostTierOpt,
    KeepRatioOpt,
    ModelOpt,
    PinnedOpt,
    PolicyOpt,
    PredictorOpt,
    PrefetchDepthOpt,
    ProfileOpt,
    SalientRatioOpt,
    TierOpt,
)
from vismmoe_edge.errors import VismmoeError


def eval_command(
    benchmark: Annotated[str | None, typer.Option("--benchmark", help="built-in benchmark: shapes-vqa")] = None,
    split: Annotated[str, typer.Option("--split", help="shapes-vqa split: test, shifted or validation")] = "test",
    data: Annotated[
        Path | None, typer.Option("--data", help="your own data: a folder of images with questions.jsonl")
    ] = None,
    questions: Annotated[
        Path | None, typer.Option("--questions", help="the JSONL file for --data (default: DATA/questions.jsonl)")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, help="evaluate only the first N questions")] = None,
    model: ModelOpt = None,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    profile: ProfileOpt = "auto",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    tier: TierOpt = "auto",
    predictor: PredictorOpt = "auto",
    prefetch_depth: PrefetchDepthOpt = None,
    host_tier: HostTierOpt = "auto",
    policy: PolicyOpt = "popularity",
    compressor: CompressorOpt = "none",
    keep_ratio: KeepRatioOpt = 0.7,
    salient_ratio: SalientRatioOpt = 0.3,
    affinity_weight: AffinityWeightOpt = 2.0,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 8,
    threads: Annotated[
        str,
        typer.Option(
            "--threads",
            help="CPU threads: auto (one per core other processes leave idle), default (torch's) or a number",
        ),
    ] = "auto",
    predictions: Annotated[
        Path | None, typer.Option("--predictions", help="write one JSON line per question as it is answered")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
) -> None:
    """Score a model on Shapes-VQA or on your own images + JSONL: exact-match accuracy per family, routing
    concentration and expert traffic, with the same memory options as `run`."""
    from vismmoe_edge.compress.config import CompressionConfig
    from vismmoe_edge.evaluation.vqa import choose_threads, evaluate, format_report, load_items

    try:
        compression = CompressionConfig(compressor, keep_ratio, salient_ratio, affinity_weight)
        if (benchmark is None) == (data is None):
            raise VismmoeError("pass exactly one of --benchmark shapes-vqa or --data FOLDER")
        if questions is not None and data is None:
            raise VismmoeError("--questions goes with --data FOLDER")
        items = load_items(benchmark, split, data, questions, limit)
        title = str(data) if data is not None else f"shapes-vqa {split}"
        thread_count = choose_threads(threads, device)
        if thread_count is not None:
            import torch

            torch.set_num_threads(thread_count)
        options = load_options(locals())
        engine, plan_note = plan_and_load(model, options)
        sink = predictions.open("w") if predictions is not None else None
        try:

            def write(record: dict[str, Any]) -> None:
                if sink is not None:
                    sink.write(json.dumps(record) + "\n")
                    sink.flush()  # a run stopped half-way keeps every answer so far

            report = evaluate(engine, items, max_new_tokens=max_new_tokens, on_prediction=write, progress=not as_json)
            if thread_count is None and engine.device.type == "cpu":
                import torch

                thread_count = torch.get_num_threads()
            report.threads = thread_count
        finally:
            if sink is not None:
                sink.close()
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    if as_json:
        typer.echo(json.dumps({"benchmark": title, "model": str(engine.model_dir), **report.as_dict()}))
        return
    if plan_note:
        typer.echo(plan_note, err=True)
    for line in format_report(report, title):
        typer.echo(line)
