"""`vismmoe-edge profile`: a workload's per-token latency, hit rate and power/memory telemetry (jtop on Jetson)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import fail, load_options
from vismmoe_edge.cli.options import (
    BudgetOpt,
    DeviceOpt,
    DtypeOpt,
    HostTierOpt,
    ModelOpt,
    PinnedOpt,
    PolicyOpt,
    PredictorOpt,
    PrefetchDepthOpt,
    ProfileOpt,
    TierOpt,
)
from vismmoe_edge.errors import VismmoeError


def profile_command(
    model: ModelOpt = None,
    prompts: Annotated[
        Path | None,
        typer.Option("--prompts", help='JSONL workload: {"prompt": ..., "images": [...]} per line (default: 3 demo)'),
    ] = None,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    profile: ProfileOpt = "auto",
    tier: TierOpt = "auto",
    predictor: PredictorOpt = "auto",
    prefetch_depth: PrefetchDepthOpt = None,
    host_tier: HostTierOpt = "auto",
    policy: PolicyOpt = "popularity",
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="tokens per request")] = 32,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="always generate --max-new-tokens (comparable runs)")
    ] = False,
    interval: Annotated[float, typer.Option("--interval", min=0.05, help="seconds between telemetry samples")] = 0.5,
    out: Annotated[Path | None, typer.Option("--out", help="output directory (default: ./profile-<time>)")] = None,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="skip the PNG plots")] = False,
) -> None:
    """Profile a workload: per-token latency, expert hit rate, power/memory telemetry (jtop on Jetson); CSV+PNG."""
    from vismmoe_edge.evaluation.profiling import format_summary, run_profile

    out = out or Path(f"profile-{datetime.now():%Y%m%d-%H%M%S}")
    if model is None:
        typer.echo("note: no --model given: profiling the built-in demo model (trained on Shapes-VQA).", err=True)
    try:
        options = load_options(locals())
        summary = run_profile(
            out,
            model=model,
            options=options,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            ignore_eos=ignore_eos,
            interval=interval,
            plots=not no_plots,
        )
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None
    typer.echo(format_summary(summary, out))
