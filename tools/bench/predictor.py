"""Latency of one lookahead-predictor call (batch 1) at a model's geometry: onnxruntime and torch on CPU, torch on
CUDA when present (onnxruntime-gpu cannot be installed on the offline GPU server).

    python tools/bench/predictor.py --layers 48 --experts 128 --hidden 2048 --json out.json   # Qwen3-VL-30B-A3B
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.predict.lookahead import LookaheadMLP  # noqa: E402
from vismmoe_edge.predict.onnx_runtime import PredictorSession, export_onnx, random_inputs  # noqa: E402


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
    }


def time_calls(call, runs: int, warmup: int, sync=None, desc: str = "") -> dict[str, float]:
    for _ in range(warmup):
        call()
    samples = []
    for _ in tqdm(range(runs), desc=desc, leave=False):
        start = time.perf_counter()
        call()
        if sync is not None:
            sync()
        samples.append(time.perf_counter() - start)
    return percentiles(samples)


def time_form(form: str, args: argparse.Namespace) -> list[dict]:
    model = LookaheadMLP(args.layers, args.experts, args.hidden, form=form).eval()
    inputs = random_inputs(model.metadata(), batch=1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        session = PredictorSession(export_onnx(model, Path(tmp) / "p.onnx"), prefer_gpu=False, threads=args.threads)
        timing = time_calls(lambda: session.run(*inputs), args.runs, args.warmup, desc=form)
        rows.append({"form": form, "runtime": f"onnxruntime {session.provider}", **timing})
    tensors = [torch.from_numpy(a) for a in inputs]
    with torch.inference_mode():
        timing = time_calls(lambda: model(*tensors), args.runs, args.warmup, desc=form)
        rows.append({"form": form, "runtime": "torch cpu", **timing})
        if torch.cuda.is_available():
            gpu, on_gpu = model.cuda(), [t.cuda() for t in tensors]
            # a call ends when its scores are on the host: the pipeline needs them there
            timing = time_calls(lambda: torch.sigmoid(gpu(*on_gpu)).cpu(), args.runs, args.warmup, desc=form)
            rows.append({"form": form, "runtime": f"torch {torch.cuda.get_device_name(0)}", **timing})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for form in ("per_layer", "window"):
        rows += time_form(form, args)
    print(f"| form | runtime | P50 ms | P99 ms |  (L={args.layers}, E={args.experts}, D={args.hidden}, batch 1)")
    print("|---|---|---:|---:|")
    for r in rows:
        print(f"| {r['form']} | {r['runtime']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
