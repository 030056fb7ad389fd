#!/usr/bin/env python3
"""Does the suffix attention compile again for a real follow-up after the daemon's warm-up? (issue 26, run 13)

Run 13's daemon warmed the compiled suffix attention (kernels/suffix_layer.py) over (24 reused, 8 tokens) and
(40, 16), yet its first real follow-up (1,094 reused, 20 tokens padded to 32) took 3.08 s. The suspect, from
torch's source: on CUDA inductor guards the attention mask's strides on alignment to 8 elements
(torch/_inductor/ir.py `is_aligned_realized_tensor`), and the mask's row stride is reused + padded positions:
32 and 56 are aligned, 1,126 is not. This compiles `attend_rows` at 30B-A3B's attention shapes (random bf16
weights, no checkpoint) for each list of warm shapes, the old two and suffix_graph.WARM_SHAPES, then runs real
follow-up shapes and counts the graphs dynamo compiled for them. Seconds on a GPU; runs on the CPU too (where
inductor has no such guard).

    TORCH_LOGS=recompiles python3 tools/device/suffix_guard_check.py --out $OUT/suffix_guard.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.kernels.decode_layer import AttentionShape  # noqa: E402
from vismmoe_edge.kernels.suffix_layer import make_attend_rows  # noqa: E402
from vismmoe_edge.suffix_graph import WARM_SHAPES, padded_length  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K = 2048, 32, 4, 128, 128, 8  # Qwen3-VL-30B-A3B's text model
FOLLOW_UPS = ((1094, 20), (1101, 20), (1096, 8), (517, 40))


def run(device: torch.device, warm: tuple[tuple[int, int], ...]) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    shape = AttentionShape(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, 1e-6, TOP_K)
    fn = torch.compile(make_attend_rows(shape), fullgraph=True)
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(device, torch.bfloat16)

    q = torch.cat([w(HEADS * HEAD_DIM, HIDDEN), w(KV_HEADS * HEAD_DIM, HIDDEN), w(KV_HEADS * HEAD_DIM, HIDDEN)])
    # (q, k and v stacked, as SuffixLayers stacks them where it compiles)
    ones = lambda n: torch.ones(n, device=device, dtype=torch.bfloat16)  # noqa: E731
    kv = KV_HEADS * HEAD_DIM
    weights = (ones(HIDDEN), q, w(kv, HIDDEN), w(kv, HIDDEN), w(HIDDEN, HEADS * HEAD_DIM), ones(HEAD_DIM),
               ones(HEAD_DIM), ones(HIDDEN), w(EXPERTS, HIDDEN))  # fmt: skip

    @torch.inference_mode()
    def call(reused: int, tokens: int) -> float:
        rows = padded_length(tokens)
        mask = torch.full((rows, reused + rows), float("-inf"), device=device, dtype=torch.bfloat16)
        mask = torch.triu(mask, diagonal=reused + 1).view(1, 1, rows, reused + rows)
        hidden, cos, sin = w(1, rows, HIDDEN), w(1, rows, HEAD_DIM), w(1, rows, HEAD_DIM)
        keys, values = w(1, KV_HEADS, reused, HEAD_DIM), w(1, KV_HEADS, reused, HEAD_DIM)
        start = time.perf_counter()
        fn(hidden, cos, sin, keys, values, mask, *weights)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    warm_s = sum(call(r, t) for r, t in warm)
    warm_graphs = int(counters["stats"]["unique_graphs"])
    follow_ups = []
    for reused, tokens in FOLLOW_UPS:
        before = int(counters["stats"]["unique_graphs"])
        seconds = call(reused, tokens)
        compiled = int(counters["stats"]["unique_graphs"]) - before
        follow_ups.append({"reused": reused, "tokens": tokens, "mask_row": reused + padded_length(tokens),
                           "seconds": seconds, "graphs_compiled": compiled})  # fmt: skip
    return {"warm_shapes": [list(s) for s in warm], "warm_s": warm_s, "warm_graphs": warm_graphs,
            "follow_ups": follow_ups, "follow_up_graphs": sum(f["graphs_compiled"] for f in follow_ups)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__}
    for name, warm in (("run 13's warm shapes", ((24, 8), (40, 16))), ("WARM_SHAPES", WARM_SHAPES)):
        out[name] = run(device, warm)
        print(json.dumps({name: {k: v for k, v in out[name].items() if k != "follow_ups"}}), flush=True)
        for row in out[name]["follow_ups"]:
            print("  ", json.dumps(row), flush=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
