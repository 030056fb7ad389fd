#!/usr/bin/env python3
"""GPU checks of the quantized-expert kernels (vismmoe_edge.quant), one JSON summary; each check runs on its own.

    python3 tools/device/quant_checks.py --out $OUT/quant.json        # from a checkout, on the GPU machine

At Qwen3-VL-30B-A3B's expert shapes (gate_up 1536x2048, down 2048x768, group 128) and the demo model's:
- correctness: CUDA int4 (`_convert_weight_to_int4pack` on the GPU from our on-disk nibbles, either CPU tile
  layout or row-major, then `_weight_int4pack_mm`) and int8 (`_weight_int8pack_mm`) against F.linear on the
  dequantized weights in float32; the nibble order `_convert_weight_to_int4pack` expects; a whole expert;
- timings (CUDA events, medians): the repack per matrix, GEMV (T=1) int4 vs bf16 vs int8 (kernel and
  dequantize + cuBLAS), hot (one copy, L2-resident) and cold (rotating over copies larger than L2).
A failing check is recorded with its error and the run goes on; the exit status is 1 if any check failed.
Without CUDA the CUDA checks are reported as skipped and only the CPU check runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.device.checks import Checks  # noqa: E402
from vismmoe_edge.quant.config import make_config  # noqa: E402
from vismmoe_edge.quant.kernels import (  # noqa: E402
    CUDA_TINYGEMM,
    QuantizedMatrix,
    dequantize_matrix,
    expert_forward,
    expert_views,
    linear,
    prepare,
    prepare_matrix,
)
from vismmoe_edge.quant.packing import (  # noqa: E402
    ROWMAJOR,
    cuda_kernel_input,
    native_cpu_layout,
    pack_rowmajor,
    unpack_int4,
)
from vismmoe_edge.quant.record import ExpertSpec, encode_expert, encode_matrix  # noqa: E402

# name: (N, K, group) in nn.Linear orientation
MATRICES = {"30b gate_up": (1536, 2048, 128), "30b down": (2048, 768, 128), "demo gate_up": (96, 192, 64)}
EXPERTS = {"30b": (2048, 768, 128)}  # hidden, moe_intermediate, group
TOLERANCE = 1e-2  # bf16 activations and outputs: two bf16 roundings (<= 2^-8 each) and accumulation order


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def cuda_median_us(fn: Callable[[], object], iters: int, before: Callable[[], object] | None = None) -> float:
    """Median microseconds of single calls between CUDA events; `before` runs ahead of each, outside the events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def cold(t: torch.Tensor, nbytes: int) -> Callable[[], torch.Tensor]:
    """Round-robin over copies of `t` totalling `nbytes`, so each call reads memory the L2 does not hold."""
    copies = [t.clone() for _ in range(max(2, -(-nbytes // max(1, t.nbytes))))]
    state = {"i": 0}

    def next_copy() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % len(copies)
        return copies[state["i"]]

    return next_copy


def record_matrix(n: int, k: int, group: int, layout: str, device: torch.device, seed: int = 0):
    """W [n, k] quantized as our records store it (bytes on `device`), and its float32 dequantized weight."""
    spec = ExpertSpec(make_config(4, group, layout), k, n // 2)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    qweight, scales = (t.to(device) for t in encode_matrix(spec, w))
    m = QuantizedMatrix(4, n, k, group, layout, qweight, scales)
    return m, dequantize_matrix(m)


def check_int4_correct(n: int, k: int, group: int, layout: str) -> dict[str, Any]:
    dev = torch.device("cuda")
    m, w = record_matrix(n, k, group, layout, dev)
    ready = prepare_matrix(m, dev)
    out: dict[str, Any] = {"prepared_layout": ready.layout}
    ok = ready.layout == CUDA_TINYGEMM
    for t in (1, 16):
        x = torch.randn(t, k, device=dev).to(torch.bfloat16)
        err = rel_err(linear(x, ready), F.linear(x.float(), w))
        out[f"max_rel_err_T{t}"] = err
        ok &= err < TOLERANCE
    return out | {"ok": ok}


def check_nibble_order(n: int, k: int, group: int) -> dict[str, Any]:
    """Which nibble order `_convert_weight_to_int4pack` takes: ours says even column in the high nibble."""
    dev = torch.device("cuda")
    m, w = record_matrix(n, k, group, ROWMAJOR, dev)
    codes = unpack_int4(m.qweight, ROWMAJOR)
    x = torch.randn(1, k, device=dev).to(torch.bfloat16)
    ref = F.linear(x.float(), w)
    errs = {}
    for name, packed in (("even_high", cuda_kernel_input(codes)), ("even_low", pack_rowmajor(codes))):
        tiles = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8)
        errs[name] = rel_err(torch.ops.aten._weight_int4pack_mm(x, tiles, group, m.scales), ref)
    return {"max_rel_err": errs, "ok": errs["even_high"] < TOLERANCE and errs["even_low"] > 10 * TOLERANCE}


def check_repack_time(n: int, k: int, group: int, iters: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    out: dict[str, Any] = {}
    for layout in (native_cpu_layout() or ROWMAJOR, ROWMAJOR):
        m, _ = record_matrix(n, k, group, layout, dev)
        out[f"prepare_from_{layout}_us"] = cuda_median_us(lambda m=m: prepare_matrix(m, dev), iters)
    codes = unpack_int4(m.qweight, ROWMAJOR)
    kernel_input = cuda_kernel_input(codes).contiguous()
    out["aten_convert_only_us"] = cuda_median_us(
        lambda: torch.ops.aten._convert_weight_to_int4pack(kernel_input, 8), iters
    )
    return out


def check_gemv_time(n: int, k: int, group: int, iters: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    m, w = record_matrix(n, k, group, ROWMAJOR, dev)
    ready = prepare_matrix(m, dev)
    x = torch.randn(1, k, device=dev).to(torch.bfloat16)
    l2 = 256 << 20  # > 2x the H200's L2 (60 MB)
    w_bf16 = w.to(torch.bfloat16)
    q8 = torch.round(w / (w.abs().amax(1, keepdim=True) / 127)).to(torch.int8)
    s8 = (w.abs().amax(1) / 127).to(torch.bfloat16)
    out: dict[str, Any] = {"bytes_int4": ready.qweight.nbytes + ready.scales.nbytes, "bytes_bf16": w_bf16.nbytes}
    for label, get_w4, get_w16, get_q8 in (
        ("hot", lambda: ready.qweight, lambda: w_bf16, lambda: q8),
        ("cold", cold(ready.qweight, l2), cold(w_bf16, l2), cold(q8, l2)),
    ):
        out[f"int4_{label}_us"] = cuda_median_us(
            lambda g=get_w4: torch.ops.aten._weight_int4pack_mm(x, g(), group, ready.scales), iters
        )
        out[f"bf16_{label}_us"] = cuda_median_us(lambda g=get_w16: F.linear(x, g()), iters)
        try:
            out[f"int8_kernel_{label}_us"] = cuda_median_us(
                lambda g=get_q8: torch.ops.aten._weight_int8pack_mm(x, g(), s8), iters
            )
        except RuntimeError as e:
            out[f"int8_kernel_{label}_us"] = f"unavailable: {str(e).splitlines()[0][:120]}"
        out[f"int8_dequant_linear_{label}_us"] = cuda_median_us(
            lambda g=get_q8: F.linear(x, g().to(torch.bfloat16) * s8[:, None]), iters
        )
    return out


def check_int8_correct(n: int, k: int) -> dict[str, Any]:
    dev = torch.device("cuda")
    spec = ExpertSpec(make_config(8, None, ROWMAJOR), k, n // 2)
    g = torch.Generator().manual_seed(1)
    tensors = encode_expert(spec, torch.randn(n, k, generator=g) * 0.02, torch.randn(k, n // 2, generator=g) * 0.02)
    buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]).to(dev)
    m = expert_views(buf, spec).gate_up
    x = torch.randn(4, k, device=dev).to(torch.bfloat16)
    err = rel_err(linear(x, m), F.linear(x.float(), dequantize_matrix(m)))
    return {"max_rel_err": err, "ok": err < TOLERANCE}


def check_expert(hidden: int, inter: int, group: int, device: str, iters: int) -> dict[str, Any]:
    dev = torch.device(device)
    spec = ExpertSpec(make_config(4, group, native_cpu_layout() or ROWMAJOR), hidden, inter)
    g = torch.Generator().manual_seed(2)
    gate_up, down = torch.randn(2 * inter, hidden, generator=g) * 0.02, torch.randn(hidden, inter, generator=g) * 0.02
    buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in encode_expert(spec, gate_up, down)]).to(dev)
    e = expert_views(buf, spec)
    ready = prepare(e, dev)
    wg, wd = dequantize_matrix(e.gate_up), dequantize_matrix(e.down)
    x = torch.randn(1, hidden, device=dev).to(torch.bfloat16)
    gate, up = F.linear(x.float(), wg).chunk(2, dim=-1)
    err = rel_err(expert_forward(x, ready), F.linear(F.silu(gate) * up, wd))
    out: dict[str, Any] = {"max_rel_err": err, "layouts": [ready.gate_up.layout, ready.down.layout]}
    if dev.type == "cuda":
        wg16, wd16 = wg.to(torch.bfloat16), wd.to(torch.bfloat16)

        def bf16_expert() -> torch.Tensor:
            a, b = F.linear(x, wg16).chunk(2, dim=-1)
            return F.linear(F.silu(a) * b, wd16)

        out["int4_expert_us"] = cuda_median_us(lambda: expert_forward(x, ready), iters)
        out["bf16_expert_us"] = cuda_median_us(bf16_expert, iters)
    else:
        expert_forward(x, ready)  # warm-up
        start = time.perf_counter()
        for _ in range(iters):
            expert_forward(x, ready)
        out["int4_expert_cpu_us"] = (time.perf_counter() - start) / iters * 1e6
    return out | {"ok": err < TOLERANCE}


def environment() -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "native_cpu_layout": native_cpu_layout(), "cuda": torch.cuda.is_available()}  # fmt: skip
    if torch.cuda.is_available():
        info |= {"device": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
                 "cuda_runtime": torch.version.cuda}  # fmt: skip
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON summary here")
    ap.add_argument("--iters", type=int, default=200, help="timed repetitions per measurement")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test)")
    args = ap.parse_args(argv)
    iters = 5 if args.quick else args.iters
    checks = Checks(args.quick)
    env = environment()
    print(json.dumps(env))
    checks.run("cpu int4 expert (30b) vs dequantized", lambda: check_expert(2048, 768, 128, "cpu", 3), needs_cuda=False)
    for name, (n, k, group) in MATRICES.items():
        for layout in sorted({native_cpu_layout() or ROWMAJOR, ROWMAJOR}):
            checks.run(
                f"cuda int4 {name} from {layout}",
                lambda n=n, k=k, g=group, lay=layout: check_int4_correct(n, k, g, lay),
            )
        checks.run(f"cuda int8 {name}", lambda n=n, k=k: check_int8_correct(n, k))
    checks.run("cuda int4 nibble order", lambda: check_nibble_order(1536, 2048, 128))
    for name, (n, k, group) in MATRICES.items():
        checks.run(f"cuda repack time {name}", lambda n=n, k=k, g=group: check_repack_time(n, k, g, iters))
        checks.run(f"cuda gemv time {name}", lambda n=n, k=k, g=group: check_gemv_time(n, k, g, iters))
    for name, (hidden, inter, group) in EXPERTS.items():
        checks.run(
            f"cuda int4 expert ({name})", lambda h=hidden, i=inter, g=group: check_expert(h, i, g, "cuda", iters)
        )
    counts = {s: sum(r["status"] == s for r in checks.results) for s in ("pass", "fail", "skipped")}
    summary = {"environment": env, "iters": iters, "checks": checks.results, "counts": counts}
    print(json.dumps(counts))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
