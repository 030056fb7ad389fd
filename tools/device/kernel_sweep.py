"""On the GPU server (device tool): the expert GEMVs config by config, for choosing kernels from data.

1. Every autotune config of the slot GEMVs (bf16 and int8: moe_decode._gemv_kernel; int4: moe_int4's) at 30B-A3B
   shapes (8 experts of a 64-slot pool; gate_up N=1536 K=2048, down N=2048 K=768 with the SiLU input), each
   call timed alone with L2 evicted first (as inside a token, where 48 layers' weights pass through a 50 MB L2),
   its output checked against the autotuner's own pick: for int4 the best config reading codes as bytes and the
   best reading them as words (moe_int4's WORDS); int4 also as a token now runs it, gate_up ending in the
   activation (GATED) and down loading it. Run 16 (docs/benchmarks.md) found int4's GEMVs at 3.4x their
   byte bound inside a token while bf16's ran at 1.23x; configs that kept a second block of loads in flight
   (tried in run 16) won nothing and were removed.
2. The address GEMV (moe_decode.gemv_at) over pinned host memory, 8 bf16 experts read in place, at blocks x warps,
   against the pinned copy rate; and a plain streaming read of the same buffer (the most a kernel's loads draw
   over the bus here). Run 16's device-mapped rows ran at 0.44x of their bus bound.
3. `mix`: m of a layer's 8 experts in host memory, the rest in HBM, by rows a program; `floor`: what a GEMV's
   grid costs before its weights; `random`: 4 host experts drawn each call from an 8 GiB pool (torch's pinned
   buffers, and huge pages registered), against the same 4 every call; `int4`: the int4 GEMV against the same
   loop with its input split beforehand, and with no input.

    python3 tools/device/kernel_sweep.py --out OUT.json [--parts configs,mapped,mix,floor,random,int4] [--kinds int4]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_checks import cuda_median_us  # noqa: E402

HIDDEN, INTER, TOP_K, SLOTS = 2048, 768, 8, 64


def hbm_rate() -> float:
    """Bytes per second of a 2 GiB device-to-device copy (each byte read and written)."""
    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    return 2 * buf.numel() / (cuda_median_us(lambda: dst.copy_(buf), 5) * 1e-6)


def pinned_rate() -> float:
    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(big, device="cuda")
    return big.numel() / (cuda_median_us(lambda: dev.copy_(big, non_blocking=True), 5) * 1e-6)


def cold_us(fn: Callable[[], object], flush: torch.Tensor, reps: int = 30) -> float:
    return cuda_median_us(fn, reps, before=flush.zero_)


def slot_matrices(kind: str) -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate_up and down SlotMatrix of a 64-slot pool of `kind`, x, slot ids [8], routing weights [8])."""
    from vismmoe_edge.kernels.slot_matrix import SlotMatrix, record_matrix
    from vismmoe_edge.quant.config import make_config
    from vismmoe_edge.quant.packing import ROWMAJOR
    from vismmoe_edge.quant.record import ExpertSpec, encode_expert
    from vismmoe_edge.quant.slot_form import SlotForm

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(SLOTS, 2 * INTER, HIDDEN, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    down = torch.randn(SLOTS, HIDDEN, INTER, device="cuda", generator=g).to(torch.bfloat16) * 0.02
    x = torch.randn(1, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    slot_ids = torch.randperm(SLOTS, device="cuda", generator=g)[:TOP_K]
    mix = torch.softmax(torch.randn(TOP_K, device="cuda", generator=g), -1).to(torch.bfloat16)
    if kind == "bf16":
        return [SlotMatrix.of_pool(gate_up), SlotMatrix.of_pool(down)], x, slot_ids, mix
    spec = ExpertSpec(make_config(8 if kind == "int8" else 4, None if kind == "int8" else 128, ROWMAJOR), HIDDEN,
                      INTER)  # fmt: skip
    rows = []
    for s in range(SLOTS):
        parts = encode_expert(spec, gate_up[s].float(), down[s].float())
        rows.append(torch.cat([t.reshape(-1).view(torch.uint8) for t in parts]))
    records = torch.stack(rows)
    form = SlotForm.for_device(spec, records.device, triton=kind == "int4")
    return [record_matrix(records, form, m) for m in ("gate_up_proj", "down_proj")], x, slot_ids, mix


def matrix_bytes(w: object, kind: str) -> int:
    n, k = w.n, w.k  # type: ignore[attr-defined]
    return {"bf16": n * k * 2, "int8": n * k + n * 2, "int4": n * k // 2 + (k // 128) * n * 4}[kind]


def kernel_cases(kind: str) -> tuple[Any, list, torch.Tensor, torch.Tensor]:
    """(the autotuned kernel, its cases as a token runs them: (name, w, v, flags, want, the autotuner's pick),
    slot ids, mix). int4: gate_up ending in the activation (`gate_up_gated`, moe_int4.gated_int4) and down loading
    it, weighted, and the plain gate_up (the kernel's non-SiLU form); bf16 and int8: gate_up, and down computing
    the SiLU input."""
    from vismmoe_edge.kernels import moe_decode as md
    from vismmoe_edge.kernels import moe_int4

    (gate_up, down), x, slot_ids, mix = slot_matrices(kind)
    tuned = moe_int4._kernel() if kind == "int4" else md._kernels()[0]
    xs = x.view(1, -1).expand(TOP_K, -1).contiguous()

    def picked(out: torch.Tensor) -> tuple[torch.Tensor, Any]:  # the reference, and the config the tuner chose
        return out, tuned.best_config

    h, h_pick = picked(md.gemv(gate_up, slot_ids, xs, mix))
    if kind == "int4":
        a, a_pick = picked(moe_int4.gated_int4(gate_up, slot_ids, xs, torch.bfloat16))  # [8, I]: down's input
        cases = [
            ("gate_up", gate_up, xs, {}, h, h_pick),
            ("gate_up_gated", gate_up, xs, {"GATED": True, "ROUND": 1}, a, a_pick),
            ("down", down, a, {"WEIGH": True}, *picked(moe_int4.gemv_int4(down, slot_ids, a, mix, weigh=True))),
        ]
    else:
        silu = {"SILU": True, "ROUND": 1}
        cases = [
            ("gate_up", gate_up, xs, {}, h, h_pick),
            ("down", down, h, silu, *picked(md.gemv(down, slot_ids, h, mix, silu_of=torch.bfloat16))),
        ]
    return tuned, cases, slot_ids, mix


def kernel_call(kind: str, w: Any, slot_ids: torch.Tensor, v: torch.Tensor, mix: torch.Tensor, out: torch.Tensor,
                flags: dict) -> tuple[tuple, dict]:  # fmt: skip
    """The positional arguments and constexprs of one case's kernel, as moe_int4 / moe_decode launch it."""
    if kind == "int4":
        from vismmoe_edge.kernels import moe_int4

        scratch = moe_int4.split_scratch(w.base.device, slot_ids.shape[0], w.n)  # (SPLIT configs' partial sums)
        args = (w.base, slot_ids, v, mix, out, w.n, w.k, v.stride(0), w.stride_slot, w.q_off, w.s_off, *scratch)
        return args, {"SILU": False, "GATED": False, "WEIGH": False, "ROUND": 0, **flags, "GROUP": w.group}
    args = (w.base, slot_ids, v, mix, out, w.n, w.k, v.stride(0), w.stride_slot, w.stride_row, w.q_off, w.s_off)
    return args, {"SILU": False, "ROUND": 0, **flags, "INT8": w.int8}


def expert_configs(kind: str, hbm: float, flush: torch.Tensor) -> dict:
    """Each autotune config of `kind`'s GEMV on each of kernel_cases (int4: the DOT configs too, which the
    autotuner takes only with VISMMOE_INT4_DOT=1): cold microseconds, sorted."""
    from vismmoe_edge.kernels import moe_int4

    tuned, cases, slot_ids, mix = kernel_cases(kind)
    configs = list(tuned.configs)
    if kind == "int4" and not any(c.kwargs.get("DOT") for c in configs):
        configs += moe_int4.dot_configs()
    result: dict = {}
    for name, w, v, flags, want, picked in cases:
        out = torch.empty_like(want)
        args, common = kernel_call(kind, w, slot_ids, v, mix, out, flags)
        bound = TOP_K * matrix_bytes(w, kind) / hbm * 1e6
        rows = []
        mine = configs
        if kind == "int4":  # the autotuner's pruning: a SPLIT that does not divide the groups would sum only some
            named = {"q_off": w.q_off, "stride_slot": w.stride_slot, "K": w.k, "v": v}
            mine = moe_int4.configs_fit(configs, named, **common)
        for cfg in mine:
            label = "/".join(f"{k}={v}" for k, v in cfg.kwargs.items()) + f"/w{cfg.num_warps}/s{cfg.num_stages}"
            grid = moe_int4.grid(TOP_K, w.n)(cfg.kwargs)  # the grid of every slot GEMV (bf16 and int8 too)

            def launch(cfg=cfg, grid=grid, args=args, common=common) -> None:  # type: ignore[no-untyped-def]
                tuned.fn[grid](*args, **common, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

            try:
                launch()
                ok = bool(torch.allclose(out, want, rtol=1e-3, atol=1e-3 * float(want.abs().max())))
                rows.append({"config": label, "us": cold_us(launch, flush), "equal_to_pick": ok})
            except Exception as e:  # noqa: BLE001 - a config that does not compile here: recorded, the rest run
                rows.append({"config": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        best_bytes = next((r for r in timed if "WORDS=True" not in r["config"] and "DOT=True" not in r["config"]), None)
        best_words = next((r for r in timed if "WORDS=True" in r["config"]), None)
        best_dot = next((r for r in timed if "DOT=True" in r["config"]), None)
        result[name] = {
            "byte_bound_us": bound,
            "autotuner_pick": str(picked),
            "fastest": timed[:6],
            "best_reading_bytes": best_bytes,
            "best_reading_words": best_words,
            "best_dot": best_dot,
            "every_config": timed,
            "errors": [r for r in rows if "error" in r],
            "all_equal": all(r.get("equal_to_pick", True) for r in rows),
        }
        print(kind, name, f"bound {bound:.1f} us;", "fastest", timed[:3], flush=True)
    return result


def mapped_sweep(pinned: float, flush: torch.Tensor) -> dict:
    """gemv_at over 8 bf16 experts in pinned host memory at blocks x warps, and a streaming read."""
    from vismmoe_edge.kernels import moe_decode as md

    gu_numel, dn_numel = 2 * INTER * HIDDEN, HIDDEN * INTER
    host = torch.randn(TOP_K, gu_numel + dn_numel, dtype=torch.bfloat16).mul_(0.02).pin_memory()
    gu_addrs = torch.tensor([host[j].data_ptr() for j in range(TOP_K)], dtype=torch.int64, device="cuda")
    dn_addrs = gu_addrs + gu_numel * 2
    x = torch.randn(TOP_K, HIDDEN, dtype=torch.bfloat16, device="cuda")
    hv = torch.randn(TOP_K, INTER, dtype=torch.bfloat16, device="cuda")
    want_gu = torch.stack([host[j, :gu_numel].view(2 * INTER, HIDDEN).cuda().float() @ x[j].float()
                           for j in range(TOP_K)])  # fmt: skip
    rows = []
    for bn, bk, warps in itertools.product((8, 16, 32, 64), (128, 256, 512), (4, 8)):
        kw = dict(block_n=bn, block_k=bk, num_warps=warps)

        def layer(kw=kw) -> None:  # type: ignore[no-untyped-def]
            md.gemv_at(gu_addrs, x, 2 * INTER, torch.bfloat16, **kw)
            md.gemv_at(dn_addrs, hv, HIDDEN, torch.bfloat16, **kw)

        try:
            got = md.gemv_at(gu_addrs, x, 2 * INTER, torch.bfloat16, **kw)
            ok = bool(torch.allclose(got, want_gu, rtol=1e-3, atol=1e-3 * float(want_gu.abs().max())))
            us = cold_us(layer, flush, reps=10)
            rows.append({**kw, "us": us, "gb_s": host.nbytes / (us * 1e-6) / 1e9, "equal": ok})
        except Exception as e:  # noqa: BLE001
            rows.append({**kw, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    shipped = next((r for r in timed if (r["block_n"], r["block_k"], r["num_warps"]) == (32, 256, 4)), None)
    return {"bytes": host.nbytes, "pinned_gb_s": pinned / 1e9, "bus_bound_us": host.nbytes / pinned * 1e6,
            "fastest": timed[:6], "shipped": shipped, "errors": [r for r in rows if "error" in r],
            "streaming_read": streaming_read(host, flush)}  # fmt: skip


def mapped_mix(pinned: float, flush: torch.Tensor) -> dict:
    """A layer's 8 experts with m of them read in place from pinned host memory and the others from HBM, as a
    20 GiB token has them (run 16's one-layer check, 4 of 8 in place, drew 25 GB/s over the bus where 8 of 8 draw
    ~50): the bus rate of the host experts' bytes by m and by rows a program (more programs, more reads in
    flight)."""
    from vismmoe_edge.kernels import moe_decode as md

    gu_numel, dn_numel = 2 * INTER * HIDDEN, HIDDEN * INTER
    host = torch.randn(TOP_K, gu_numel + dn_numel, dtype=torch.bfloat16).mul_(0.02).pin_memory()
    device = host.cuda()
    x = torch.randn(TOP_K, HIDDEN, dtype=torch.bfloat16, device="cuda")
    hv = torch.randn(TOP_K, INTER, dtype=torch.bfloat16, device="cuda")
    rows: list[dict] = []
    for m in (0, 1, 2, 4, 8):
        base = [host[j].data_ptr() if j < m else device[j].data_ptr() for j in range(TOP_K)]
        gu_addrs = torch.tensor(base, dtype=torch.int64, device="cuda")
        dn_addrs = gu_addrs + gu_numel * 2
        for bn in (4, 8, 16, 32, 64):
            for bk in (128, 256):
                kw = dict(block_n=bn, block_k=bk)

                def layer(kw=kw, gu_addrs=gu_addrs, dn_addrs=dn_addrs) -> None:  # type: ignore[no-untyped-def]
                    md.gemv_at(gu_addrs, x, 2 * INTER, torch.bfloat16, **kw)
                    md.gemv_at(dn_addrs, hv, HIDDEN, torch.bfloat16, **kw)

                us = cold_us(layer, flush, reps=10)
                host_bytes = m * host[0].nbytes
                rows.append({"host_experts": m, **kw, "us": us,
                             "host_gb_s": host_bytes / (us * 1e-6) / 1e9 if m else None,
                             "over_bus_bound": us / (host_bytes / pinned * 1e6) if m else None})  # fmt: skip
    best = {}
    for m in (1, 2, 4, 8):
        mine = sorted((r for r in rows if r["host_experts"] == m), key=lambda r: r["us"])
        shipped = next(r for r in mine if (r["block_n"], r["block_k"]) == (32, 256))
        best[str(m)] = {"fastest": mine[0], "shipped": shipped}
    return {"by_host_experts": best, "rows": rows}


centered: object = None  # triton_codes.centered, bound by int4_variant_kernel (Triton resolves helpers here)


def int4_variant_kernel():  # type: ignore[no-untyped-def]
    """The int4 GEMV's loop with its input split beforehand (INPUT) or absent: `int4_variants` times it."""
    global centered
    import triton
    import triton.language as tl

    from vismmoe_edge.kernels.triton_codes import centered

    @triton.jit
    def _variant(w, slot_ids, a_even, a_odd, out, N, K, stride_slot, q_off, s_off, GROUP: tl.constexpr,
                 INPUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        HALF: tl.constexpr = BLOCK_K // 2
        GB: tl.constexpr = GROUP // 2
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        record = w + tl.load(slot_ids + e).to(tl.int64) * stride_slot
        codes = record + q_off
        sz = (record + s_off).to(tl.pointer_type(tl.bfloat16))
        kb = K // 2
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, kb, HALF):
            jb = start + tl.arange(0, HALF)
            ok = jb < kb
            byte = tl.load(codes + rows[:, None].to(tl.int64) * kb + jb[None, :], mask=row_ok[:, None] & ok[None, :],
                           other=0)  # fmt: skip
            if INPUT:
                a0 = tl.load(a_even + e * kb + jb, mask=ok, other=0.0)
                a1 = tl.load(a_odd + e * kb + jb, mask=ok, other=0.0)
            else:
                a0 = tl.full((HALF,), 1.0, tl.float32)
                a1 = a0
            part = centered(byte & 15) * a0[None, :] + centered(byte >> 4) * a1[None, :]
            a = a0 + a1
            if HALF <= GB:
                at = (start // GB * N + rows) * 2
                scale = tl.load(sz + at, mask=row_ok, other=0.0).to(tl.float32)
                zero = tl.load(sz + at + 1, mask=row_ok, other=0.0).to(tl.float32)
                acc += scale * tl.sum(part, axis=1) + zero * tl.sum(a, axis=0)
            else:
                NG: tl.constexpr = HALF // GB
                groups = start // GB + tl.arange(0, NG)
                per_group = tl.sum(tl.reshape(part, (BLOCK_N, NG, GB)), axis=2)
                a_group = tl.sum(tl.reshape(a, (NG, GB)), axis=1)
                at = (groups[None, :] * N + rows[:, None]) * 2
                m = row_ok[:, None] & (groups[None, :] < K // GROUP)
                scale = tl.load(sz + at, mask=m, other=0.0).to(tl.float32)
                zero = tl.load(sz + at + 1, mask=m, other=0.0).to(tl.float32)
                acc += tl.sum(per_group * scale + a_group[None, :] * zero, axis=1)
        tl.store(out + e * N + rows, acc, mask=row_ok)

    return _variant


def int4_variants(hbm: float, flush: torch.Tensor) -> dict:
    """Where an int4 GEMV's time goes beyond its bytes: the shipped kernel against the same loop with its input
    already split into even and odd columns in float32 (`split_input`: no SiLU, no reshape and split of the input
    in registers a block) and with no input at all (`codes_only`: the codes streamed, unpacked, scaled and summed;
    a floor for this way of unpacking), at the blocks the autotuner picks most, cold."""
    from vismmoe_edge.kernels import moe_decode as md
    from vismmoe_edge.kernels import moe_int4

    _variant = int4_variant_kernel()
    (gate_up, down), x, slot_ids, mix = slot_matrices("int4")
    tuned = moe_int4._kernel()
    h = md.gemv(gate_up, slot_ids, x.view(1, -1).expand(TOP_K, -1), mix)  # [8, 2I] float32
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(torch.bfloat16).float()  # the down GEMV's input, as the shipped kernel rounds it
    result: dict = {}
    for name, w, v, silu, inputs in (
        ("gate_up", gate_up, x.view(1, -1).expand(TOP_K, -1).contiguous(), False, x.float().expand(TOP_K, -1)),
        ("down", down, h, True, act),
    ):
        a_even, a_odd = inputs[:, 0::2].contiguous(), inputs[:, 1::2].contiguous()
        want = md.gemv(w, slot_ids, v, mix, silu_of=torch.bfloat16 if silu else None)
        if silu:
            want = want / mix.float()[:, None]  # the variants do not scale by the routing weight
        out = torch.empty(TOP_K, w.n, dtype=torch.float32, device="cuda")
        rows = []
        for bn, bk, warps in ((8, 2048, 4), (8, 1024, 4), (16, 512, 4), (32, 256, 4), (32, 128, 4), (64, 256, 8)):
            grid = (TOP_K, -(-w.n // bn))
            row: dict = {"config": f"{bn}x{bk}/w{warps}"}
            shipped = partial(tuned.fn[grid], w.base, slot_ids, v, mix, out, w.n, w.k, v.stride(0), w.stride_slot,
                              w.q_off, w.s_off, *moe_int4.split_scratch(w.base.device, TOP_K, w.n), GROUP=w.group,
                              SILU=silu, GATED=False, WEIGH=silu, ROUND=1 if silu else 0, BLOCK_N=bn, BLOCK_K=bk,
                              num_warps=warps)  # fmt: skip
            row["shipped_us"] = cold_us(shipped, flush)
            for label, use_input in (("split_input", True), ("codes_only", False)):
                variant = partial(_variant[grid], w.base, slot_ids, a_even, a_odd, out, w.n, w.k, w.stride_slot,
                                  w.q_off, w.s_off, GROUP=w.group, INPUT=use_input, BLOCK_N=bn, BLOCK_K=bk,
                                  num_warps=warps)  # fmt: skip
                variant()
                if use_input:
                    row["split_input_equal"] = bool(torch.allclose(out, want, rtol=2e-3,
                                                                   atol=2e-3 * float(want.abs().max())))  # fmt: skip
                row[f"{label}_us"] = cold_us(variant, flush)
            rows.append(row)
        result[name] = {"byte_bound_us": TOP_K * matrix_bytes(w, "int4") / hbm * 1e6, "rows": rows}
        print("int4 variants", name, json.dumps(result[name]), flush=True)
    return result


def huge_page_pool(nbytes: int) -> tuple[object, int]:
    """`nbytes` of anonymous memory advised into transparent huge pages (2 MiB), touched, then registered for the
    GPU (vismmoe_edge.hardware.cudart): (the mapping, its address)."""
    import ctypes
    import mmap

    from vismmoe_edge.hardware import cudart

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    ctypes.memset(address, 0, nbytes)  # faulted in now, as huge pages where the kernel has them
    rt = cudart.runtime()
    for start in range(0, nbytes, 1 << 30):
        err = rt.host_register(address + start, min(1 << 30, nbytes - start),
                               cudart.REGISTER_PORTABLE | cudart.REGISTER_MAPPED)  # fmt: skip
        if err:
            raise RuntimeError(f"cudaHostRegister: {rt.error_string(err)}")
    return mm, address


def random_experts(pinned: float, flush: torch.Tensor, pool_gib: int = 8) -> dict:
    """m = 4 of a layer's 8 experts read in place, drawn at random each call from a pool of `pool_gib` GiB of
    host memory (as a token's misses spread over a 40 GB host tier), against the same 4 every call (`mix`): the
    pool as host_mirror.py takes it (torch's pinned 1 GiB buffers) and as transparent huge pages registered with
    cudaHostRegister. A gap between the fixed and the random set would be the GPU's translation of host pages."""
    import random

    from vismmoe_edge.kernels import moe_decode as md

    gu_numel, dn_numel = 2 * INTER * HIDDEN, HIDDEN * INTER
    expert_bytes = (gu_numel + dn_numel) * 2
    per_gib = (1 << 30) // expert_bytes
    device = torch.zeros(TOP_K, gu_numel + dn_numel, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(TOP_K, HIDDEN, dtype=torch.bfloat16, device="cuda")
    hv = torch.randn(TOP_K, INTER, dtype=torch.bfloat16, device="cuda")
    gu_addrs = torch.zeros(TOP_K, dtype=torch.int64, device="cuda")
    host_addrs = torch.zeros(TOP_K, dtype=torch.int64, pin_memory=True)
    rng = random.Random(0)
    report: dict = {}

    def layer() -> None:
        md.gemv_at(gu_addrs, x, 2 * INTER, torch.bfloat16)
        md.gemv_at(gu_addrs + gu_numel * 2, hv, HIDDEN, torch.bfloat16)

    def measure(experts: list[int], fixed: bool) -> float:
        def before() -> None:
            flush.zero_()
            chosen = experts[:4] if fixed else rng.sample(experts, 4)
            host_addrs.copy_(torch.tensor(chosen + [device[j].data_ptr() for j in range(4, TOP_K)]))
            gu_addrs.copy_(host_addrs, non_blocking=True)

        before()  # (cuda_median_us warms up without `before`: the addresses must be real first)
        us = cuda_median_us(layer, 20, before=before)
        return 4 * expert_bytes / (us * 1e-6) / 1e9

    buffers = [torch.empty(per_gib * expert_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(pool_gib)]
    experts = [b.data_ptr() + i * expert_bytes for b in buffers for i in range(per_gib)]
    report["torch_pinned"] = {"fixed_gb_s": measure(experts, True), "random_gb_s": measure(experts, False)}
    del buffers
    try:
        mm, address = huge_page_pool(pool_gib * per_gib * expert_bytes)
        experts = [address + i * expert_bytes for i in range(pool_gib * per_gib)]
        report["huge_pages_registered"] = {"fixed_gb_s": measure(experts, True),
                                           "random_gb_s": measure(experts, False)}  # fmt: skip
        torch.cuda.synchronize()
        from vismmoe_edge.hardware import cudart

        for start in range(0, len(mm), 1 << 30):
            cudart.runtime().host_unregister(address + start)
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            report["thp_enabled"] = f.read().strip()
        with open("/proc/meminfo") as f:
            report["anon_huge_pages"] = next(line.split(":")[1].strip() for line in f if "AnonHugePages" in line)
    except Exception as e:  # noqa: BLE001 - reported: the first half stands
        report["huge_pages_error"] = f"{type(e).__name__}: {e}"
    report["pinned_gb_s"] = pinned / 1e9
    report["pool_experts"] = pool_gib * per_gib
    return report


def floor_kernel(flush: torch.Tensor) -> dict:
    """A kernel with the down GEMV's grid (8 experts x 64 programs) that reads its slot id, one byte of the slot
    and stores zeros: what a GEMV of that grid costs before its weights (cold, as `expert_configs` times, and
    warm in a graph, as a token's kernels run back to back)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _floor(w, slot_ids, out, stride_slot, N, BLOCK_N: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ids + e).to(tl.int64)
        first = tl.load(w + slot * stride_slot).to(tl.float32)
        tl.store(out + e * N + rows, tl.zeros((BLOCK_N,), dtype=tl.float32) + first * 0.0, mask=rows < N)

    pool = torch.zeros(SLOTS, 1 << 20, dtype=torch.uint8, device="cuda")
    slot_ids = torch.randperm(SLOTS, device="cuda")[:TOP_K]
    out = torch.empty(TOP_K, HIDDEN, dtype=torch.float32, device="cuda")

    def run() -> None:
        _floor[(TOP_K, HIDDEN // 32)](pool, slot_ids, out, pool.stride(0), HIDDEN, BLOCK_N=32)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            run()
    return {"cold_us": cold_us(run, flush), "in_graph_us": cuda_median_us(graph.replay, 20) / 20}


def streaming_read(host: torch.Tensor, flush: torch.Tensor) -> dict:
    """The most a kernel's plain loads draw from pinned host memory: each program sums a block of int32 words."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(ptr, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + tl.program_id(0), tl.sum(tl.load(ptr + offs, mask=offs < n, other=0), 0))

    words = host.view(torch.int32).view(-1)
    n = words.numel()
    best: dict = {}
    table = {}
    for block in (1024, 4096, 16384):
        for warps in (4, 8, 16):
            out = torch.empty(-(-n // block), dtype=torch.int32, device="cuda")

            def read(block=block, warps=warps, out=out) -> None:  # type: ignore[no-untyped-def]
                _read[(-(-n // block),)](words, out, n, BLOCK=block, num_warps=warps)

            try:
                us = cold_us(read, flush, reps=10)
            except Exception as e:  # noqa: BLE001
                table[f"{block}/w{warps}"] = f"{type(e).__name__}"
                continue
            gb_s = host.nbytes / (us * 1e-6) / 1e9
            table[f"{block}/w{warps}"] = gb_s
            if not best or gb_s > best["gb_s"]:
                best = {"block_words": block, "num_warps": warps, "gb_s": gb_s}
    return {"best": best, "gb_s_by_block_and_warps": table}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", default="int4,int8,bf16")
    ap.add_argument("--parts", default="configs,mapped,mix,floor,random,int4", help="which parts: configs (the "
                    "autotune configs of --kinds), mapped (gemv_at over 8 host experts, streaming read), mix (m of "
                    "8 experts in host memory), floor (a GEMV grid's cost before its weights), random (4 of 8 "
                    "experts drawn from an 8 GiB host pool each call), int4 (the int4 GEMV against variants "
                    "of its loop)")  # fmt: skip
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    start = time.time()
    hbm, pinned = hbm_rate(), pinned_rate()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    report: dict = {"machine": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
                    "hbm_gb_s": hbm / 1e9, "pinned_gb_s": pinned / 1e9}  # fmt: skip
    if "floor" in parts:
        report["floor"] = floor_kernel(flush)
        print("floor", report["floor"], flush=True)
    for kind in args.kinds.split(",") if "configs" in parts else []:
        report[kind] = expert_configs(kind, hbm, flush)
        args.out.write_text(json.dumps(report, indent=1))  # what is measured so far survives a timeout
    if "mix" in parts:
        report["mapped_mix"] = mapped_mix(pinned, flush)
        print("mapped mix", json.dumps(report["mapped_mix"]["by_host_experts"]), flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    if "int4" in parts:
        report["int4_variants"] = int4_variants(hbm, flush)
        args.out.write_text(json.dumps(report, indent=1))
    if "random" in parts:
        report["random_experts"] = random_experts(pinned, flush)
        print("random experts", json.dumps(report["random_experts"]), flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    if "mapped" in parts:
        report["mapped"] = mapped_sweep(pinned, flush)
        print("mapped", report["mapped"]["fastest"][:3], report["mapped"]["streaming_read"]["best"], flush=True)
    report["seconds"] = time.time() - start
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("hbm_gb_s", "pinned_gb_s", "seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
