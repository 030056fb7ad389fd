#!/usr/bin/env python3
"""Issue 7's recall table on Shapes-VQA: the learned lookahead predictor against the simple ones, on the test split
and on the shifted split (neither seen in training), from `vismmoe-edge calibrate` files of the trained demo model.

Trains both forms (window: one score per expert index; per_layer: one head per upcoming layer) on the train-split
calibration files, then scores every sample of the test files for the next MoE layer:
- learned (each form), random, static frequency (train split), previous token (decode samples: what the previous
  token used at i+1; prefill samples fall back to the current layer's shares), transfer (counted P(e' at i+1 | e
  at i) applied to the current shares), and next-layer gate (the next router on this layer's hidden states,
  recorded by calibrate while the model ran);
- hot recall@10/20/30 of layer i+1's top-20 experts, and wasted prefetch share, overall, per phase and per layer.

    python tools/analysis/predictor_shapes_eval.py --train cal/train-none.npz cal/train-affinity.npz \
        --test cal/test.npz --shifted cal/shifted.npz --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.predict.baselines import (  # noqa: E402
    current_layer_transfer_scores,
    frequency_scores,
    previous_token_scores,
    random_scores,
)
from vismmoe_edge.predict.calibration import DECODE, PREFILL, CalibrationSet, load_calibration  # noqa: E402
from vismmoe_edge.predict.lookahead import predict_scores, train_predictor  # noqa: E402
from vismmoe_edge.predict.metrics import hot_recall, wasted_prefetch_share  # noqa: E402

KS = (10, 20, 30)


def all_scores(models: dict[str, Any], train: CalibrationSet, test: CalibrationSet) -> dict[str, np.ndarray]:
    scores = {f"learned ({form})": predict_scores(model, test) for form, model in models.items()}
    scores["random"] = random_scores(test, np.random.default_rng(0))
    scores["static frequency"] = frequency_scores(train, test)
    scores["previous token"] = previous_token_scores(test)
    scores["transfer (current layer)"] = current_layer_transfer_scores(train, test)
    if test.next_gate is not None:
        scores["next-layer gate"] = test.next_gate
    return scores


def evaluate(scores: dict[str, np.ndarray], test: CalibrationSet, top_b: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, s in scores.items():
        row: dict[str, Any] = {
            "all": hot_recall(s, test.future, test.future_valid, KS, top_b, layer=test.layer),
            "wasted": wasted_prefetch_share(s, test.future, test.future_valid, KS),
        }
        for phase, label in ((PREFILL, "prefill"), (DECODE, "decode")):
            mask = test.phase == phase
            if mask.any():
                row[label] = hot_recall(s[mask], test.future[mask], test.future_valid[mask], KS, top_b)
        out[name] = row
    return out


def markdown(title: str, results: dict[str, Any]) -> list[str]:
    lines = [
        f"**{title}**",
        "",
        "| predictor | recall@10 | recall@20 | recall@30 | recall@20 prefill | recall@20 decode | wasted@20 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        a = r["all"]
        pre = r.get("prefill", {}).get("recall@20", float("nan"))
        dec = r.get("decode", {}).get("recall@20", float("nan"))
        lines.append(
            f"| {name} | {a['recall@10']:.3f} | {a['recall@20']:.3f} | {a['recall@30']:.3f} | {pre:.3f} | "
            f"{dec:.3f} | {r['wasted']['wasted@20']:.3f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=Path, nargs="+", required=True, help="one or more calibration files")
    parser.add_argument("--test", type=Path, required=True)
    parser.add_argument("--shifted", type=Path)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--top-b", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    parser.add_argument("--save-dir", type=Path, help="keep each form's predictor.pt here")
    args = parser.parse_args()

    train = CalibrationSet.concatenate([load_calibration(path) for path in args.train])
    models, curves = {}, {}
    for form in ("window", "per_layer"):
        models[form], c = train_predictor(train, form=form, epochs=args.epochs, top_b=args.top_b)
        curves[form] = c.to_dict()
        if args.save_dir:
            from vismmoe_edge.predict.checkpoint import save_checkpoint

            args.save_dir.mkdir(parents=True, exist_ok=True)
            save_checkpoint(args.save_dir / f"predictor-{form}.pt", models[form], c)
    record: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "command": "python " + " ".join(sys.argv),
        "train_samples": len(train),
        "num_layers": train.num_layers,
        "num_experts": train.num_experts,
        "top_b": args.top_b,
        "curves": curves,
        "splits": {},
    }
    lines: list[str] = []
    for label, path in (("test", args.test), ("shifted", args.shifted)):
        if path is None:
            continue
        test = load_calibration(path)
        results = evaluate(all_scores(models, train, test), test, args.top_b)
        record["splits"][label] = {"samples": len(test), "results": results}
        lines += markdown(f"Shapes-VQA {label} split ({len(test)} samples)", results) + [""]
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    if args.md:
        args.md.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
