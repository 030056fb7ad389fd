#!/usr/bin/env python3
"""The seed paper's Table 4 as an ablation on the trained demo model: base pipeline, + compression, + learned
prediction, + both; and the simple predictors beside them. Real routing: the trained model on real questions.

Each configuration gets a fresh engine per round (the same cold cache), then answers the same prompts: a Shapes-VQA
test image with "List the objects from left to right.", sampled at temperature 1 for exactly --max-new-tokens
tokens (the model's own answers are 1-3 tokens, too few to time decode; sampling keeps routing real, where
greedy decoding past the end of an answer would repeat itself). Seeds are fixed per prompt, so every
configuration decodes the same tokens (prediction does not change the model's outputs; compression may). Rounds
interleave the configurations so that drift on a noisy machine hits all of them alike. Reports medians over
prompts and rounds: prefill ms, decode tokens/s, bytes read per request, hit rate, stall, and ratios against the
base pipeline measured in the same run.

    python tools/bench/ablation.py --model vismmoe_edge/demo_model --predictor-file predictor.onnx \
        --device cpu --tier unified --memory-budget 40% --pinned-layers 2 --prompts 8 --rounds 3 --json out.json
On the GPU server: --device cuda --tier gpu.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CAPTION = "List the objects from left to right."
CONFIGS = {  # name -> (predictor, compressor)
    "base pipeline": ("none", "none"),
    "+ compression": ("none", "affinity"),
    "+ learned prediction": ("learned-file", "none"),
    "+ both": ("learned-file", "affinity"),
    "previous-token": ("previous-token", "none"),
    "next-layer-gate": ("next-layer-gate", "none"),
    "previous-token + compression": ("previous-token", "affinity"),
}


def run_config(args: argparse.Namespace, name: str, images: list) -> list[dict[str, float]]:
    import vismmoe_edge
    from vismmoe_edge.compress.prune import CompressionConfig
    from vismmoe_edge.sampling import SamplingConfig

    predictor, compressor = CONFIGS[name]
    engine = vismmoe_edge.load(
        args.model, memory_budget=args.memory_budget, pinned_layers=args.pinned_layers, device=args.device,
        tier=args.tier, predictor=str(args.predictor_file) if predictor == "learned-file" else predictor,
    )  # fmt: skip
    engine.compression = CompressionConfig(compressor, args.keep_ratio)
    rows = []
    for n, image in enumerate(images):
        n_new = args.max_new_tokens
        sampling = SamplingConfig(max_new_tokens=n_new, min_new_tokens=n_new, temperature=1.0, seed=n)
        result = engine.generate(CAPTION, [image], sampling)
        t, x = result.timings, result.experts
        rows.append(
            {
                "prefill_ms": t.prefill_s * 1000,
                "decode_tokens_per_s": t.decode_tokens_per_s,
                "decode_tokens": t.decode_tokens,
                "bytes_read": x.get("bytes_read", 0.0),
                "hit_rate": x.get("hit_rate", 0.0),
                "stall_ms": x.get("stall_s", 0.0) * 1000,
                "speculative_bytes": x.get("speculative_bytes", 0.0),
                "wasted_speculative_bytes": x.get("wasted_speculative_bytes", 0.0),
            }
        )
    engine.experts.pipeline.close()
    return rows


def summarise(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--predictor-file", type=Path, required=True, help="the exported learned predictor (.onnx)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tier", default="unified")
    parser.add_argument("--memory-budget", default="40%")
    parser.add_argument("--pinned-layers", type=int, default=2)
    parser.add_argument("--keep-ratio", type=float, default=0.7)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch
    from tqdm import tqdm

    from vismmoe_edge.evaluation.vqa import shapes_vqa_items

    if args.device == "cpu":
        torch.set_num_threads(2)
    images = [item.load() for item in shapes_vqa_items("test", args.prompts)]
    names = [n.strip() for n in args.configs.split(",")]
    per_config: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tqdm(total=args.rounds * len(names), desc="ablation") as bar:
        for round_ in range(args.rounds):
            order = names if round_ % 2 == 0 else names[::-1]
            for name in order:
                per_config[name] += run_config(args, name, images)
                bar.update(1)
    table = {name: summarise(rows) for name, rows in per_config.items()}
    base = table[names[0]]
    lines = [
        f"{args.model}, {args.device} / tier {args.tier}, budget {args.memory_budget}, {args.pinned_layers} pinned "
        f"layers, keep {args.keep_ratio:.0%} when compressing; {args.prompts} prompts x {args.rounds} rounds; "
        f"medians; {platform.machine()} {datetime.date.today().isoformat()}",
        "",
        "| configuration | prefill ms | vs base | decode tok/s | vs base | bytes read / request | hit rate "
        "| stall ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in table.items():
        lines.append(
            f"| {name} | {s['prefill_ms']:.1f} | {base['prefill_ms'] / s['prefill_ms']:.2f}x | "
            f"{s['decode_tokens_per_s']:.1f} | {s['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x | "
            f"{s['bytes_read'] / 2**20:.2f} MiB | {s['hit_rate']:.1%} | {s['stall_ms']:.1f} |"
        )
    print("\n".join(lines))
    if args.json:
        record: dict[str, Any] = {
            "command": "python " + " ".join(sys.argv),
            "date": datetime.date.today().isoformat(),
            "machine": platform.machine(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
            "table": table,
            "per_prompt": per_config,
            "markdown": lines,
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
