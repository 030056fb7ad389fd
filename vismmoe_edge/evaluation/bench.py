"""What `vismmoe-edge bench` measures: time one configuration on this machine: prefill, decode tokens/s, expert traffic.

Decode is sampled (temperature 1) or replays routing from a trace, never greedy: greedy decoding on random
weights repeats one token and makes any cache look perfect. Each trial reports the bytes Belady's optimal
eviction would have moved for the same routing at the same slot count, the bound every policy is judged by.
The comparisons under a memory cgroup and against other engines live in tools/bench/unified.py and
tools/bench/discrete.py.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any


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


