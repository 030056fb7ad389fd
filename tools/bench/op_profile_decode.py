#!/usr/bin/env python3
"""Where a warm decode step's CPU time goes, by aten op (torch.profiler), all experts resident.

    python tools/bench/op_profile_decode.py MODEL_DIR [--tier unified] [--steps 8] [--threads 2]

Prints the step's median (under the profiler, which inflates Python time), the share of the step spent in aten
ops, and the top ops with their share of the step and calls per step. docs/benchmarks.md quotes it for int4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import vismmoe_edge
from vismmoe_edge.prompt import PromptInputs
from vismmoe_edge.sampling import SamplingConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tier", default="unified")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = vismmoe_edge.load(args.model, memory_budget="100%", tier=args.tier, device="cpu")
    ids = engine.processor.tokenizer(" ".join(f"word{i} is here" for i in range(64)))["input_ids"][:64]
    inputs = PromptInputs(input_ids=torch.tensor([ids]))
    list(engine.stream(inputs, SamplingConfig(max_new_tokens=6, min_new_tokens=6, temperature=1.0, seed=1)))  # warm
    logits, state = engine.prefill(inputs)
    token = int(logits.argmax())
    steps = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            logits = engine.decode_step(token, state)
            steps.append(time.perf_counter() - start)
            token = int(torch.multinomial(torch.softmax(logits.float(), -1), 1))
    total = sum(steps)
    ops = sorted(
        ((e.key, e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages() if e.key.startswith("aten::")),
        key=lambda r: -r[1],
    )
    print(json.dumps({
        "model": str(args.model),
        "step_ms_median_under_profiler": round(statistics.median(steps) * 1e3, 1),
        "aten_share_of_step": round(sum(s for _, s, _ in ops) / total, 3),
        "top_ops": [{"op": k, "share_of_step": round(s / total, 3), "calls_per_step": c // args.steps}
                    for k, s, c in ops[: args.top]],
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
