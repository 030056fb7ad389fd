#!/usr/bin/env python3
"""CPU cost of the int4/int8 expert kernels and of every way to feed them, at expert shapes (docs/quantization.md).

For each matrix W [N, K] (nn.Linear orientation) and batch T it times, median of --repeats after a warm-up:
bf16 F.linear; `_weight_int4pack_mm_for_cpu` on bytes already in this CPU's tile layout (what a page-cache view
of our file gives); the kernel's own repack `_convert_weight_to_int4pack_for_cpu` (from int32 codes) and our
tensor-op repack from row-major nibbles (compressed-tensors' byte order) -- the per-fetch price of a portable
file; dequantize-then-F.linear from row-major nibbles; `_weight_int8pack_mm` and int8 dequantize-then-F.linear.
Weights are cold in the CPU caches, as when compute reads an expert from the page cache: each call uses the next
of enough copies to exceed --cold-mb (default 96 MB, 3x this VM's 32 MB L3). One thread by default: on a shared
2-core VM two threads measure the neighbours more than the kernels.

    python tools/bench/quant_cpu.py --out docs/results/quant-cpu-bench.json   # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vismmoe_edge.quant.packing import native_cpu_layout, pack_cpu_tiles, pack_rowmajor, unpack_rowmajor  # noqa: E402

SHAPES = {  # name: (N, K, group)
    "30b gate_up": (1536, 2048, 128),
    "30b down": (2048, 768, 128),
    "demo gate_up": (96, 192, 64),
    "demo down": (192, 48, None),  # K = 48: no kernel group size (32/64/128/256) divides it
}


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class Cold:
    """Copies of a tensor, handed out round-robin, so that each call reads memory the caches do not hold."""

    def __init__(self, t: torch.Tensor, cold_bytes: int) -> None:
        self.copies = [t.clone() for _ in range(max(1, -(-cold_bytes // t.nbytes)))]
        self.i = 0

    def __call__(self) -> torch.Tensor:
        self.i = (self.i + 1) % len(self.copies)
        return self.copies[self.i]


def bench_shape(
    n: int, k: int, group: int | None, batch: int, repeats: int, layout: str | None, cold_bytes: int
) -> dict[str, float]:
    g = torch.Generator().manual_seed(n * 7 + k)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    x = torch.randn(batch, k, generator=g).to(torch.bfloat16)
    w = Cold(torch.randn(n, k, generator=g).to(torch.bfloat16), cold_bytes)
    rowmajor = Cold(pack_rowmajor(codes), cold_bytes)
    eff_group = group or k
    scale = torch.rand(n, k // eff_group, generator=g).to(torch.bfloat16) * 0.01
    zero = torch.randn(n, k // eff_group, generator=g).to(torch.bfloat16) * 0.01
    out: dict[str, float] = {"bf16 linear": median_ms(lambda: F.linear(x, w()), repeats)}

    def dequant_linear() -> torch.Tensor:
        c = unpack_rowmajor(rowmajor()).view(n, -1, eff_group).to(torch.bfloat16)
        wq = ((c - 8) * scale[..., None] + zero[..., None]).view(n, k)
        return F.linear(x, wq)

    out["int4 dequant+linear (rowmajor)"] = median_ms(dequant_linear, repeats)
    if group is not None and layout is not None:
        tiles = Cold(pack_cpu_tiles(codes, layout), cold_bytes)
        sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [K/g, N, 2]
        out["int4 kernel, tiles in place"] = median_ms(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, tiles(), group, sz), repeats
        )
        codes32 = Cold(codes.to(torch.int32), cold_bytes)
        out["int4 repack: aten op from int32"] = median_ms(
            lambda: torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32(), 8), repeats
        )
        out["int4 repack: tensor ops from rowmajor"] = median_ms(
            lambda: pack_cpu_tiles(unpack_rowmajor(rowmajor()), layout), repeats
        )
        out["int4 scales [N,K/g]x2 -> [K/g,N,2]"] = median_ms(
            lambda: torch.stack([scale.t(), zero.t()], dim=-1).contiguous(), repeats
        )
    q8 = Cold(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), cold_bytes)
    s8 = torch.rand(n, generator=g).to(torch.bfloat16) * 0.01
    out["int8 kernel (_weight_int8pack_mm)"] = median_ms(
        lambda: torch.ops.aten._weight_int8pack_mm(x, q8(), s8), repeats
    )
    out["int8 dequant+linear"] = median_ms(lambda: F.linear(x, q8().to(torch.bfloat16) * s8[:, None]), repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON summary here")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold-mb", type=int, default=96, help="bytes of copies per operand (0: cache-hot)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=3, help="whole sweeps; the median over rounds is reported")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layout = native_cpu_layout()
    rounds: list[dict[str, dict[str, float]]] = []
    for _ in range(args.rounds):  # whole sweeps, so that a noisy neighbour hits every variant alike
        rounds.append({})
        for name, (n, k, group) in SHAPES.items():
            for batch in args.batches:
                key = f"{name} {n}x{k} T={batch}"
                rounds[-1][key] = bench_shape(n, k, group, batch, args.repeats, layout, args.cold_mb << 20)
    results = {
        key: {what: statistics.median(r[key][what] for r in rounds) for what in rounds[0][key]} for key in rounds[0]
    }
    for key, row in results.items():
        print(key)
        for what, ms in row.items():
            print(f"  {what:40s} {ms:9.3f} ms")
    summary = {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_cpu_layout": layout,
        "threads": args.threads,
        "machine": platform.machine(),
        "repeats": args.repeats,
        "rounds": args.rounds,
        "load_average": list(os.getloadavg()),
        "cold_mb": args.cold_mb,
        "median_ms": results,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
