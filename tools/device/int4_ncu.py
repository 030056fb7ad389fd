#!/usr/bin/env python3
"""On the GPU server (device tool): what Nsight Compute sees in the expert GEMVs at 30B-A3B shapes.

    ncu --profile-from-start off --kernel-name regex:gemv ... python3 tools/device/int4_ncu.py --dump DIR

(tools/device/int4_ncu.sh runs it so.) The int4 GEMVs ran at 3.4x their bytes inside run 16's token while bf16's ran
at 1.23x, and timing variants (kernel_sweep.py) could not say whether the int4 loop waits on its loads, on the
input's gathers or on issuing instructions. This runs each of kernel_sweep.kernel_cases (int4 and bf16, as a
token runs them) once with the config the autotuner picked, between cudaProfilerStart and Stop, so that ncu
profiles those launches and not the tuning before them (ncu flushes caches before each kernel by default: the
launch is cold, as in a token). Each case's PTX, cubin, registers and spills are written to DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_sweep import TOP_K, kernel_call, kernel_cases  # noqa: E402

from vismmoe_edge.kernels import moe_int4  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump", type=Path, required=True, help="directory for each kernel's PTX, cubin and summary")
    ap.add_argument("--kinds", default="int4,bf16")
    args = ap.parse_args(argv)
    args.dump.mkdir(parents=True, exist_ok=True)
    launches, summary = [], {}
    for kind in args.kinds.split(","):
        tuned, cases, slot_ids, mix = kernel_cases(kind)
        for name, w, v, flags, want, cfg in cases:
            out = torch.empty_like(want)
            call_args, constexprs = kernel_call(kind, w, slot_ids, v, mix, out, flags)
            grid = moe_int4.grid(TOP_K, w.n)(cfg.kwargs)  # the grid of every slot GEMV

            def launch(fn=tuned.fn, grid=grid, a=call_args, c=constexprs, cfg=cfg):  # type: ignore[no-untyped-def]
                return fn[grid](*a, **c, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

            compiled = launch()
            torch.cuda.synchronize()
            ok = bool(torch.allclose(out, want, rtol=1e-3, atol=1e-3 * float(want.abs().max())))
            label = f"{kind}-{name}"
            (args.dump / f"{label}.ptx").write_text(compiled.asm["ptx"])
            (args.dump / f"{label}.cubin").write_bytes(compiled.asm["cubin"])
            summary[label] = {"config": str(cfg), "registers": compiled.n_regs, "spills": compiled.n_spills,
                              "equal_to_reference": ok, "launch_order": len(launches)}  # fmt: skip
            launches.append(launch)
            print(label, summary[label], flush=True)
    (args.dump / "summary.json").write_text(json.dumps(summary, indent=1))
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # ncu --profile-from-start off: these launches only, in summary's order
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
