"""`vismmoe-edge profile`: run a prompt set through the engine while sampling the machine.

Writes into --out:
- samples.csv: monitor rows (monitor.py): power, temperatures, CPU, memory, GPU, every `--interval` s;
- tokens.csv: one row per generated token: time, request, latency, expert hit rate so far;
- summary.json: throughput, latency percentiles, hit rates, energy where power is known, peak RSS;
- power.png, memory.png, latency.png, hit_rate.png and the 2x2 profile.png (when matplotlib is installed).

Token latency is the time between tokens yielded by `Engine.stream`; a request's first token includes
prefill (its time to first token). Times share one clock with samples.csv (Unix seconds, and elapsed_s
from the start of the run, which includes loading the model).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware.monitor import Monitor, notice_once, open_samplers, write_csv

if TYPE_CHECKING:
    from vismmoe_edge.options import LoadOptions

DEFAULT_PROMPTS = (
    "Describe the image.",
    "What shapes and colours are in the picture?",
    "Which number is written in the image?",
)
# Power columns in order of preference: the board's input rail (jtop) covers CPU, GPU and DRAM; NVML only the GPU.
POWER_SOURCES = (
    ("power_total_mw", "jtop total board power"),
    ("gpu_power_mw", "NVML GPU power only (excludes CPU, DRAM, disk)"),
)


@dataclass
class Request:
    prompt: str
    images: list[Path] = field(default_factory=list)


def default_requests() -> list[Request]:
    from vismmoe_edge.evaluation.sample import ensure_sample_image

    image = ensure_sample_image()
    return [Request(prompt, [image]) for prompt in DEFAULT_PROMPTS]


def load_requests(path: Path) -> list[Request]:
    """JSONL: one {"prompt": str, "images": [path, ...]} per line; image paths are relative to the file."""
    requests = []
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise VismmoeError(f"--prompts {path}: {e.strerror}") from e
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise VismmoeError(f"{path}:{number}: not JSON ({e.msg})") from e
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise VismmoeError(f'{path}:{number}: expected {{"prompt": "...", "images": [...]}}')
        images = [path.parent / Path(p).expanduser() for p in item.get("images") or []]
        for image in images:
            if not image.is_file():
                raise VismmoeError(f"{path}:{number}: image {image} does not exist")
        requests.append(Request(item["prompt"], images))
    if not requests:
        raise VismmoeError(f"--prompts {path}: no prompts in the file")
    return requests


# --------------------------------------------------------------------------------------------------
# Running the workload
# --------------------------------------------------------------------------------------------------


def run_workload(
    engine: Any,
    requests: list[Request],
    sampling: Any,
    *,
    t0: float,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Stream every request; return (token rows, per-request rows). Expert counters restart per request."""
    from tqdm import tqdm

    pipeline = engine.experts.pipeline
    tokens: list[dict[str, Any]] = []
    per_request: list[dict[str, Any]] = []
    run_hits = run_misses = 0
    bar = tqdm(requests, desc="profile", unit="req", disable=not progress, file=sys.stderr)
    for number, request in enumerate(bar):
        encode_start = time.perf_counter()
        inputs = engine.encode(request.prompt, request.images)
        encode_s = time.perf_counter() - encode_start
        pipeline.reset_stats()  # as generate() does: per-request counters, and layer_log stays short
        last_stall, last_bytes = 0.0, 0
        mine: list[dict[str, Any]] = []
        start = previous = time.perf_counter()
        for index, token in enumerate(engine.stream(inputs, sampling)):
            now, wall = time.perf_counter(), time.time()
            stats = pipeline.stats
            seen = stats.hits + stats.misses
            run_seen = run_hits + run_misses + seen
            mine.append(
                {
                    "time": wall,
                    "elapsed_s": wall - t0,
                    "request": number,
                    "index": index,
                    "phase": "prefill" if index == 0 else "decode",  # token 0's latency is time to first token
                    "token_id": token,
                    "latency_ms": (now - previous) * 1000,
                    "hits": stats.hits,
                    "misses": stats.misses,
                    "hit_rate": stats.hits / seen if seen else 0.0,  # cumulative within the request
                    "hit_rate_run": (run_hits + stats.hits) / run_seen if run_seen else 0.0,
                    "stall_ms": (stats.stall_s - last_stall) * 1000,
                    "bytes_read": stats.bytes_read - last_bytes,
                }
            )
            last_stall, last_bytes, previous = stats.stall_s, stats.bytes_read, now
        tokens += mine
        stats = pipeline.stats
        run_hits, run_misses = run_hits + stats.hits, run_misses + stats.misses
        decode_s = sum(t["latency_ms"] for t in mine[1:]) / 1000
        per_request.append(
            {
                "request": number,
                "prompt": request.prompt[:80],
                "images": [str(p) for p in request.images],
                "prompt_tokens": int(inputs.input_ids.shape[1]),
                "tokens": len(mine),
                "encode_s": encode_s,
                "ttft_s": mine[0]["latency_ms"] / 1000 if mine else None,
                "decode_tokens_per_s": (len(mine) - 1) / decode_s if decode_s > 0 else None,
                "wall_s": time.perf_counter() - start,
                "hit_rate": stats.hit_rate,
                "hits": stats.hits,
                "misses": stats.misses,
                "bytes_read": stats.bytes_read,
                "stall_s": stats.stall_s,
                "peak_resident_bytes": stats.peak_resident_bytes,
            }
        )
        if progress:
            bar.set_postfix(tok=len(mine), hit=f"{stats.hit_rate:.0%}")
    return tokens, per_request


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def energy(samples: list[dict[str, float]], start: float, end: float) -> dict[str, Any] | None:
    """Mean power over [start, end] (Unix s) times the duration, from the best power column present."""
    for column, source in POWER_SOURCES:
        window = [s[column] for s in samples if column in s and start <= s["time"] <= end]
        if not window:  # a run shorter than the interval: take whatever was sampled
            window = [s[column] for s in samples if column in s]
        if window:
            mean_w = statistics.fmean(window) / 1000
            return {"column": column, "source": source, "mean_power_w": mean_w, "energy_j": mean_w * (end - start)}
    return None


