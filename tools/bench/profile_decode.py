#!/usr/bin/env python3
"""Where does one decode step spend its time? cProfile over a few steps of a loaded engine."""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

import vismmoe_edge

if "--no-cudnn-sdpa" in sys.argv:
    sys.argv.remove("--no-cudnn-sdpa")
    torch.backends.cuda.enable_cudnn_sdp(False)
model_dir = Path(sys.argv[1])
budget = sys.argv[2] if len(sys.argv) > 2 else "100%"
engine = vismmoe_edge.load(model_dir, memory_budget=budget)
inputs = engine.encode("Describe the picture.", None)
logits, state = engine.prefill(inputs)
for token in (5, 6, 7):
    engine.decode_step(token, state)
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
sync()
start = time.perf_counter()
profiler = cProfile.Profile()
profiler.enable()
for token in range(10, 30):
    logits = engine.decode_step(token, state)
    int(torch.argmax(logits))
sync()
profiler.disable()
print(f"{(time.perf_counter() - start) / 20 * 1000:.1f} ms per decode step")
pstats.Stats(profiler).sort_stats("tottime").print_stats(8)
if torch.cuda.is_available():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for token in range(30, 35):
            engine.decode_step(token, state)
        sync()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
