#!/usr/bin/env python3
"""The int4 expert GEMV's main loop in SASS, compiled for sm_90 on this CPU: instructions a code, by opcode.

    PYTHONPATH=<triton> python tools/int4_sass.py [--rows-warps 128x4,64x4] [--loops dot,bytes,words]

Run 17's Nsight Compute profile (docs/benchmarks.md) found the int4 gate_up kernel bound by issuing instructions
(~9.8 a code, measured), so a loop's instruction count is the number to lower, and it needs no GPU: Triton
compiles every stage to a cubin with its own ptxas, and its own nvdisasm prints the SASS. This compiles
kernels/moe_int4.py's kernel as a token runs it (gate_up ending in the activation, GATED, and down with
weighted rows, g128, bf16 input, 30B-A3B's divisibility) for each loop (DOT: tensor cores, a group a step;
bytes; WORDS) at the given rows and warps, finds the longest loop in the SASS and reports its instructions
times the program's warps times 32 threads over the codes a step covers. Static counts: a loop's latency and
memory stalls are not in them (run 17: WORDS counted 7.1 to the byte loop's 10.1, and ran no faster alone).
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GROUP = 128
SIGNATURE = {"w": "*u8", "slot_ids": "*i64", "v": "*bf16", "mix": "*bf16", "out": "*fp32", "N": "i32", "K": "i32",
             "stride_v": "i32", "stride_slot": "i32", "q_off": "i32", "s_off": "i32", "partials": "*fp32",
             "counters": "*i32"}  # fmt: skip
ALIGNED = (0, 1, 2, 3, 4, 6, 8, 9, 10, 11, 12)  # pointers, K, the record's strides and offsets: multiples of 16
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass(kind: str, loop: str, rows: int, warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tools.triton_frontend import sass_of
    from vismmoe_edge.kernels import moe_int4

    fn = moe_int4._kernel()
    while not isinstance(fn, triton.runtime.jit.JITFunction):  # under the autotuner
        fn = fn.fn
    gated = kind == "gate_up"
    block_k = GROUP if loop == "dot" else 2048 if gated else 1024
    constexprs = {"GROUP": GROUP, "SILU": False, "GATED": gated, "WEIGH": not gated, "ROUND": 1 if gated else 0,
                  "BLOCK_N": rows, "BLOCK_K": block_k, "ACC2D": False, "WORDS": loop == "words",
                  "DOT": loop == "dot", "SPLIT": 1, "IEEE": False}  # fmt: skip
    signature = {**SIGNATURE, "out": "*bf16" if gated else "*fp32", **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i in ALIGNED}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})  # fmt: skip
    return sass_of(compiled)


def main_loop(text: str) -> list[str]:
    """The opcodes of the longest loop: a label and the last branch back to it."""
    lines = text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            ops = [m2.group(2) for x in lines[labels[m.group(1)] : i + 1] if (m2 := INSTRUCTION.match(x))]
            best = max(best, ops, key=len)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows-warps", default="128x4,64x4,8x4")
    ap.add_argument("--loops", default="dot,bytes,words")
    args = ap.parse_args(argv)
    print("| kernel | loop | rows x warps | loop instructions | thread instructions a code | top opcodes |")
    print("|---|---|---|---:|---:|---|")
    for kind in ("gate_up", "down"):
        for loop in args.loops.split(","):
            for spec in args.rows_warps.split(","):
                rows, warps = (int(x) for x in spec.split("x"))
                ops = main_loop(sass(kind, loop, rows, warps))
                codes = rows * (GROUP if loop == "dot" else 2048 if kind == "gate_up" else 1024)
                per_code = len(ops) * warps * 32 / codes
                top = ", ".join(f"{op} {n}" for op, n in collections.Counter(ops).most_common(5))
                print(f"| {kind} | {loop} | {rows} x {warps} | {len(ops)} | {per_code:.2f} | {top} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
