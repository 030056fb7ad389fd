#!/usr/bin/env python3
"""Latency of the visual-token compressors for one image, on CPU and (if present) CUDA.

Times the keep-set selectors (affinity_keep, saliency_keep, zip_keep, random_keep) for N visual tokens with an
L-layer pinned prefix routed top-k over E experts, and attention_received for 4N patches with Qwen3-VL-30B's
vision geometry (16 heads, head dim 80). Each op gets warm-up runs, then timed runs (CUDA synchronised before and
after each; attention_received takes about a second on a desktop CPU, so it gets 20 runs there unless --attn-runs
says otherwise); prints P50/P99 as a markdown table, and writes JSON with --json.

    python tools/bench/compressor.py --n 1089 --runs 200 --json /tmp/compressor.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from vismmoe_edge.compress import affinity_keep, attention_received, random_keep, saliency_keep, zip_keep


@dataclass
class Row:
    device: str
    op: str
    shape: str
    runs: int
    p50_ms: float
    p99_ms: float


def time_op(fn: Callable[[], object], device: torch.device, warmup: int, runs: int, label: str) -> list[float]:
    """Milliseconds per call; on CUDA each call is bracketed by synchronisations so queued work is counted."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in tqdm(range(runs), desc=label, leave=False):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def bench_device(device: torch.device, args: argparse.Namespace) -> list[Row]:
    g = torch.Generator(device=device).manual_seed(0)
    n, layers, top_k, experts = args.n, args.layers, args.top_k, args.experts
    saliency = torch.rand(n, generator=g, device=device)
    # Distinct experts per (token, layer), like real top-k routing.
    routes = torch.rand(n, layers, experts, generator=g, device=device).argsort(dim=-1)[..., :top_k].contiguous()
    hidden = torch.randn(n, args.hidden, generator=g, device=device)
    patches = 4 * n
    q = torch.randn(args.heads, patches, args.head_dim, generator=g, device=device)
    k = torch.randn(args.heads, patches, args.head_dim, generator=g, device=device)

    sel_shape = f"N={n} L={layers} k={top_k} E={experts}"
    ops: list[tuple[str, str, Callable[[], object], int]] = [
        ("affinity_keep", sel_shape, lambda: affinity_keep(saliency, routes, args.keep, args.salient), args.runs),
        ("saliency_keep", f"N={n}", lambda: saliency_keep(saliency, args.keep), args.runs),
        ("zip_keep", f"N={n} H={args.hidden}", lambda: zip_keep(saliency, hidden, args.keep), args.runs),
        ("random_keep", f"N={n}", lambda: random_keep(n, args.keep, g), args.runs),
        (
            "attention_received",
            f"heads={args.heads} P={patches} d={args.head_dim} chunk={args.chunk}",
            lambda: attention_received(q, k, chunk=args.chunk),
            args.attn_runs or (args.runs if device.type == "cuda" else min(args.runs, 20)),
        ),
    ]
    rows = []
    for name, shape, fn, runs in ops:
        ms = time_op(fn, device, args.warmup, runs, f"{device.type} {name}")
        rows.append(Row(device.type, name, shape, runs, float(np.percentile(ms, 50)), float(np.percentile(ms, 99))))
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| device | op | shape | runs | P50 ms | P99 ms |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r.device} | {r.op} | {r.shape} | {r.runs} | {r.p50_ms:.3f} | {r.p99_ms:.3f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1089, help="visual tokens of one image (1089 = a 33x33 token grid)")
    p.add_argument("--layers", type=int, default=3, help="pinned-prefix MoE layers L")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048, help="hidden size for zip_keep's similarities")
    p.add_argument("--keep", type=float, default=0.25, help="keep ratio beta")
    p.add_argument("--salient", type=float, default=0.1, help="salient core ratio alpha")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=80)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument(
        "--attn-runs", type=int, default=None, help="timed runs of attention_received (default: --runs; 20 on CPU)"
    )
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--cpu-only", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    devices = [torch.device("cpu")]
    if torch.cuda.is_available() and not args.cpu_only:
        devices.append(torch.device("cuda"))
    rows = [row for d in devices for row in bench_device(d, args)]
    print(markdown(rows))

    if args.json:
        meta = {
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cpu_threads": torch.get_num_threads(),
            "cuda_device": torch.cuda.get_device_name() if "cuda" in [d.type for d in devices] else None,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")


if __name__ == "__main__":
    main()
