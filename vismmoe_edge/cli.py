"""The `vismmoe-edge` command: thin Typer shells over the Python API."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from vismmoe_edge.cli_options import (
    AffinityWeightOpt,
    BudgetOpt,
    CompressorOpt,
    KeepRatioOpt,
    ModelOpt,
    PolicyOpt,
    PredictorOpt,
    ProfileOpt,
    RunBudgetOpt,
    RunPinnedOpt,
    SalientRatioOpt,
    TierOpt,
)
from vismmoe_edge.errors import VismmoeError

if TYPE_CHECKING:
    from vismmoe_edge.compress.prune import CompressionConfig
    from vismmoe_edge.engine import Engine

app = typer.Typer(
    help="Run vision-language MoE models larger than memory (Jetson Orin, desktop GPUs, CPU).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)



def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@app.command()
def run(
    prompt: Annotated[str, typer.Option("--prompt", help="the question or instruction")],
    model: ModelOpt = None,
    image: Annotated[list[Path] | None, typer.Option("--image", help="image file; repeat for several")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 64,
    memory_budget: RunBudgetOpt = "auto",
    pinned_layers: RunPinnedOpt = None,
    profile: ProfileOpt = "auto",
    temperature: Annotated[float, typer.Option(min=0.0, help="0 decodes greedily")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 1.0,
    seed: Annotated[int | None, typer.Option(help="seed for sampling")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N")] = "auto",
    dtype: Annotated[str, typer.Option(help="auto, float32, bfloat16 or float16")] = "auto",
    tier: TierOpt = "auto",
    predictor: PredictorOpt = "auto",
    policy: PolicyOpt = "lru",
    compressor: CompressorOpt = "none",
    keep_ratio: KeepRatioOpt = 0.7,
    salient_ratio: SalientRatioOpt = 0.3,
    affinity_weight: AffinityWeightOpt = 2.0,
    trace_out: Annotated[
        Path | None, typer.Option("--trace-out", help="write per-step, per-layer routing and cache telemetry (JSONL)")
    ] = None,
    replay_trace: Annotated[
        Path | None, typer.Option("--replay-trace", help="take routed experts from this trace instead of the router")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streamed text")] = False,
) -> None:
    """Answer a prompt about zero or more images, streaming the reply, then report time and expert traffic."""
    from vismmoe_edge.compress.prune import CompressionConfig
    from vismmoe_edge.sampling import SamplingConfig

    try:
        compression = CompressionConfig(compressor, keep_ratio, salient_ratio, affinity_weight)
        images: list[Path] = list(image or [])
        if model is None:
            from vismmoe_edge.demo import ensure_sample_image

            typer.echo(
                "note: no --model given: using the built-in demo model, a 10 M-parameter VL-MoE trained on "
                "Shapes-VQA (docs/demo-model.md); it knows coloured shapes, nothing else.",
                err=True,
            )
            if not images:
                images = [ensure_sample_image()]
        engine, plan_note = plan_and_load(
            model,
            profile=profile,
            memory_budget=memory_budget,
            pinned_layers=pinned_layers,
            tier=tier,
            device=device,
            dtype=dtype,
            predictor=predictor,
            policy=policy,
            compression=compression,
        )
        if replay_trace is not None:
            engine.replay_routing(replay_trace)
        writer = engine.write_trace(trace_out) if trace_out is not None else None
        inputs = engine.encode(prompt, images)
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
        on_text = None if as_json else lambda piece: (sys.stdout.write(piece), sys.stdout.flush())
        try:
            result = engine.generate_from_inputs(inputs, sampling, on_text=on_text)
        finally:
            if writer is not None:
                writer.close()
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None

    if plan_note:  # after the run, so that a failing run still prints exactly one line
        typer.echo(("" if as_json else "\n") + plan_note, err=True)
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
        return
    from vismmoe_edge.units import format_bytes

    t, x = result.timings, result.experts
    lock = engine.experts.lock_report
    if lock is not None and (lock.locked_bytes or lock.failed_bytes):
        why = f" ({lock.reason})" if lock.failed_bytes and lock.reason else ""
        typer.echo(
            f"[pinned prefix: {format_bytes(lock.locked_bytes)} mlocked, {format_bytes(lock.failed_bytes)} could "
            f"not be locked{why}]",
            err=True,
        )
    typer.echo("")
    typer.echo(
        f"[prefill {t.prefill_s * 1000:.0f} ms for {len(result.prompt_token_ids)} tokens | "
        f"decode {t.decode_tokens_per_s:.2f} tok/s over {t.decode_tokens} tokens | stop: {result.stop_reason}]",
        err=True,
    )
    if result.compression is not None:
        c = result.compression
        note = f"; {c.note}" if c.note else ""
        typer.echo(
            f"[compression {c.method}: kept {c.kept_visual_tokens} of {c.visual_tokens} visual tokens after "
            f"{engine.pinned_layers} pinned layers, {c.seconds * 1000:.1f} ms{note}]",
            err=True,
        )
    predictor = engine.experts.predictor
    if predictor is not None:
        where = f" on {predictor.provider}" if hasattr(predictor, "provider") else ""
        typer.echo(
            f"[predictor: {predictor.name}{where}, {engine.experts.predict_seconds * 1000:.1f} ms in all, "
            f"{format_bytes(x.get('speculative_bytes', 0))} prefetched, "
            f"{format_bytes(x.get('wasted_speculative_bytes', 0))} of it unused]",
            err=True,
        )
    typer.echo(
        f"[experts: {int(x['hits'])} hits, {int(x['misses'])} misses ({x['hit_rate']:.1%} hit rate), "
        f"{format_bytes(x['bytes_read'])} read, peak resident {format_bytes(x['peak_resident_bytes'])}]",
        err=True,
    )


def plan_and_load(
    model: Path | None,
    *,
    profile: str,
    memory_budget: str,
    pinned_layers: int | None,
    tier: str,
    device: str,
    dtype: str = "auto",
    predictor: str = "auto",
    policy: str = "lru",
    compression: CompressionConfig | None = None,
) -> tuple[Engine, str]:
    """What run, eval and calibrate share: fill the options left to the planner, load, set compression.
    Returns the engine and the plan's one-line note (empty when nothing was planned)."""
    from vismmoe_edge.loader import load

    memory_budget, pinned_layers, tier, note = apply_plan(model, profile, memory_budget, pinned_layers, tier, device)
    engine = load(
        model,
        memory_budget=memory_budget,
        pinned_layers=pinned_layers,
        device=device,
        dtype=dtype,
        tier=tier,
        predictor=predictor,
        policy=policy,
    )
    if compression is not None:
        engine.compression = compression
    return engine, note


