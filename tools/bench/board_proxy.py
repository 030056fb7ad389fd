#!/usr/bin/env python3
"""The board plan run on this CPU under a memory cgroup of the board's size: one image prompt + sampled decode.

For each `--profile` (an Orin board), the parent asks `make_plan(MODEL, profile)` off the board, i.e. for the
module's memory (M_avail: DRAM less the boot carveouts, the OS and a camera; docs/jetson.md), then runs one worker
under a cgroup-v1 memory cap of exactly M_avail, page cache included (memcgroup.py), with the checkpoint's pages
evicted first. The worker loads the model on the CPU (`--device cpu`, tier `unified`: experts computed from the
page cache) with the plan's pinned layers and expert budget, encodes one image of `--image-size` (1088x1024: 1,088
visual tokens through the real-size vision tower), prefills, and decodes `--tokens` steps with temperature
sampling (the routers pick experts from sampled tokens). Recorded per board: the cgroup's peak
(`memory.max_usage_in_bytes`, page cache included), OOM kills, prefill seconds, decode tok/s (median step), and
the bytes the process read from disk per decode step (/proc/self/io `read_bytes`) next to the expert bytes the
pipeline fetched per step.

This CPU is not an Orin: tok/s here is this machine's, and the board's is projected from the bytes per token
(tools/analysis/orin_projection.py --measured JSON).

    python tools/bench/board_proxy.py --model $BENCH_DATA/qwen3vl-30b-a3b-int4-dense4 \\
        --profile orin-nano-8gb-super--maxn-super --profile orin-nx-16gb--maxn --json board_proxy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS.parent))

PROMPT = "Describe the picture in detail."
DEFAULT_PROFILES = ("orin-nano-8gb-super--maxn-super", "orin-nx-16gb--maxn")


def proc_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def proxy_image(width: int, height: int):
    """The sample image resized to width x height (multiples of 32: width/32 x height/32 merged visual tokens)."""
    from PIL import Image

    from vismmoe_edge.evaluation.sample import ensure_sample_image

    return Image.open(ensure_sample_image()).convert("RGB").resize((width, height))


def board_plan(model: Path, profile: str) -> dict:
    """The plan for `profile`'s module memory, as `vismmoe-edge plan MODEL --profile P` off the board gives it."""
    from vismmoe_edge.hardware.gpu_access import ORIN_DOCUMENTED
    from vismmoe_edge.hardware.profiles import get_profile
    from vismmoe_edge.planning.plan import make_plan

    root = TOOLS.parent / "tests" / "fixtures" / "boards" / "x86-desktop"  # any non-Jetson tree: plan off the board
    return make_plan(model, get_profile(profile), root=root, cgroup=None, gpu=ORIN_DOCUMENTED).as_dict()


def worker(args: argparse.Namespace) -> dict:
    """Inside the cgroup: load with the plan's budget, one image prompt, `--tokens` sampled decode steps."""
    import torch

    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = vismmoe_edge.load(args.model, memory_budget=str(args.budget), pinned_layers=args.pinned, device="cpu",
                               tier="unified")  # fmt: skip
    load_s = time.perf_counter() - t0
    width, height = (int(v) for v in args.image_size.split("x"))
    inputs = engine.encode(PROMPT, [proxy_image(width, height)])
    image_token = engine.model.config.image_token_id
    visual_tokens = int((inputs.input_ids == image_token).sum())
    sampling = SamplingConfig(max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, temperature=0.7,
                              top_p=0.9, seed=0)  # fmt: skip
    pipeline = engine.experts.pipeline
    pipeline.reset_stats()
    times: list[float] = []
    reads: list[int] = []
    fetched: list[int] = []
    read_before = proc_read_bytes()
    start = time.perf_counter()
    tokens: list[int] = []
    for token in engine.stream(inputs, sampling):
        tokens.append(int(token))
        times.append(time.perf_counter())
        reads.append(proc_read_bytes())
        fetched.append(pipeline.stats.bytes_read)
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    stats = pipeline.stats.as_dict()
    return {
        "budget_bytes": args.budget,
        "pinned_layers": args.pinned,
        "tier": pipeline.tier.name,
        "slots": pipeline.capacity,
        "threads": args.threads,
        "load_s": load_s,
        "prompt_tokens": inputs.num_tokens,
        "visual_tokens": visual_tokens,
        "image_size": args.image_size,
        "prefill_s": times[0] - start,
        "prefill_read_bytes": reads[0] - read_before,
        "decode_steps": len(steps),
        "decode_s_per_token": statistics.median(steps),
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "decode_mean_tokens_per_s": len(steps) / (times[-1] - times[0]),
        "decode_read_bytes_per_token": (reads[-1] - reads[0]) / len(steps),
        "decode_expert_bytes_fetched_per_token": (fetched[-1] - fetched[0]) / len(steps),
        "hit_rate": stats["hit_rate"],
        "distinct_tokens": len(set(tokens)),
        "token_ids": tokens,
        "expert_bytes": engine.catalogue.expert_bytes,
    }


def run_board(args: argparse.Namespace, profile: str) -> dict:
    from bench import memcgroup

    plan = board_plan(args.model, profile)
    cap = int(plan["m_avail_bytes"])
    cmd = [sys.executable, __file__, "--worker", "--model", str(args.model),
           "--budget", str(plan["memory_budget_bytes"]), "--pinned", str(plan["pinned_layers"]),
           "--tokens", str(args.tokens), "--image-size", args.image_size, "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "OMP_NUM_THREADS": str(args.threads)}
    shards = sorted(args.model.glob("*.safetensors"))
    started = time.perf_counter()
    run = memcgroup.run_capped(cmd, cap, evict=shards, env=env, capture_output=True, timeout=args.timeout)
    row: dict = {
        "profile": profile,
        "cgroup_limit_bytes": cap,
        "plan": {k: plan[k] for k in ("pinned_layers", "memory_budget_bytes", "cache_bytes", "resident_bytes",
                                      "m_avail_bytes", "c_safe_bytes", "device", "tier", "total_expert_bytes")}
        | {"language_weights_bytes": plan["memory_parts"]["language_weights_bytes"],
           "vision_weights_bytes": plan["memory_parts"]["vision_weights_bytes"]},
        "peak_cgroup_bytes": run.max_usage_bytes,
        "oom_killed": run.oom_killed,
        "cgroup_failcnt": run.failcnt,
        "returncode": run.returncode,
        "wall_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    if run.returncode != 0:
        row["error"] = " | ".join((run.stderr or "").strip().splitlines()[-3:])
        return row
    return row | json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", type=Path, required=True, help="a quantized proxy (tools/checkpoints/streaming_quantized.py)"
    )
    p.add_argument(
        "--profile", action="append", help=f"board profile (repeatable; default {', '.join(DEFAULT_PROFILES)})"
    )
    p.add_argument("--tokens", type=int, default=16, help="sampled decode steps after the prefill's token")
    p.add_argument("--image-size", default="1088x1024", help="WxH, multiples of 32 (1088x1024: 1,088 visual tokens)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pinned", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    from bench.memcgroup import memory_cgroup_support

    ok, why = memory_cgroup_support()
    if not ok:
        p.error(f"no memory cgroup: {why}")
    if not (a.model / "config.json").is_file():
        p.error(f"{a.model}: not a model directory (build one with tools/checkpoints/streaming_quantized.py)")
    rows = []
    for profile in a.profile or DEFAULT_PROFILES:
        row = run_board(a, profile)
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "cpu": os.cpu_count(), "model": str(a.model)}  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    return 0 if all(r.get("returncode") == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
