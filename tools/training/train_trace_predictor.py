"""Train a routing-history-only lookahead predictor on a real trace, for benchmarks that replay that trace.

    python tools/training/train_trace_predictor.py \
        --trace $TRACES/deepseek_v2_lite_chat_puffin_prefill_top6.npz \
        --layers 8 --experts 128 --test-from 160000 --out /tmp/trace-predictor.onnx

`vismmoe-edge --replay-trace` (and tools/bench/unified.py) maps model MoE layer i to trace layer i mod 26 and keeps
expert ids, so the predictor is trained on trace layers i mod 26 for i < L over the model's E experts (a 48-layer
model sees trace layers 0..25, then 0..21 again). Training uses only
prompts that end before token `--test-from` and whose content (blob) does not reappear after it: replays that
start at or after `--test-from` then test it on routing it never saw. The trace is read from its path only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.predict.from_ids import samples_from_ids  # noqa: E402
from vismmoe_edge.predict.lookahead import train_predictor  # noqa: E402
from vismmoe_edge.predict.onnx_runtime import check_export, export_onnx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--tokens-file", type=Path, help="the trace's *_tokens.jsonl (default: beside the trace)")
    ap.add_argument("--layers", type=int, default=8, help="the replaying model's MoE layers")
    ap.add_argument("--experts", type=int, default=128, help="the replaying model's experts per layer")
    ap.add_argument("--test-from", type=int, default=160_000, help="first trace token reserved for testing")
    ap.add_argument("--max-train-tokens", type=int, default=60_000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--form", default="per_layer", choices=["per_layer", "window"])
    ap.add_argument("--top-b", type=int, default=6, help="hot set per layer: a token routes to exactly k=6 here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    trace = np.load(args.trace)
    ids, offsets = trace["expert_ids"], trace["prompt_offsets"]
    tokens_file = args.tokens_file or args.trace.with_name(args.trace.name.replace("_top6.npz", "_tokens.jsonl"))
    blobs = [json.loads(line)["blob"] for line in tokens_file.read_text().splitlines() if line.strip()]
    starts, ends = offsets[:-1], offsets[1:]  # prompt i is ids[offsets[i]:offsets[i + 1]]
    layer_map = np.arange(args.layers) % ids.shape[1]  # model layer i replays trace layer i mod 26, as replay does
    test_blobs = {b for b, start in zip(blobs, starts, strict=True) if start >= args.test_from}
    rng = np.random.default_rng(args.seed)
    seen: set[str] = set()
    chunks, requests = [], []
    for n, (blob, start, end) in enumerate(zip(blobs, starts, ends, strict=True)):
        if end > args.test_from or blob in test_blobs or blob in seen or end <= start:
            continue
        seen.add(blob)
        chunks.append(ids[start:end][:, layer_map])
        requests.append(np.full(end - start, n))
    order = rng.permutation(len(chunks))
    picked, total = [], 0
    for i in order:  # whole prompts at random until the token budget is spent
        if total >= args.max_train_tokens:
            break
        picked.append(i)
        total += len(chunks[i])
    picked.sort()
    data = samples_from_ids(
        np.concatenate([chunks[i] for i in picked]), np.concatenate([requests[i] for i in picked]), args.experts
    )
    print(f"{len(picked)} distinct training prompts, {total} tokens, {len(data)} samples", flush=True)
    model, curves = train_predictor(
        data, form=args.form, epochs=args.epochs, lr=2e-3, batch_size=512, top_b=args.top_b, seed=args.seed
    )
    export_onnx(model, args.out)
    error = check_export(model, args.out)
    print(f"validation recall@20 by epoch: {[round(r, 3) for r in curves.val_recall20]}")
    print(f"wrote {args.out} (ONNX vs torch max difference {error:.1e})")


if __name__ == "__main__":
    main()
