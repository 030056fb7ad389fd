#!/usr/bin/env python3
"""Issue 6's measurements: accuracy and expert demand of every compressor at several keep ratios, in one run.

For each (compressor, keep ratio), on a freshly loaded engine (same cold cache for every setting):
- accuracy: `vismmoe_edge.evaluation.vqa.evaluate` over the first `--limit` questions of the split (the seed paper's
  Table 3 form), with expert traffic (bytes read) through prefill and decode;
- expert demand during prefill: `vismmoe_edge.evaluation.analyze.analyze_compressor` over the first `--analyze-limit`
  prompts
  on another fresh engine: unique experts per layer, bytes read per layer, prefill time (its Figure 3 form) and
  next-layer NMI per layer (its Figure 4 form).

Writes JSON (`--json`), a markdown report (`--md`) and two plots (`--plots DIR`): unique experts per layer and
next-layer NMI per layer, one line per compressor at each keep ratio.

    python tools/analysis/compression_sweep.py --model vismmoe_edge/demo_model --split test --limit 500 \
        --ratios 0.7,0.5 --memory-budget 40% --pinned-layers 2 --json docs/compression-sweep.json \
        --md docs/compression-sweep.md --plots docs/figures
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

from vismmoe_edge.compress.prune import CompressionConfig  # noqa: E402
from vismmoe_edge.evaluation.analyze import analyze_compressor  # noqa: E402
from vismmoe_edge.evaluation.vqa import evaluate, shapes_vqa_items  # noqa: E402
from vismmoe_edge.loader import load  # noqa: E402
from vismmoe_edge.units import format_bytes  # noqa: E402

COMPRESSORS = ("random", "saliency", "zip", "affinity")


def settings(ratios: list[float], compressors: list[str]) -> list[tuple[str, float]]:
    return [("none", 1.0)] + [(m, r) for r in ratios for m in compressors if m != "none"]  # none: once, at 100%


def run_setting(args: argparse.Namespace, method: str, ratio: float, items: list, analyze_items: list) -> dict:
    config = CompressionConfig(method, ratio if method != "none" else 0.7, args.salient_ratio, args.affinity_weight)

    def fresh():
        engine = load(
            args.model, memory_budget=args.memory_budget, pinned_layers=args.pinned_layers, device=args.device,
            tier=args.tier, predictor="none",
        )  # fmt: skip
        engine.compression = config
        return engine

    engine = fresh()
    report = evaluate(engine, items, progress=True)
    engine.experts.pipeline.close()
    engine = fresh()
    stats = analyze_compressor(engine, analyze_items, config, progress=True).summary()
    engine.experts.pipeline.close()
    return {
        "compressor": method,
        "keep_ratio": ratio,
        "accuracy": report.accuracy,
        "questions": report.counts["overall"],
        "eval_bytes_read": report.experts.get("bytes_read", 0.0),
        "eval_prefill_ms_median": report.prefill_ms_median,
        "kept_visual_tokens_mean": report.kept_visual_tokens_mean,
        "visual_tokens_mean": report.visual_tokens_mean,
        "prefill": stats,
    }


def after_cut(values: list[float], cut: int) -> float:
    tail = values[cut:] or values
    return statistics.fmean(tail)


def markdown(record: dict[str, Any]) -> list[str]:
    cut = record["pinned_layers"]
    families = [f for f in record["rows"][0]["accuracy"] if f != "overall"]
    lines = [
        f"Model `{record['model']}`, Shapes-VQA {record['split']} ({record['rows'][0]['questions']} questions for "
        f"accuracy, {record['analyze_prompts']} prompts for expert demand), memory budget {record['memory_budget']}"
        f", {cut} pinned MoE layers, {record['machine']}, {record['date']}. Command: `{record['command']}`.",
        "",
        "| compressor | keep | overall | " + " | ".join(families) + " | visual tokens kept | "
        "unique experts/layer (after cut) | bytes read, prefill | prefill ms | next-layer NMI (after cut) |",
        "|---|---:|---:|" + "---:|" * len(families) + "---:|---:|---:|---:|---:|",
    ]
    for row in record["rows"]:
        p = row["prefill"]
        acc = row["accuracy"]
        lines.append(
            f"| {row['compressor']} | {row['keep_ratio']:.0%} | **{acc['overall']:.1%}** | "
            + " | ".join(f"{acc.get(f, float('nan')):.1%}" for f in families)
            + f" | {row['kept_visual_tokens_mean']:.0f} / {row['visual_tokens_mean']:.0f} | "
            f"{after_cut(p['unique_experts_per_layer'], cut):.2f} | {format_bytes(p['bytes_read'])} | "
            f"{p['prefill_ms_median']:.0f} | {after_cut(p['next_layer_nmi_per_layer'], cut):.3f} |"
        )
    return lines


def plot(record: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    ratios = sorted({r["keep_ratio"] for r in record["rows"] if r["compressor"] != "none"}, reverse=True)
    baseline = next(r for r in record["rows"] if r["compressor"] == "none")
    paths = []
    for key, label, name in (
        ("unique_experts_per_layer", "unique experts per prompt", "compression-unique-experts.png"),
        ("next_layer_nmi_per_layer", "NMI of top-1 experts, layer l vs l+1", "compression-next-layer-nmi.png"),
    ):
        fig, axes = plt.subplots(1, len(ratios), figsize=(6 * len(ratios), 4), sharey=True, squeeze=False)
        for ax, ratio in zip(axes[0], ratios, strict=True):
            ax.plot(baseline["prefill"][key], "k--", label="none (100%)")
            for row in record["rows"]:
                if row["keep_ratio"] == ratio and row["compressor"] != "none":
                    ax.plot(row["prefill"][key], marker="o", label=row["compressor"])
            ax.axvline(record["pinned_layers"] - 0.5, color="grey", linewidth=1)
            ax.set_title(f"keep {ratio:.0%} (grey line: end of the pinned prefix)")
            ax.set_xlabel("MoE layer" + (" pair" if "nmi" in key else ""))
            ax.set_ylabel(label)
            ax.legend()
        path = out_dir / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--split", default="test")
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--analyze-limit", type=int, default=60)
    parser.add_argument("--ratios", default="0.7,0.5")
    parser.add_argument("--compressors", default=",".join(COMPRESSORS))
    parser.add_argument("--salient-ratio", type=float, default=0.3)
    parser.add_argument("--affinity-weight", type=float, default=2.0)
    parser.add_argument("--memory-budget", default="40%")
    parser.add_argument("--pinned-layers", type=int, default=2)
    parser.add_argument("--tier", default="host")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--plots", type=Path)
    args = parser.parse_args()
    items = shapes_vqa_items(args.split, args.limit)
    analyze_items = items[: args.analyze_limit]
    rows = []
    ratios = [float(r) for r in args.ratios.split(",")]
    for method, ratio in settings(ratios, args.compressors.split(",")):
        print(f"== {method} keep {ratio:.0%}", flush=True)
        rows.append(run_setting(args, method, ratio, items, analyze_items))
        print(f"   accuracy {rows[-1]['accuracy']['overall']:.1%}", flush=True)
    record = {
        "model": str(args.model),
        "split": args.split,
        "analyze_prompts": len(analyze_items),
        "memory_budget": args.memory_budget,
        "pinned_layers": args.pinned_layers,
        "tier": args.tier,
        "machine": f"{platform.machine()}, {args.device}",
        "date": datetime.date.today().isoformat(),
        "command": "python " + " ".join(sys.argv),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    lines = markdown(record)
    if args.md:
        args.md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.plots:
        for path in plot(record, args.plots):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
