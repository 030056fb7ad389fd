"""python -m vismmoe_edge.quant SRC OUT --bits 4|8 [--group-size 128] [--layout auto] [--max-shard-size 4GB]

The same converter as `vismmoe-edge quantize` (cli/quantize.py), without the CLI package: one-line errors, exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.convert import DEFAULT_MAX_SHARD, quantize_checkpoint
from vismmoe_edge.quant.packing import INT4_LAYOUTS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vismmoe_edge.quant", description="Quantize a model's routed experts.")
    ap.add_argument("src", type=Path, help="model directory: bf16/fp32, FP8 (block 128), compressed-tensors W4A16, AWQ")
    ap.add_argument("out", type=Path, help="new directory to write (must not exist, or be empty)")
    ap.add_argument("--bits", type=int, choices=(4, 8), required=True)
    ap.add_argument("--group-size", type=int, default=None, help="int4 only: inputs per scale/zero (default 128)")
    ap.add_argument("--layout", default="auto", choices=("auto", *INT4_LAYOUTS),
                    help="int4 nibble layout: auto = this CPU's kernel tiles")  # fmt: skip
    ap.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        out = quantize_checkpoint(args.src, args.out, args.bits, args.group_size, not args.no_progress,
                                  layout=args.layout, max_shard_size=args.max_shard_size)  # fmt: skip
        from vismmoe_edge.quant.catalogue import read_quantized_catalogue

        catalogue = read_quantized_catalogue(out)
        spec = catalogue.spec
        print(
            f"{out}: int{spec.quant.bits}, group {spec.quant.group_size or 'per-channel'}, layout {spec.quant.layout}, "
            f"{spec.nbytes:,} bytes per expert ({spec.nbytes / spec.dense_nbytes_bf16:.3f}x bf16), "
            f"{len(catalogue.experts)} experts"
        )
    except VismmoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