def apply_plan(
    model: Path | None, profile: str, memory_budget: str, pinned_layers: int | None, tier: str, device: str
) -> tuple[str, int, str, str]:
    """Fill what the user left to the planner ("auto" budget, no --pinned-layers, "auto" tier) from the plan.

    Returns the options and a one-line note saying where they came from (empty when nothing was planned).
    """
    if memory_budget != "auto" and pinned_layers is not None and tier != "auto":
        return memory_budget, pinned_layers, tier, ""
    from vismmoe_edge.plan import make_plan
    from vismmoe_edge.profile_match import select_profile

    if model is None:
        from vismmoe_edge.demo import ensure_demo_model

        model = ensure_demo_model()
    chosen, reason, _ = select_profile(profile, cuda_available=False if device == "cpu" else None)
    plan = make_plan(model, chosen, profile_reason=reason)
    planned = plan.load_kwargs()
    if pinned_layers is None and memory_budget != "auto":
        # the user fixed the budget: pin no deeper than fits in it with room left for one streamed expert
        from vismmoe_edge.config import parse_budget

        budget = parse_budget(memory_budget, plan.s_layer_bytes * plan.moe_layers)
        fits = max(0, (budget - plan.bytes_per_expert) // plan.s_layer_bytes)
        pinned_layers = min(planned["pinned_layers"], fits)
    memory_budget = planned["memory_budget"] if memory_budget == "auto" else memory_budget
    pinned_layers = planned["pinned_layers"] if pinned_layers is None else pinned_layers
    tier = planned["tier"] if tier == "auto" else tier
    from vismmoe_edge.units import format_bytes

    shown_budget = format_bytes(int(memory_budget)) if str(memory_budget).isdigit() else memory_budget
    note = (
        f"[plan: profile {chosen.name}: {pinned_layers} pinned layers, expert budget {shown_budget}, tier {tier}; "
        "`vismmoe-edge plan` says why]"
    )
    return memory_budget, pinned_layers, tier, note


@app.command()
def info(
    model_dir: Annotated[Path, typer.Argument(help="Hugging Face model directory")],
    memory_budget: BudgetOpt = "100%",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Describe a checkpoint: its MoE shape, resident and expert bytes, and which pinned depths fit a budget."""
    from vismmoe_edge.describe import describe_checkpoint, format_description

    try:
        description = describe_checkpoint(model_dir, memory_budget)
    except VismmoeError as e:
        raise fail(str(e)) from None
    typer.echo(json.dumps(description, indent=2) if as_json else format_description(description))


@app.command()
def doctor() -> None:
    """Check this machine: Python, torch, transformers, CUDA, Jetson, jtop, onnxruntime, kernel features."""
    from vismmoe_edge.doctor import format_checks, run_checks

    checks = run_checks()
    typer.echo(format_checks(checks))
    if any(not c.ok and c.required for c in checks):
        raise typer.Exit(1)


def _register_commands() -> None:
    from vismmoe_edge.analyze import analyze_command
    from vismmoe_edge.bench import bench_command
    from vismmoe_edge.calibrate import calibrate_command
    from vismmoe_edge.evaluate import eval_command
    from vismmoe_edge.plan import plan_command
    from vismmoe_edge.predictor_cli import export_predictor_command, train_predictor_command
    from vismmoe_edge.profiling import profile_command
    from vismmoe_edge.server import serve_command
    from vismmoe_edge.service import install_service_command

    app.command("plan")(plan_command)
    app.command("serve")(serve_command)
    app.command("install-service")(install_service_command)
    app.command("profile")(profile_command)
    app.command("bench")(bench_command)
    app.command("eval")(eval_command)
    app.command("analyze")(analyze_command)
    app.command("calibrate")(calibrate_command)
    app.command("train-predictor")(train_predictor_command)
    app.command("export-predictor")(export_predictor_command)


_register_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
