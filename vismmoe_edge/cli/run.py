"""`vismmoe-edge run`: answer a prompt about images, streaming the reply, then report time and expert traffic."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from vismmoe_edge.cli.common import fail, load_options, plan_and_load
from vismmoe_edge.cli.options import (
    AffinityWeightOpt,
    BudgetOpt,
    CompressorOpt,
    DeviceOpt,
    DtypeOpt,
    HostTierOpt,
    ImageOpt,
    KeepRatioOpt,
    ModelOpt,
    PinnedOpt,
    PolicyOpt,
    PredictorOpt,
    PrefetchDepthOpt,
    PrefixCacheOpt,
    ProfileOpt,
    SalientRatioOpt,
    TierOpt,
    VideoFpsOpt,
    VideoFramesOpt,
    VideoMaxFramesOpt,
    VideoMaxPixelsOpt,
    VideoOpt,
)
from vismmoe_edge.errors import VismmoeError

if TYPE_CHECKING:
    from vismmoe_edge.engine import GenerationResult
    from vismmoe_edge.video import VideoSettings


def run(
    prompt: Annotated[
        list[str] | None,
        typer.Option(
            "--prompt",
            help="the question or instruction; repeat to ask several about the same images in turn, each reusing "
            "the image's prefill (the prefix cache)",
        ),
    ] = None,
    prompt_file: Annotated[
        Path | None,
        typer.Option("--prompt-file", help="read the prompt from this file ('-': standard input) instead of --prompt"),
    ] = None,
    model: ModelOpt = None,
    image: ImageOpt = None,
    video: VideoOpt = None,
    video_frames: VideoFramesOpt = None,
    video_fps: VideoFpsOpt = 2.0,
    video_max_frames: VideoMaxFramesOpt = 32,
    video_max_pixels: VideoMaxPixelsOpt = 128 * 32 * 32,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1)] = 64,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    profile: ProfileOpt = "auto",
    temperature: Annotated[float, typer.Option(min=0.0, help="0 decodes greedily")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)] = 1.0,
    seed: Annotated[int | None, typer.Option(help="seed for sampling")] = None,
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
    prefix_cache_bytes: PrefixCacheOpt = "auto",
    trace_out: Annotated[
        Path | None, typer.Option("--trace-out", help="write per-step, per-layer routing and cache telemetry (JSONL)")
    ] = None,
    replay_trace: Annotated[
        Path | None, typer.Option("--replay-trace", help="take routed experts from this trace instead of the router")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of streamed text")] = False,
) -> None:
    """Answer a prompt about zero or more images and clips, streaming the reply, then report time and expert traffic."""
    try:
        questions = read_prompts(prompt, prompt_file)  # before torch is imported: a wrong invocation fails at once
        check_image_files(image or [])
        video_settings = check_video_options(video or [], video_frames or [], video_fps, video_max_frames)
    except VismmoeError as e:
        raise fail(str(e)) from None
    from vismmoe_edge.compress.config import CompressionConfig
    from vismmoe_edge.serve.protocol import sampling_floor

    try:
        compression = CompressionConfig(compressor, keep_ratio, salient_ratio, affinity_weight)
        images: list[Path] = list(image or [])
        if model is None:
            from vismmoe_edge.evaluation.sample import ensure_sample_image

            typer.echo(
                "note: no --model given: using the built-in demo model, a 10 M-parameter VL-MoE trained on "
                "Shapes-VQA (docs/demo-model.md); it knows coloured shapes, nothing else.",
                err=True,
            )
            if not images and not video and not video_frames:
                images = [ensure_sample_image()]
        options = load_options(locals())
        engine, plan_note = plan_and_load(model, options)  # a refused model directory answers before torch loads
        from vismmoe_edge.sampling import SamplingConfig

        if replay_trace is not None:
            engine.replay_routing(replay_trace)
        writer = engine.write_trace(trace_out) if trace_out is not None else None
        from vismmoe_edge.video import read_clips

        clips = read_clips(engine.processor, video or [], video_frames or [], video_settings, video_max_pixels)
        all_inputs = [engine.encode(question, images, clips) for question in questions]  # every prompt checked first
        for inputs in all_inputs:
            check_context(inputs.num_tokens, max_new_tokens, engine)
        temperature, top_p = sampling_floor(temperature, top_p)  # 1e-300 would make NaN probabilities
        if len(all_inputs) > 1:  # the questions after the first: their prefill compiled before any is timed
            from vismmoe_edge.serve.warmup import warm_suffix_graphs

            if (seconds := warm_suffix_graphs(engine)) is not None and not as_json:
                typer.echo(f"[compiled the prefill of the questions after the first in {seconds:.1f} s]", err=True)
        on_text = None if as_json else lambda piece: (sys.stdout.write(piece), sys.stdout.flush())
        results = []
        try:
            for i, inputs in enumerate(all_inputs):
                if i and not as_json:
                    report_question(results[-1], i, len(questions))
                sampling = SamplingConfig(
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
                )
                results.append(engine.generate_from_inputs(inputs, sampling, on_text=on_text))
        finally:
            if writer is not None:
                writer.close()
        result = results[-1]
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted", 130) from None

    if plan_note:  # after the run, so that a failing run still prints exactly one line
        typer.echo(("" if as_json else "\n") + plan_note, err=True)
    if as_json:
        if len(results) == 1:
            typer.echo(json.dumps(result.as_dict()))
        else:
            answers = [
                {"question": q, "ttft_s": r.timings.prefill_s} | r.as_dict()
                for q, r in zip(questions, results, strict=True)
            ]
            stats = engine.prefix_cache.stats().as_dict() if engine.prefix_cache is not None else None
            typer.echo(json.dumps({"answers": answers, "prefix_cache": stats}))
        return
    if len(results) > 1:
        report_question(result, len(results), len(results))
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


def report_question(result: GenerationResult, number: int, total: int) -> None:
    """After each of several questions: its answer ends its line; its time to first token and reuse go to stderr."""
    t = result.timings
    typer.echo("")
    typer.echo(
        f"[question {number}/{total}: time to first token {t.prefill_s * 1000:.0f} ms, "
        f"{t.prefix_reused_tokens} of {len(result.prompt_token_ids)} prompt tokens reused from the prefix cache, "
        f"vision features of {t.vision_cached_images} images reused]",
        err=True,
    )


def read_prompts(prompts: list[str] | None, prompt_file: Path | None) -> list[str]:
    """Several --prompt (questions asked in turn about the same images), or one --prompt or --prompt-file."""
    if prompts and len(prompts) > 1:
        if prompt_file is not None:
            raise VismmoeError("give the questions with --prompt (repeated) or one prompt with --prompt-file, not both")
        if not all(p.strip() for p in prompts):
            raise VismmoeError("one --prompt is empty; give each question as text")
        return prompts
    return [read_prompt(prompts[0] if prompts else None, prompt_file)]


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """--prompt TEXT, or --prompt-file PATH ('-' reads standard input): exactly one of them."""
    if (prompt is None) == (prompt_file is None):
        raise VismmoeError("give the prompt with --prompt TEXT or --prompt-file PATH ('-' for standard input)")
    if prompt is not None:
        return prompt
    assert prompt_file is not None
    if str(prompt_file) == "-":
        return sys.stdin.read()
    try:
        return prompt_file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise VismmoeError(f"--prompt-file {prompt_file}: cannot read it ({reason})") from None


def check_image_files(paths: list[Path], option: str = "--image") -> None:
    """Each --image must be a regular file: opening a FIFO would wait for a writer for ever, a device never end."""
    for path in paths:
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            continue  # said where the image is read, as before
        except OSError as e:
            raise VismmoeError(f"{option} {path}: cannot read it ({e.strerror})") from None
        if not stat.S_ISREG(mode):
            raise VismmoeError(f"{option} {path}: not a regular file (a FIFO, device or directory); give a file")


def check_video_options(files: list[Path], frame_lists: list[str], fps: float, max_frames: int) -> VideoSettings:
    """The clips' files exist and are regular, PyAV is there for a file, the rate and bound make sense."""
    from vismmoe_edge.video import VideoSettings, import_av, split_frames

    check_image_files(files, "--video")
    for spec in frame_lists:
        check_image_files([Path(name) for name in split_frames(spec)], "--video-frames")
    if files:
        import_av()  # a missing extra fails now, not after the model has loaded
    return VideoSettings(fps=fps, max_frames=max_frames)


def check_context(prompt_tokens: int, max_new_tokens: int, engine: object) -> None:
    """Refuse before prefill a prompt the model cannot hold: prefill of an over-long prompt takes minutes."""
    limit = int(getattr(getattr(engine, "text_config", None), "max_position_embeddings", 0) or 0)
    if limit and prompt_tokens + max_new_tokens > limit:
        raise VismmoeError(
            f"the prompt is {prompt_tokens} tokens; with --max-new-tokens {max_new_tokens} that is more than the "
            f"model's context of {limit} tokens: shorten the prompt or lower --max-new-tokens"
        )
