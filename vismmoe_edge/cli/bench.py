"""`vismmoe-edge bench`: time one configuration on this machine: prefill, decode tokens/s, expert traffic."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import fail, load_options
from vismmoe_edge.cli.options import (
    BudgetOpt,
    DeviceOpt,
    HostTierOpt,
    ImageOpt,
    ModelOpt,
    PinnedOpt,
    PolicyOpt,
    PredictorOpt,
    PrefetchDepthOpt,
    ProfileOpt,
    TierOpt,
)
from vismmoe_edge.errors import VismmoeError


def bench_command(
    model: ModelOpt = None,
    image: ImageOpt = None,
    prompt: Annotated[str, typer.Option(help="the prompt")] = "Describe the picture in detail.",
    tokens: Annotated[int, typer.Option("--tokens", min=2, help="decode tokens per trial")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="trials (different seeds or trace stretches)")] = 3,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    profile: ProfileOpt = "auto",
    tier: TierOpt = "auto",
    predictor: PredictorOpt = "auto",
    prefetch_depth: PrefetchDepthOpt = None,
    host_tier: HostTierOpt = "auto",
    policy: PolicyOpt = "popularity",
    device: DeviceOpt = "auto",
    replay_trace: Annotated[
        Path | None, typer.Option("--replay-trace", help="route from this trace instead of sampling")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON summary")] = False,
) -> None:
    """Time prefill and decode of one configuration; medians over several trials, with the oracle's bytes."""
    from vismmoe_edge.evaluation.bench import run_trials
    from vismmoe_edge.options import load_engine

    try:
        images = list(image or [])
        if model is None and not images:
            from vismmoe_edge.evaluation.sample import ensure_sample_image

            images = [ensure_sample_image()]
        options = load_options(locals())
        engine, resolved = load_engine(model, options)
        trials = run_trials(engine, prompt=prompt, images=images, tokens=tokens, repeats=repeats, replay=replay_trace)
    except VismmoeError as e:
        raise fail(str(e)) from None
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": str(engine.model_dir),
        "device": str(engine.device),
        "options": {
            "memory_budget": resolved.memory_budget_bytes,
            "pinned_layers": resolved.pinned_layers,
            "tier": resolved.tier,
            "prefetch_depth": resolved.prefetch_depth,
            "predictor": predictor,
            "policy": policy,
            "tokens": tokens,
            "repeats": repeats,
            "routing": f"replay {replay_trace}" if replay_trace else "sampled (temperature 1)",
        },
        "slots": engine.experts.pipeline.capacity,
        "median": {key: statistics.median(t[key] for t in trials) for key in trials[0]},
        "trials": trials,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=1))
        return
    m = summary["median"]
    per_trial = ", ".join(f"{t['decode_tokens_per_s']:.2f}" for t in trials)
    typer.echo(
        f"{summary['options']['routing']}, {repeats} trials of {tokens} tokens, {summary['slots']} slots\n"
        f"prefill {m['prefill_s']:.3f} s | decode {m['decode_tokens_per_s']:.2f} tok/s "
        f"(trials: {per_trial})\n"
        f"read {m['decode_bytes_per_token'] / 1e6:.1f} MB/token, oracle {m['oracle_bytes_per_token'] / 1e6:.1f} "
        f"MB/token | hit rate {m['hit_rate']:.1%} | stall {m['stall_s']:.3f} s | wasted prefetch "
        f"{m['wasted_speculative_bytes'] / 1e6:.1f} MB"
    )
