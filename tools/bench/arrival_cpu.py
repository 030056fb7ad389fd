#!/usr/bin/env python3
"""Computing experts as their reads land (experts/arrival.py) against waiting for every read, on this CPU.

One engine on a real-size checkpoint (30B-A3B experts, 9.4 MB each in bf16; e.g. 4 layers of
tools/checkpoints/synthetic_qwen3_vl_moe.py), tier `unified-slots` on the CPU at a partial budget: a miss is a read
of the expert's bytes from the shard file into its slot, with its pages dropped after (as on a Jetson), so every
fill reads the disk. Sampled decoding of a short text prompt (temperature 1; the routers pick the experts), the
two modes alternating in one process with the same seeds: `arrival` (the engine's default) and `wait-all` (each
layer waits for its last read, as before). Prints and optionally writes per-trial decode tok/s and stall seconds.

    python tools/bench/arrival_cpu.py --model /tmp/real4 --budget 25% --tokens 16 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import vismmoe_edge  # noqa: E402
from vismmoe_edge.experts import compute  # noqa: E402
from vismmoe_edge.sampling import SamplingConfig  # noqa: E402

PROMPT = "Write a short story about a robot that learns to paint."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--budget", default="25%")
    ap.add_argument("--tier", default="unified-slots")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    engine = vismmoe_edge.load(args.model, memory_budget=args.budget, tier=args.tier, device="cpu", pinned_layers=0)
    inputs = engine.encode(PROMPT, [])
    default = compute.ARRIVAL_MIN_BYTES
    trials: dict[str, list[dict]] = {"arrival": [], "wait-all": []}
    for rnd in range(args.rounds):
        order = ("arrival", "wait-all") if rnd % 2 == 0 else ("wait-all", "arrival")
        for mode in order:
            compute.ARRIVAL_MIN_BYTES = default if mode == "arrival" else math.inf  # inf: wait for every read
            pipeline = engine.experts.pipeline
            pipeline.clear()
            pipeline.reset_stats()
            sampling = SamplingConfig(max_new_tokens=args.tokens, min_new_tokens=args.tokens, temperature=1.0,
                                      seed=rnd)  # fmt: skip
            start = time.perf_counter()
            result = engine.generate_from_inputs(inputs, sampling)
            row = {"round": rnd, "decode_tokens_per_s": result.timings.decode_tokens_per_s,
                   "stall_s": pipeline.stats.stall_s, "misses": result.experts["misses"],
                   "bytes_read": result.experts["bytes_read"], "wall_s": time.perf_counter() - start}  # fmt: skip
            trials[mode].append(row)
            print(mode, {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    compute.ARRIVAL_MIN_BYTES = default
    summary = {mode: statistics.median(r["decode_tokens_per_s"] for r in rows) for mode, rows in trials.items()}
    ratio = summary["arrival"] / summary["wait-all"]
    print("median decode tok/s", {k: round(v, 2) for k, v in summary.items()}, "arrival / wait-all", round(ratio, 3))
    if args.json:
        report = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                  "date": time.strftime("%Y-%m-%d"), "model_layers": engine.language_model.config.num_hidden_layers,
                  "budget": args.budget, "tier": args.tier, "tokens": args.tokens, "trials": trials,
                  "median_tokens_per_s": summary, "arrival_over_wait_all": ratio}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
