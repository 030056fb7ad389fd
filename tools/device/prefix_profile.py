#!/usr/bin/env python3
"""Where the second question about a frame spends its time, in process, as the daemon's worker runs it (issue 26).

The daemon's second question took 0.042 s on the H200 in run 10, 0.033 s of it the prefill, 0.024 s of that the
suffix graph's replay. This runs the worker's steps for it without HTTP: the prompt from the seen frame
(seen_frames.encode_seen), then the engine's generator for one token; each phase timed with the GPU synchronised
around it, over several frames (medians); then one more second question under cProfile (the host functions by
own time and by cumulative time) and under torch.profiler (host ops by self time, CUDA kernels launched outside
the graph, synchronisations); last, the suffix graph's replay alone, its kernels by GPU time. Writes JSON to
--out and prints the tables.

    python3 tools/device/prefix_profile.py --model /tmp/bench/qwen3vl-30b-a3b-48layer --image IMG --out p.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from prefix_cache import FIRST, SECOND, tinted  # noqa: E402

QUESTIONS = ["How many shapes are there?", "Is the path clear?", "Where is the cup?", "Read the label."]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_kernels(engine) -> dict:  # type: ignore[no-untyped-def]
    """The most recent suffix graph's replay under torch.profiler: its kernels by GPU time (name, microseconds a
    replay, count a replay), how many it launches, their time and the replay's wall time."""
    from torch.profiler import ProfilerActivity, profile

    graph = list(engine.suffix_graphs.graphs.values())[-1].graph
    graph.replay()  # warm
    torch.cuda.synchronize()
    replays = 3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / replays
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(event.name[:100], [0.0, 0])
            entry[0] += event.device_time / replays  # (device_time is in microseconds)
            entry[1] += 1 / replays
    busy = sum(us for us, _ in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
    return {
        "replay_wall_ms": wall * 1e3,
        "kernel_ms": busy / 1e3,
        "kernels_per_replay": sum(n for _, n in kernels.values()),
        "top": [[name, round(us, 1), round(n, 1)] for name, (us, n) in top],
    }


def first_follow_up(engine, frame: Callable[[], object], ask: Callable[[], object]) -> dict:  # type: ignore[no-untyped-def]
    """The daemon's order (serve/warmup.py): the suffix graphs warmed, a frame's first question (`frame`), then its
    first follow-up (`ask`), which took 3.08 s in run 13's daemon after a warm-up meant to spare it any
    compilation. Times the warm-up and the follow-up, counts what was compiled in each (dynamo's graphs, and our
    @triton.jit kernels: a new specialization or an autotuner's configs) and keeps the follow-up's host
    functions by cumulative time."""
    import torch._dynamo.utils as dynamo_utils

    compiled: list[str] = []
    try:
        from triton import knobs

        def note(*, repr: str, **_: object) -> None:  # noqa: A002 - the hook's keyword
            compiled.append(repr[:160])

        knobs.runtime.jit_post_compile_hook = note
    except (ImportError, AttributeError):
        pass

    def graphs() -> int:
        return int(dynamo_utils.counters["stats"]["unique_graphs"])

    g0, t0 = graphs(), time.perf_counter()
    warmed = engine.suffix_graphs.warm()
    sync(engine.device)
    warm_s = time.perf_counter() - t0
    frame()
    g1, warm_compiled = graphs(), len(compiled)
    profiler = cProfile.Profile()
    t1 = time.perf_counter()
    profiler.enable()
    ask()
    sync(engine.device)
    profiler.disable()
    follow_up_s = time.perf_counter() - t1
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    return {
        "warmed": warmed, "warm_s": warm_s, "dynamo_graphs_before": g1 - g0, "triton_compiles_before": warm_compiled,
        "follow_up_s": follow_up_s, "follow_up_dynamo_graphs": graphs() - g1,
        "follow_up_triton_compiles": compiled[warm_compiled:], "cprofile": text.getvalue(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--image", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--warm",
        action="store_true",
        help="warm the suffix graphs first, as the daemon does, and profile the first follow-up after them",
    )
    args = ap.parse_args(argv)

    import vismmoe_edge
    from vismmoe_edge import seen_frames
    from vismmoe_edge.prefix_cache import PrefixCache
    from vismmoe_edge.prompt import build_messages
    from vismmoe_edge.results import Timings
    from vismmoe_edge.sampling import SamplingConfig

    engine = vismmoe_edge.load(args.model, memory_budget="100%", device=args.device)
    engine.prefix_cache = PrefixCache(2 * 2**30, salt=f"{args.model}|{engine.dtype}|{engine.device}")
    one = SamplingConfig(max_new_tokens=1)
    device = engine.device

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        tinted(args.image, i).save(buf, format="PNG")
        return buf.getvalue()

    def first(data: bytes) -> None:
        from PIL import Image

        inputs = engine.encode_messages(build_messages(FIRST, 1), [Image.open(io.BytesIO(data)).convert("RGB")])
        engine.generate_from_inputs(inputs, one)
        seen_frames.remember(engine, seen_frames.frame_keys(engine, [data]), inputs)

    def second(data: bytes, question: str) -> dict:
        sync(device)
        t0 = time.perf_counter()
        frames = seen_frames.frame_keys(engine, [data])
        inputs = seen_frames.encode_seen(engine, build_messages(question, 1), frames)
        assert inputs is not None, "the frame was not seen"
        t1 = time.perf_counter()
        timings = Timings()
        tokens = list(engine.stream(inputs, one, timings=timings))
        sync(device)
        t2 = time.perf_counter()
        return {"encode_s": t1 - t0, "generate_s": t2 - t1, "prefill_s": timings.prefill_s, "tokens": tokens,
                "reused": timings.prefix_reused_tokens, "suffix_graph_tokens": timings.suffix_graph_tokens}  # fmt: skip

    out: dict = {}
    if args.warm:
        out["first_follow_up"] = first_follow_up(engine, lambda: first(png(1000)), lambda: second(png(1000), SECOND))
        print(json.dumps({k: v for k, v in out["first_follow_up"].items() if k != "cprofile"}), flush=True)
        print(out["first_follow_up"]["cprofile"])
    else:
        first(png(1000))
        second(png(1000), SECOND)  # captures the suffix graph of this length
    rows = []
    for i in range(args.frames):
        data = png(i)
        first(data)
        for question in QUESTIONS[:2]:
            rows.append(second(data, question))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
    out["rows"] = rows
    for key in ("encode_s", "generate_s", "prefill_s"):
        out[f"median_{key}"] = statistics.median(r[key] for r in rows)

    data = png(77)
    first(data)
    profiler = cProfile.Profile()
    profiler.enable()
    second(data, QUESTIONS[2])
    profiler.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(40)
        out[f"cprofile_{order}"] = text.getvalue()
        print(text.getvalue())

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        second(data, QUESTIONS[3])
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    out["torch_profile"] = table
    print(table)
    if device.type == "cuda":
        out["graph_kernels"] = graph_kernels(engine)
        print(json.dumps(out["graph_kernels"], indent=1))
    args.out.write_text(json.dumps(out, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
