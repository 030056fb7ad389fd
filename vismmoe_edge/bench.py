"""`vismmoe-edge bench`: time one configuration on this machine: prefill, decode tokens/s, expert traffic.

Decode is sampled (temperature 1) or replays routing from a trace, never greedy: greedy decoding on random
weights repeats one token and makes any cache look perfect. Each trial reports the bytes Belady's optimal
eviction would have moved for the same routing at the same slot count, the bound every policy is judged by.
The comparisons under a memory cgroup and against other engines live in tools/bench_unified.py and
tools/bench_discrete.py.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from vismmoe_edge.errors import VismmoeError


def run_trials(
    engine: Any, *, prompt: str, images: list[Path], tokens: int, repeats: int, replay: Path | None
) -> list[dict[str, float]]:
    import torch

    from vismmoe_edge.experts.oracle import belady_after_warmup
    from vismmoe_edge.sampling import SamplingConfig

    routes: list[list[int]] = []
    engine.experts.route_hooks.append(
        lambda layer, hidden, index, weights: routes.append([layer * 100_000 + int(e) for e in index.unique()])
    )
    trials = []
    for seed in range(repeats):
        if replay is not None:
            engine.replay_routing(replay, start_token=2000 * seed)
        pipeline = engine.experts.pipeline
        pipeline.reset_stats()
        routes.clear()
        inputs = engine.encode(prompt, images)
        sampling = SamplingConfig(max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, temperature=1.0, seed=seed)
        times = []
        start = time.perf_counter()
        for _ in engine.stream(inputs, sampling):
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter())
        steps = [b - a for a, b in zip(times, times[1:], strict=False)]
        layers = len(engine.catalogue.moe_layers)
        prefill_keys = [k for step in routes[:layers] for k in step]
        decode_keys = [k for step in routes[layers:] for k in step]
        oracle_misses = belady_after_warmup(prefill_keys, decode_keys, pipeline.capacity)
        decode_log = pipeline.layer_log[layers:]
        stats = pipeline.stats
        trials.append(
            {
                "prefill_s": times[0] - start,
                "decode_tokens_per_s": 1 / statistics.median(steps),
                "decode_bytes_per_token": sum(x.bytes_read for x in decode_log) / tokens,
                "oracle_bytes_per_token": oracle_misses * engine.catalogue.expert_bytes / tokens,
                "hit_rate": stats.hit_rate,
                "stall_s": stats.stall_s,
                "wasted_speculative_bytes": stats.wasted_speculative_bytes,
                "peak_resident_bytes": stats.peak_resident_bytes,
            }
        )
    return trials


def bench_command(
    model: Annotated[Path | None, typer.Option("--model", help="model directory; omitted: the demo model")] = None,
    image: Annotated[list[Path] | None, typer.Option("--image", help="image file; repeat for several")] = None,
    prompt: Annotated[str, typer.Option(help="the prompt")] = "Describe the picture in detail.",
    tokens: Annotated[int, typer.Option("--tokens", min=2, help="decode tokens per trial")] = 32,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="trials (different seeds or trace stretches)")] = 3,
    memory_budget: Annotated[str, typer.Option("--memory-budget")] = "100%",
    pinned_layers: Annotated[int, typer.Option("--pinned-layers", min=0)] = 0,
    tier: Annotated[str, typer.Option("--tier")] = "auto",
    predictor: Annotated[str, typer.Option("--predictor")] = "none",
    policy: Annotated[str, typer.Option("--policy")] = "lru",
    device: Annotated[str, typer.Option("--device")] = "auto",
    replay_trace: Annotated[
        Path | None, typer.Option("--replay-trace", help="route from this trace instead of sampling")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON summary")] = False,
) -> None:
    """Time prefill and decode of one configuration; medians over several trials, with the oracle's bytes."""
    from vismmoe_edge.loader import load

    try:
        images = list(image or [])
        if model is None and not images:
            from vismmoe_edge.demo import ensure_sample_image

            images = [ensure_sample_image()]
        engine = load(
            model,
            memory_budget=memory_budget,
            pinned_layers=pinned_layers,
            tier=tier,
            predictor=predictor,
            policy=policy,
            device=device,
        )
        trials = run_trials(engine, prompt=prompt, images=images, tokens=tokens, repeats=repeats, replay=replay_trace)
    except VismmoeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": str(engine.model_dir),
        "device": str(engine.device),
        "options": {
            "memory_budget": memory_budget,
            "pinned_layers": pinned_layers,
            "tier": tier,
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
