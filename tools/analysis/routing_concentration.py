#!/usr/bin/env python3
"""How concentrated a run's decode routing is, layer by layer, against a uniform router of the same top-k.

    vismmoe-edge run --model M --image IMG --max-new-tokens 33 --temperature 0.7 --top-p 0.9 --seed 0 \\
        --device cpu --tier unified --memory-budget B --pinned-layers 3 --trace-out run.jsonl
    python tools/analysis/routing_concentration.py run.jsonl [--bands 3,12,24,36] [--per-layer]

From the `--trace-out` JSONL: for the decode tokens (D of them) at each MoE layer, the distinct experts they used
(uniform: E (1 - (1 - k/E)^D)), the entropy of the layer's expert counts against the mean of 200 uniform draws of
the same D tokens, the share of a token's k experts that the previous token also used (uniform: k/E), and the
engine's own decode hit rate there (the trace's hits / (hits + misses), pinned layers included). Layers are
summarised in bands (first layer of each band after the first); `--per-layer` prints every layer.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

NULL_DRAWS = 200


def read_decode(path: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """(header, expert ids [D, L, k] of the decode tokens in order, engine hits/misses [D, L, 2])."""
    header, ids, cache = None, [], []
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if obj["type"] == "header":
            header = obj
        elif obj["type"] == "step" and obj["phase"] == "decode":
            ids.append([layer["experts"][0] for layer in obj["layers"]])
            cache.append([(layer.get("hits", 0), layer.get("misses", 0)) for layer in obj["layers"]])
    if header is None or not ids:
        raise SystemExit(f"{path}: no header or no decode step")
    return header, np.asarray(ids, dtype=np.int64), np.asarray(cache, dtype=np.int64)


def entropy_bits(ids: np.ndarray, experts: int) -> float:
    counts = np.bincount(ids.ravel(), minlength=experts).astype(float)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def layer_stats(ids: np.ndarray, experts: int, rng: np.random.Generator) -> dict:
    """ids: [D, k] one layer's decode sets."""
    tokens, k = ids.shape
    null = [entropy_bits(np.argsort(rng.random((tokens, experts)), axis=1)[:, :k], experts) for _ in range(NULL_DRAWS)]
    overlap = [len(set(a) & set(b)) / k for a, b in zip(ids[1:].tolist(), ids[:-1].tolist(), strict=True)]
    mean_overlap = float(np.mean(overlap)) if overlap else math.nan
    return {"distinct": len(np.unique(ids)), "entropy": entropy_bits(ids, experts),
            "entropy_uniform": float(np.mean(null)), "overlap": mean_overlap}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="a `vismmoe-edge run --trace-out` JSONL file")
    ap.add_argument("--bands", default="3,12,24,36", help="first MoE-layer position of each band after the first")
    ap.add_argument("--per-layer", action="store_true", help="one row per layer instead of bands")
    ap.add_argument("--seed", type=int, default=0, help="seed of the uniform null draws")
    args = ap.parse_args(argv)
    header, ids, cache = read_decode(args.trace)
    experts, k = int(header["num_experts"]), int(header["top_k"])
    tokens, layers = ids.shape[0], ids.shape[1]
    rng = np.random.default_rng(args.seed)
    stats = [layer_stats(ids[:, i], experts, rng) for i in range(layers)]
    cuts = list(range(layers + 1)) if args.per_layer else [0, *(int(x) for x in args.bands.split(",")), layers]
    print(f"{args.trace.name}: {tokens} decode tokens, {layers} MoE layers x {experts} experts (top-{k})")
    print(f"uniform router: {experts * (1 - (1 - k / experts) ** tokens):.1f} distinct experts per layer, "
          f"{stats[0]['entropy_uniform']:.2f} bits, previous-token overlap {k / experts:.3f}")  # fmt: skip
    print()
    print("| MoE layers | distinct experts (mean, min) | entropy bits (uniform draws) | previous-token overlap | "
          "engine decode hit rate |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        if hi <= lo:
            continue
        band = stats[lo:hi]
        hits, misses = cache[:, lo:hi, 0].sum(), cache[:, lo:hi, 1].sum()
        name = f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}"
        print(f"| {name} | {np.mean([s['distinct'] for s in band]):.1f}, {min(s['distinct'] for s in band)} | "
              f"{np.mean([s['entropy'] for s in band]):.2f} ({np.mean([s['entropy_uniform'] for s in band]):.2f}) | "
              f"{np.nanmean([s['overlap'] for s in band]):.3f} | {hits / max(hits + misses, 1):.1%} |")  # fmt: skip
    hits, misses = cache[..., 0].sum(), cache[..., 1].sum()
    print()
    print(f"engine decode hit rate, all layers: {hits / max(hits + misses, 1):.1%} "
          f"({misses / tokens:.1f} of {layers * k} experts missed per token)")  # fmt: skip


if __name__ == "__main__":
    main()
