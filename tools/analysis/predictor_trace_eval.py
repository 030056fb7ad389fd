#!/usr/bin/env python3
"""The learned lookahead predictor against ids-only baselines on a real per-token routing trace.

For the DeepSeek-V2-Lite prefill trace (expert_ids [tokens, 26 MoE layers, 6], prompt_offsets, plus a side file
*_tokens.jsonl with a `blob` per prompt; see shared/traces/README.md). The trace has no licence: it is read from
the path given and never copied anywhere.

- Prompts are deduplicated by blob, then split in order: the first 80% train, the rest test.
- Each token at each MoE layer i is a sample: history = its own ids at layers i, i-1, i-2 (one-hot / k shares),
  no hidden state (D = 0), future = its ids at layers i+1..i+W.
- Tokens are subsampled (a contiguous run of at most --max-prompt-tokens per prompt, prompts in random order
  until the budget) so that the run fits a small CPU machine; runs stay contiguous so "previous token" exists.
- top-B = 6 by default: one token routes to exactly k = 6 experts, so its whole routed set is the hot set.

Prints a markdown table of next-layer hot recall@10/20/30 and wasted prefetch share, and batch-1 latency of
one predictor call on the CPU (onnxruntime and torch). --json writes everything, with training curves.

    python tools/analysis/predictor_trace_eval.py --trace /path/to/deepseek_v2_lite_chat_puffin_prefill_top6.npz \
        --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vismmoe_edge.predict.baselines import (
    current_layer_transfer_scores,
    frequency_scores,
    previous_token_scores,
    random_scores,
)
from vismmoe_edge.predict.calibration import PREFILL, CalibrationSet
from vismmoe_edge.predict.from_ids import samples_from_ids
from vismmoe_edge.predict.lookahead import LookaheadMLP, predict_scores, train_predictor
from vismmoe_edge.predict.metrics import hot_recall, wasted_prefetch_share
from vismmoe_edge.predict.onnx_runtime import PredictorSession, TorchPredictorSession, check_export, export_onnx

KS = (10, 20, 30)


def load_prompts(trace: Path, tokens: Path) -> tuple[list[np.ndarray], list[str], int]:
    """(ids [t, L, k] per distinct prompt in trace order, their blobs, number of prompts before deduplication)."""
    with np.load(trace) as npz:
        ids, offsets = npz["expert_ids"], npz["prompt_offsets"]
    blobs = [json.loads(line)["blob"] for line in tokens.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(blobs) != len(offsets) - 1:
        sys.exit(f"{tokens}: {len(blobs)} prompts, but {trace} has {len(offsets) - 1}")
    seen: set[str] = set()
    prompts, kept = [], []
    for blob, start, end in zip(blobs, offsets[:-1], offsets[1:], strict=True):
        if blob in seen or end <= start:
            continue  # a byte-identical copy of an earlier prompt would leak across the split
        seen.add(blob)
        prompts.append(ids[start:end])
        kept.append(blob)
    return prompts, kept, len(blobs)


def subsample(
    prompts: list[np.ndarray], first_request: int, budget: int, max_run: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, L, k], request [T]): one contiguous run per prompt, prompts in random order, until `budget` tokens."""
    parts, requests, total = [], [], 0
    for p in rng.permutation(len(prompts)):
        if total >= budget:
            break
        ids = prompts[p]
        run = min(len(ids), max_run, budget - total)
        start = int(rng.integers(0, len(ids) - run + 1))
        parts.append(ids[start : start + run])
        requests.append(np.full(run, first_request + p, dtype=np.int64))
        total += run
    return np.concatenate(parts), np.concatenate(requests)


def latency(session: Any, inputs: tuple[np.ndarray, ...], calls: int) -> dict[str, float]:
    """P50/P99/mean milliseconds of one batch-1 call, after a warm-up."""
    for _ in range(min(50, calls)):
        session.run(*inputs)
    times = np.empty(calls)
    for n in range(calls):
        start = time.perf_counter()
        session.run(*inputs)
        times[n] = time.perf_counter() - start
    ms = times * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean())}


def batch_one(model: LookaheadMLP, test: CalibrationSet) -> tuple[np.ndarray, ...]:
    i = len(test) // 2
    onehot = np.zeros((1, test.num_layers), np.float32)
    onehot[0, test.layer[i]] = 1.0
    return test.history[i : i + 1].reshape(1, -1), test.hidden[i : i + 1], test.visual[i : i + 1], onehot