def summarise(
    tokens: list[dict[str, Any]],
    per_request: list[dict[str, Any]],
    samples: list[dict[str, float]],
    *,
    workload: tuple[float, float],
    load_s: float,
    samplers: list[str],
    settings: dict[str, Any],
) -> dict[str, Any]:
    start, end = workload
    wall = end - start
    decode = [t["latency_ms"] for t in tokens if t["phase"] == "decode"]
    hits = sum(r["hits"] for r in per_request)
    misses = sum(r["misses"] for r in per_request)
    power = energy(samples, start, end)
    ttft = [r["ttft_s"] * 1000 for r in per_request if r["ttft_s"] is not None]
    rss = [s["rss_bytes"] for s in samples if "rss_bytes" in s]
    peak_rss = int(max(rss + [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))  # ru_maxrss is KiB on Linux
    return {
        "samplers": samplers,
        "settings": settings,
        "load_s": load_s,
        "requests": len(per_request),
        "tokens": len(tokens),
        "workload_s": wall,
        "tokens_per_s": len(tokens) / wall if wall > 0 else None,  # all generated tokens over the workload's wall
        "decode_tokens_per_s": len(decode) / (sum(decode) / 1000) if decode and sum(decode) > 0 else None,
        "ttft_ms_mean": statistics.fmean(ttft) if ttft else None,
        "decode_latency_ms": {
            "p50": _percentile(decode, 50),
            "p90": _percentile(decode, 90),
            "p99": _percentile(decode, 99),
            "max": max(decode) if decode else None,
        },
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "hits": hits,
        "misses": misses,
        "power": power,
        "tokens_per_joule": len(tokens) / power["energy_j"] if power and power["energy_j"] > 0 else None,
        "peak_rss_bytes": peak_rss,
        "per_request": per_request,
    }


# --------------------------------------------------------------------------------------------------
# Plots (matplotlib is optional)
# --------------------------------------------------------------------------------------------------

GIB = float(1 << 30)


def _plot_power(ax: Any, samples: list[dict[str, float]], marks: dict[str, float]) -> None:
    x = [s["elapsed_s"] for s in samples]
    columns = [c for c, _ in POWER_SOURCES if any(c in s for s in samples)]
    rails = sorted({k for s in samples for k in s if k.startswith("power_") and k != "power_total_mw"})
    if columns or rails:
        for column in columns + rails:
            points = [(s["elapsed_s"], s[column] / 1000) for s in samples if column in s]
            ax.plot(*zip(*points, strict=True), label=column.removesuffix("_mw"), lw=1.2)
        ax.set_ylabel("W")
        ax.set_title("Power")
    else:  # off-Jetson without NVML: CPU is the best load signal there is
        for column, label in (("cpu_percent", "process"), ("sys_cpu_percent", "system")):
            if any(column in s for s in samples):
                ax.plot(x, [s.get(column, float("nan")) for s in samples], label=label, lw=1.2)
        ax.set_ylabel("CPU %")
        ax.set_title("CPU (no power telemetry on this host)")
    _finish(ax, marks)


def _plot_memory(ax: Any, samples: list[dict[str, float]], marks: dict[str, float]) -> None:
    for column, label in (
        ("rss_bytes", "process RSS"),
        ("mem_used_bytes", "system used (total - available)"),
        ("swap_used_bytes", "swap used"),
        ("ram_gpu_shared_bytes", "GPU (NvMap)"),
        ("gpu_mem_used_bytes", "GPU memory"),
    ):
        points = [(s["elapsed_s"], s[column] / GIB) for s in samples if column in s]
        if points:
            ax.plot(*zip(*points, strict=True), label=label, lw=1.2)
    ax.set_ylabel("GiB")
    ax.set_title("Memory")
    _finish(ax, marks)


def _plot_latency(ax: Any, tokens: list[dict[str, Any]], marks: dict[str, float]) -> None:
    decode = [(t["elapsed_s"], t["latency_ms"]) for t in tokens if t["phase"] == "decode"]
    first = [(t["elapsed_s"], t["latency_ms"]) for t in tokens if t["phase"] == "prefill"]
    if decode:
        ax.plot(*zip(*decode, strict=True), ".", ms=3, label="decode token")
    if first:
        ax.plot(*zip(*first, strict=True), "v", ms=6, label="first token (prefill)")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    ax.yaxis.set_major_formatter(ScalarFormatter())  # "20", not "2x10^1"
    ax.set_ylabel("ms")
    ax.set_title("Per-token latency")
    _finish(ax, marks)


def _plot_hit_rate(ax: Any, tokens: list[dict[str, Any]], marks: dict[str, float]) -> None:
    if tokens:
        x = [t["elapsed_s"] for t in tokens]
        ax.plot(x, [100 * t["hit_rate_run"] for t in tokens], lw=1.5, label="whole run")
        ax.plot(x, [100 * t["hit_rate"] for t in tokens], ".", ms=2, label="within request")
    ax.set_ylim(0, 100)
    ax.set_ylabel("expert hit rate %")
    ax.set_title("Expert cache hit rate (cumulative)")
    _finish(ax, marks)


def _finish(ax: Any, marks: dict[str, float]) -> None:
    if "end" in marks:  # one time axis for every panel, from the start of loading
        ax.set_xlim(0, marks["end"])
    for label, x in marks.items():
        if label == "end":
            continue
        ax.axvline(x, color="grey", ls="--", lw=0.8)
        ax.annotate(label, (x, 1), xycoords=("data", "axes fraction"), fontsize=7, rotation=90, va="top", ha="right")
    ax.set_xlabel("seconds since start")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def write_plots(
    out: Path, samples: list[dict[str, float]], tokens: list[dict[str, Any]], marks: dict[str, float], title: str
) -> list[Path]:
    """power/memory/latency/hit_rate PNGs and the 2x2 profile.png; [] (and one notice) without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        notice_once("matplotlib", "matplotlib is not installed, so no plots: pip install matplotlib")
        return []
    panels = (
        ("power.png", lambda ax: _plot_power(ax, samples, marks)),
        ("memory.png", lambda ax: _plot_memory(ax, samples, marks)),
        ("latency.png", lambda ax: _plot_latency(ax, tokens, marks)),
        ("hit_rate.png", lambda ax: _plot_hit_rate(ax, tokens, marks)),
    )
    written = []
    # Figure + the Agg canvas, not pyplot: no global backend state, safe inside a server or a test run.
    for name, draw in panels:
        fig = Figure(figsize=(7, 4), layout="constrained")
        FigureCanvasAgg(fig)
        draw(fig.add_subplot())
        fig.savefig(out / name, dpi=110)
        written.append(out / name)
    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title, fontsize=10)
    for ax, (_, draw) in zip(fig.subplots(2, 2).flat, panels, strict=True):
        draw(ax)
    fig.savefig(out / "profile.png", dpi=110)
    written.append(out / "profile.png")
    return written


# --------------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------------


def run_profile(
    out: Path,
    *,
    model: Path | None = None,
    options: LoadOptions | None = None,
    prompts: Path | None = None,
    max_new_tokens: int = 32,
    ignore_eos: bool = False,
    interval: float = 0.5,
    progress: bool = True,
    plots: bool = True,
) -> dict[str, Any]:
    """Load the model and run the prompt set under the monitor; write the files; return the summary."""
    from vismmoe_edge.hardware.system import detect_jetson
    from vismmoe_edge.options import LoadOptions, load_engine
    from vismmoe_edge.sampling import SamplingConfig

    options = options if options is not None else LoadOptions()

    requests = load_requests(prompts) if prompts is not None else default_requests()
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens if ignore_eos else 0)
    sampling.validate()
    out.mkdir(parents=True, exist_ok=True)
    board = detect_jetson()

    monitor = Monitor(open_samplers(interval, jetson=board is not None), interval)
    with monitor:  # sampling starts before loading: the memory plot shows the load ramp
        load_start = time.time()
        engine, resolved = load_engine(model, options)
        workload_start = time.time()
        tokens, per_request = run_workload(engine, requests, sampling, t0=monitor.t0, progress=progress)
        workload_end = time.time()

    settings = {
        "model": str(engine.model_dir),
        "demo_model": engine.is_demo,
        "memory_budget": resolved.memory_budget_bytes,
        "pinned_layers": resolved.pinned_layers,
        "tier": engine.experts.pipeline.tier.name,
        "prefetch_depth": resolved.prefetch_depth,
        "predictor": options.predictor,
        "policy": options.policy,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "ignore_eos": ignore_eos,
        "interval_s": interval,
        "board": board.describe() if board else None,
        "started": datetime.fromtimestamp(monitor.t0).isoformat(timespec="seconds"),
    }
    summary = summarise(
        tokens,
        per_request,
        monitor.rows,
        workload=(workload_start, workload_end),
        load_s=workload_start - load_start,
        samplers=monitor.sampler_names,
        settings=settings,
    )
    write_csv(out / "samples.csv", monitor.rows)
    write_csv(out / "tokens.csv", tokens)
    files = ["samples.csv", "tokens.csv", "summary.json"]
    if plots:
        marks = {"loaded": workload_start - monitor.t0, "end": monitor.rows[-1]["elapsed_s"]}
        name, budget = Path(settings["model"]).name, resolved.memory_budget_bytes
        title = f"{name} | budget {budget} | tier {settings['tier']} | {settings['device']}"
        files += [p.name for p in write_plots(out, monitor.rows, tokens, marks, title)]
    summary["files"] = files
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def format_summary(summary: dict[str, Any], out: Path) -> str:
    from vismmoe_edge.units import format_bytes

    def num(value: float | None, fmt: str, unit: str = "") -> str:
        return "n/a" if value is None else f"{value:{fmt}}{unit}"

    lat = summary["decode_latency_ms"]
    power = summary["power"]
    lines = [
        f"samplers: {', '.join(summary['samplers'])}",
        f"{summary['requests']} requests, {summary['tokens']} tokens in {summary['workload_s']:.2f} s "
        f"(load {summary['load_s']:.2f} s): {num(summary['tokens_per_s'], '.2f', ' tok/s')}, "
        f"decode {num(summary['decode_tokens_per_s'], '.2f', ' tok/s')}",
        f"first token {num(summary['ttft_ms_mean'], '.0f', ' ms')} mean; decode token p50 "
        f"{num(lat['p50'], '.1f')} / p90 {num(lat['p90'], '.1f')} / p99 {num(lat['p99'], '.1f')} ms",
        f"expert hit rate {num(summary['hit_rate'], '.1%')}; peak RSS {format_bytes(summary['peak_rss_bytes'])}",
    ]
    if power:
        lines.append(
            f"power {power['mean_power_w']:.1f} W mean ({power['source']}): "
            f"{num(summary['tokens_per_joule'], '.3f', ' tokens/J')}"
        )
    else:
        lines.append("power: no source on this host (jtop on a Jetson, NVML on a discrete GPU)")
    lines.append(f"wrote {', '.join(summary['files'])} to {out}")
    return "\n".join(lines)