def time_predictors(models: dict[str, LookaheadMLP], test: CalibrationSet, calls: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same one thread as the onnxruntime session: a batch-1 MLP gains nothing from more
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for form, model in models.items():
                path = export_onnx(model, Path(tmp) / f"{form}.onnx")
                inputs = batch_one(model, test)
                onnx_session = PredictorSession(path, prefer_gpu=False, threads=1)
                out[form] = {
                    "onnx_bytes": path.stat().st_size,
                    "export_max_abs_diff": check_export(model, path),
                    "onnxruntime_cpu": latency(onnx_session, inputs, calls),
                    "torch_cpu": latency(TorchPredictorSession(model), inputs, calls),
                    "provider": onnx_session.provider,
                    "threads": 1,
                }
    finally:
        torch.set_num_threads(threads)
    return out


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    head = "| predictor | " + " | ".join(f"recall@{k}" for k in KS) + " | " + " | ".join(f"wasted@{k}" for k in KS)
    lines = [head + " |", "|---" * (1 + 2 * len(KS)) + "|"]
    for name, r in rows.items():
        cells = [f"{r['recall'][f'recall@{k}']:.3f}" for k in KS] + [f"{r['wasted'][f'wasted@{k}']:.3f}" for k in KS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="deepseek_v2_lite_chat_puffin_prefill_top6.npz")
    parser.add_argument("--tokens", type=Path, help="the *_tokens.jsonl side file (default: beside the trace)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--train-tokens", type=int, default=40000)
    parser.add_argument("--test-tokens", type=int, default=20000)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="longest run of tokens from one prompt")
    parser.add_argument("--train-share", type=float, default=0.8, help="first share of distinct prompts to train on")
    parser.add_argument("--history", type=int, default=3)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--top-b", type=int, default=6, help="hot-set size: 6 = one token's whole routed set")
    parser.add_argument("--gamma", type=float, default=0.8)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-calls", type=int, default=2000)
    args = parser.parse_args()
    tokens = args.tokens or args.trace.with_name(args.trace.name.replace("_top6.npz", "_tokens.jsonl"))
    if not args.trace.is_file() or not tokens.is_file():
        sys.exit(f"need both {args.trace} and {tokens} (--tokens)")
    started = time.time()

    prompts, _, total_prompts = load_prompts(args.trace, tokens)
    num_experts = int(max(int(p.max()) for p in prompts)) + 1
    cut = int(round(args.train_share * len(prompts)))
    rng = np.random.default_rng(args.seed)
    train_ids, train_req = subsample(prompts[:cut], 0, args.train_tokens, args.max_prompt_tokens, rng)
    test_ids, test_req = subsample(prompts[cut:], cut, args.test_tokens, args.max_prompt_tokens, rng)
    build = dict(history=args.history, window=args.window, phase=PREFILL)
    train = samples_from_ids(train_ids, train_req, num_experts, **build)
    test = samples_from_ids(test_ids, test_req, num_experts, **build)
    print(
        f"{total_prompts} prompts, {len(prompts)} distinct: train {cut} prompts ({len(train_ids)} tokens sampled, "
        f"{len(train)} samples), test {len(prompts) - cut} ({len(test_ids)} tokens, {len(test)} samples); "
        f"{train.num_layers} MoE layers x {num_experts} experts, top-{train.top_k}",
        file=sys.stderr,
    )

    models, curves, scores = {}, {}, {}
    for form in ("window", "per_layer"):
        models[form], fit = train_predictor(
            train, form=form, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, val_requests=0.1,
            seed=args.seed, top_b=args.top_b, gamma=args.gamma, width=args.width,
        )  # fmt: skip
        curves[form] = fit.to_dict()
        scores[f"learned ({form})"] = predict_scores(models[form], test)
    scores["random"] = random_scores(test, np.random.default_rng(args.seed))
    scores["frequency"] = frequency_scores(train, test)
    scores["current-layer transfer"] = current_layer_transfer_scores(train, test)
    scores["previous token"] = previous_token_scores(test, per_token_phases=(PREFILL,))

    rows = {}
    for name, s in scores.items():
        rows[name] = {
            "recall": hot_recall(s, test.future, test.future_valid, KS, args.top_b, layer=test.layer),
            "wasted": wasted_prefetch_share(s, test.future, test.future_valid, KS, layer=test.layer),
        }
    timings = time_predictors(models, test, args.timing_calls)

    title = f"Next layer (i+1): hot recall and wasted prefetch share, top-B = {args.top_b}, {len(test_ids)} test tokens"
    print(f"\n{title}\n")
    print(markdown(rows))
    print("\nOne predictor call, batch 1, CPU, 1 thread (ms):\n")
    print("| form | onnxruntime P50 | onnxruntime P99 | torch P50 | torch P99 |\n|---|---|---|---|---|")
    for form, t in timings.items():
        o, p = t["onnxruntime_cpu"], t["torch_cpu"]
        print(f"| {form} | {o['p50_ms']:.3f} | {o['p99_ms']:.3f} | {p['p50_ms']:.3f} | {p['p99_ms']:.3f} |")
    if args.json:
        result = {
            "trace": str(args.trace),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "data": {
                "prompts": total_prompts, "distinct_prompts": len(prompts), "train_prompts": cut,
                "test_prompts": len(prompts) - cut, "train_tokens": len(train_ids), "test_tokens": len(test_ids),
                "train_samples": len(train), "test_samples": len(test), "num_layers": train.num_layers,
                "num_experts": num_experts, "top_k": train.top_k,
            },  # fmt: skip
            "metrics": rows,
            "curves": curves,
            "timing": timings,
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
            "seconds": round(time.time() - started, 1),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
