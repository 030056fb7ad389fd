#!/usr/bin/env python3
"""GPU checks of decode on the device (docs/decode-on-device.md), each recorded by tools/device/checks.py:

- equivalence: device decode (one graph per token, experts read through the table, token chosen on the GPU)
  against transformers' greedy tokens on tiny checkpoints, fp32 and bf16, every expert resident and 25% (misses
  redo a token), under the near-tie rule of tests/hf_reference.py (both numbers reported);
- host syncs: CUDA runtime synchronisations per resident device token (torch.profiler), bound <= 2;
- one MoE layer at 30B-A3B shapes (H 2048, I 768, k 8, bf16) in a graph: the fused Triton GEMV and the torch
  path, against the byte bound at the HBM bandwidth a large copy reaches; the same from int8 and int4 g128
  records (Triton GEMVs reading them in place; int4 also through tinygemm, the torch path), and the int4
  prefill's dequantize kernel against the torch ops it replaced (bit-equal, both timed), reported only;
- one layer's attention at 30B-A3B shapes (32/4 heads, d 128, bf16, capacities 1536 and 4096) in a graph: the
  split-KV Triton kernel (kernels/decode_attention.py) against the compiled SDPA path it replaced.
- the dense projections at 30B-A3B shapes (o_proj, the router, q/k/v stacked; bf16, one row) in a graph: the
  Triton GEMV (kernels/dense_gemv.py) against cuBLAS, with their byte bounds; the one-kernel router
  (kernels/decode_router.py route_and_lookup) against the compiled three-kernel router, same experts and slots.
    python3 tools/device/decode_checks.py --out $OUT/decode_checks.json
`--compile`: the equivalence checks with each layer's attention and router compiled (kernels/decode_layer.py),
and the host syncs of the compiled token.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checks import Checks  # noqa: E402
from quant_checks import cuda_median_us  # noqa: E402

from tests.hf_reference import NEW_TOKENS, PROMPTS, hf_kwargs, near_tie_divergence  # noqa: E402

DEVICE = "cuda"  # --device cpu: a dry run of the equivalence checks on the CPU (no graphs)
COMPILE = False  # --compile: the device token's layers compiled
# runtime calls that block the host on the GPU (a cudaMemcpyAsync to pageable memory shows up as a stream sync)
SYNC_CALLS = {"cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"}


def _engine(model_dir: Path, budget: str, pinned_layers: int = 1):  # type: ignore[no-untyped-def]
    import vismmoe_edge

    engine = vismmoe_edge.load(model_dir, memory_budget=budget, pinned_layers=pinned_layers, device=DEVICE,
                               tier="gpu" if DEVICE == "cuda" else "host", host_tier=DEVICE == "cuda")  # fmt: skip
    engine.static_decode = "on"
    engine.device_decode = "on"
    engine.compile_decode = COMPILE
    return engine


def equivalence(tmp: Path, images: list[Path], dtype: torch.dtype, budget: str, *, mapped: bool = False,
                lookahead: int = 0) -> dict:  # fmt: skip
    """`mapped`: experts not in a slot read in place from the pinned host tier (an untransposed checkpoint);
    `lookahead`: with that many of the next layer's likely ones staged in HBM a layer ahead (mapped_prefetch.py)."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.sampling import SamplingConfig
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    layout = "v5" if mapped else "hub"
    model_dir = build_tiny_checkpoint(tmp / f"m-{dtype}-{layout}".replace("torch.", ""), seed=5, dtype=dtype,
                                      layout=layout, num_layers=8)  # fmt: skip
    engine = _engine(model_dir, budget)
    engine.device_decode_mapped = mapped
    engine.mapped_lookahead = lookahead
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
    ref = ref.to(DEVICE).eval()
    out: dict = {"prompts": {}}
    ok = True
    for name, (prompt, n_images) in PROMPTS.items():
        inputs = engine.encode(prompt, images[:n_images])
        kwargs = {k: v.to(DEVICE) for k, v in hf_kwargs(inputs).items()}
        with torch.no_grad():
            gen = ref.generate(**kwargs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)  # fmt: skip
        ref.model.rope_deltas = None
        tokens = gen.sequences[0, inputs.num_tokens :].tolist()
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        result = engine.generate_from_inputs(inputs, sampling)
        divergence = None
        if result.token_ids != tokens:  # teacher-forced on the reference's tokens, through the device token
            forced = teacher_forced_device(engine, inputs, tokens, sampling)
            divergence = near_tie_divergence(result.token_ids, tokens, [s[0].float().cpu() for s in gen.logits], forced)
            ok &= divergence.accepted
        out["prompts"][name] = {"equal": divergence is None,
                                "divergence": None if divergence is None else divergence.describe()}  # fmt: skip
    decoders = [d for d in engine._decoders.values() if d.on_device]
    out["tokens_redone"] = sum(d.redone for d in decoders)
    out["graphs"] = all(d.graphs for d in decoders)
    out["mapped_experts"] = max((d.mapped_experts for d in decoders), default=0)
    # at 25% on GPU slots the token embedding is in mapped host memory (models/host_embedding.py): these checks
    # are its first on a GPU
    out["embedding"] = type(engine.model.model.language_model.embed_tokens).__name__
    if budget != "100%" and DEVICE == "cuda":
        ok &= out["embedding"] == "HostEmbedding"
    out["fused"] = any(d.fused is not None for d in decoders)
    out["compiled"] = any(d.fused is not None and d.fused.compiled for d in decoders)
    ok &= out["fused"] == COMPILE and out["compiled"] == (COMPILE and DEVICE == "cuda")
    if mapped:  # every streamed expert is in the host tier: no token may miss
        ok &= out["mapped_experts"] > 0 and out["tokens_redone"] == 0
    if lookahead:  # the decoder took the lookahead; what its last token left staged (the last two layers), reported
        staged = [d.lookahead.staging.ids for d in decoders if d.lookahead is not None]
        out["staged_in_last_token"] = sum(int((ids >= 0).sum()) for ids in staged)
        ok &= bool(staged)
    return {"ok": ok and bool(decoders), **out}


def teacher_forced_device(engine, inputs, tokens: list[int], sampling) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Per-step logits of the device token (StaticDecoder.token_step) fed the reference's tokens."""
    logits, state = engine.prefill(inputs)
    engine.start_decode(state, len(tokens))
    decoder = state.static
    assert decoder is not None and decoder.on_device
    decoder.sampler.set_stops(engine.eos_token_ids)
    steps = [logits.float().cpu()]
    for produced, token in enumerate(tokens[:-1], start=1):
        engine.device_token(token, state, sampling, produced)
        steps.append(decoder.logits.float().cpu().clone())
    return steps


def host_syncs(tmp: Path, images: list[Path]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from vismmoe_edge.sampling import SamplingConfig
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp / "syncs", seed=5, dtype=torch.bfloat16, layout="hub", num_layers=8)
    engine = _engine(model_dir, "100%", pinned_layers=8)  # every expert preloaded: no token can miss
    inputs = engine.encode(PROMPTS["text"][0], [])
    warm = SamplingConfig(max_new_tokens=8, min_new_tokens=8, temperature=1.0, seed=1)
    engine.generate_from_inputs(inputs, warm)  # captures the sampled token's graph
    decoders = [d for d in engine._decoders.values() if d.on_device]
    redone_before = sum(d.redone for d in decoders)
    tokens = 16
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=tokens + 1, min_new_tokens=tokens + 1,
                                                           temperature=1.0, seed=0))  # fmt: skip
    counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNC_CALLS}
    launches = sum(e.count for e in prof.key_averages() if e.key.startswith("cudaGraphLaunch"))
    redone = sum(d.redone for d in decoders) - redone_before
    # the prefill's syncs are in the window too: report them apart by subtracting a prefill-only window
    with profile(activities=[ProfilerActivity.CPU]) as pre:
        engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=1))
    prefill = sum(e.count for e in pre.key_averages() if e.key in SYNC_CALLS)
    per_token = (sum(counts.values()) - prefill) / tokens
    return {"ok": bool(decoders) and per_token <= 2 and redone == 0, "syncs_per_token": per_token, "sync_calls": counts,
            "prefill_syncs": prefill, "graph_launches_per_token": launches / tokens,
            "tokens_redone": redone}  # fmt: skip


def timed(fn, reps: int = 200) -> float:  # type: ignore[no-untyped-def]
    """Mean microseconds of `reps` back-to-back calls, between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def timed_cold(fn, reps: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds of single calls, each after 256 MB written to evict L2 (50 MB on an H100 or H200):
    back to back (`timed`), an int4 layer's 20 MB of records stays in L2, which a token's 48 layers do not allow
    (run 13: the int4 token saved 0.35 ms against bf16 where `timed` layers predicted ~0.8 ms)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    return cuda_median_us(fn, reps, before=flush.zero_)


def in_graph(fn):  # type: ignore[no-untyped-def]
    """`fn` captured in a CUDA graph (after one warm call); returns the replay."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def attention_layer() -> dict:
    """One layer's attention of the compiled decode token at 30B-A3B shapes (32 query heads, 4 KV heads, d 128,
    bf16), capacities 1536 and 4096 at length capacity // 2, in a graph: the split-KV kernel
    (kernels/decode_attention.py) against the compiled path it replaced (K/V repeated per group, SDPA with the
    additive mask), and the byte bound of the visible K/V at the HBM bandwidth. Error against eager SDPA."""
    from vismmoe_edge.kernels.moe_decode import HAS_TRITON

    if not HAS_TRITON:
        return {"ok": True, "skipped": "no Triton"}
    hbm = hbm_bandwidth(timed)
    out: dict = {"hbm_gb_s": hbm / 1e9}
    for capacity in (1536, 4096):
        out[f"capacity_{capacity}"] = attention_at(capacity, hbm)
    return {"ok": all([r.pop("ok") for r in out.values() if isinstance(r, dict)]), **out}


def attention_at(capacity: int, hbm: float) -> dict:
    from vismmoe_edge.kernels.decode_attention import decode_attention, num_splits

    heads, kv_heads, d, dtype = 32, 4, 128, torch.bfloat16
    groups, scale = heads // kv_heads, d**-0.5
    q = torch.randn(1, heads, 1, d, device="cuda", dtype=dtype)
    keys, values = (torch.randn(1, kv_heads, capacity, d, device="cuda", dtype=dtype) for _ in range(2))
    length = torch.tensor([capacity // 2], device="cuda")
    positions = torch.arange(capacity, device="cuda")

    def sdpa_path(q, keys, values, length):  # type: ignore[no-untyped-def]  # decode_layer's, before the kernel
        mask = torch.zeros(capacity, dtype=dtype, device="cuda").masked_fill(positions > length,
                                                                             torch.finfo(dtype).min)  # fmt: skip
        kk = keys[:, :, None].expand(1, kv_heads, groups, capacity, d).reshape(1, heads, -1, d)
        vv = values[:, :, None].expand(1, kv_heads, groups, capacity, d).reshape(1, heads, -1, d)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask.view(1, 1, 1, -1), scale=scale)

    compiled_sdpa = torch.compile(sdpa_path, dynamic=False, fullgraph=True)
    compiled_kernel = torch.compile(lambda *a: decode_attention(*a, scale), dynamic=False, fullgraph=True)
    args = (q, keys, values, length)
    ref = sdpa_path(*args).float()
    err = max(float((decode_attention(*args, scale).float() - ref).abs().max()),
              float((compiled_kernel(*args).float() - ref).abs().max()))  # fmt: skip
    kernel_us = timed(in_graph(lambda: compiled_kernel(*args)))
    sdpa_us = timed(in_graph(lambda: compiled_sdpa(*args)))
    bound_us = 2 * kv_heads * (capacity // 2 + 1) * d * keys.element_size() / hbm * 1e6
    return {"ok": err < 2e-2 and kernel_us < sdpa_us, "splits": num_splits(capacity, kv_heads),
            "kernel_us": kernel_us, "compiled_sdpa_us": sdpa_us, "kv_byte_bound_us": bound_us,
            "max_abs_error": err}  # fmt: skip


def dense_projections() -> dict:
    """The compiled token's dense projections at 30B-A3B shapes (bf16, one row), each in a graph: the Triton GEMV
    (kernels/dense_gemv.py) against F.linear (cuBLAS), with the byte bound at the HBM bandwidth and the largest
    difference from the float64 product in units of the output's bf16 rounding step, and for o_proj the GEMV's
    blocks and warps swept (`gemv_sweep`: run 12's o_proj on an H100 took 15.2 us at the shipped blocks, cuBLAS
    10.1, so o_proj is off by default until a sweep finds blocks faster than cuBLAS). Passes where both are
    within rounding and the one-kernel router passes (the default's one Triton projection); the rest is
    reported."""
    from vismmoe_edge.kernels.dense_gemv import dense_gemv, dense_gemv_reference
    from vismmoe_edge.kernels.moe_decode import HAS_TRITON

    if not HAS_TRITON:
        return {"ok": True, "skipped": "no Triton"}
    hbm = hbm_bandwidth(timed)
    out: dict = {"hbm_gb_s": hbm / 1e9}
    ok = True
    for name, (n, k) in {"o": (2048, 4096), "router": (128, 2048), "qkv": (5120, 2048)}.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
        ref = dense_gemv_reference(x, w).double()
        step = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-3)
        steps = {f: float(((y.double() - ref).abs() / step).max()) for f, y in
                 (("triton", dense_gemv(x, w)), ("cublas", F.linear(x, w)))}  # fmt: skip
        triton_us = timed(in_graph(lambda x=x, w=w: dense_gemv(x, w)))
        cublas_us = timed(in_graph(lambda x=x, w=w: F.linear(x, w)))
        ok = ok and max(steps.values()) <= 1.0
        out[name] = {"shape": [n, k], "triton_us": triton_us, "cublas_us": cublas_us,
                     "byte_bound_us": n * k * 2 / hbm * 1e6, "rounding_steps_from_float64": steps}  # fmt: skip
        if name == "o":  # (each point is a Triton compile: the one shape whose default is in question)
            out[name]["sweep"] = gemv_sweep(x, w)
    out["router_one_kernel"] = one_kernel_router()
    return {"ok": ok and out["router_one_kernel"].pop("ok"), **out}


def gemv_sweep(x: torch.Tensor, w: torch.Tensor) -> dict:
    """The dense GEMV kernel (kernels/triton_decode.py) at rows a program x columns a step x warps, each in a graph:
    the five fastest (microseconds) and the shipped blocks' time, for choosing `dense_gemv.blocks` from data."""
    from vismmoe_edge.kernels import triton_decode
    from vismmoe_edge.kernels.dense_gemv import blocks

    n, k = w.shape
    out = torch.empty(1, n, dtype=w.dtype, device=w.device)
    times = {}
    for rows in (1, 2, 4, 8, 16):
        for cols in (256, 512, 1024, 2048):
            for warps in (2, 4, 8):
                if rows * cols > 8192 or cols > k:
                    continue

                def gemv(rows: int = rows, cols: int = cols, warps: int = warps) -> None:
                    triton_decode._dense_gemv_kernel[(-(-n // rows),)](
                        x, w, out, n, k, w.stride(0), BLOCK_N=rows, BLOCK_K=cols, num_warps=warps
                    )

                times[f"{rows}x{cols}/{warps}w"] = timed(in_graph(gemv))
    shipped = blocks(n, k)
    fastest = sorted(times.items(), key=lambda kv: kv[1])[:5]
    return {"fastest_us": dict(fastest), "shipped": f"{shipped[0]}x{shipped[1]}/4w",
            "shipped_us": times.get(f"{shipped[0]}x{shipped[1]}/4w")}  # fmt: skip


def one_kernel_router() -> dict:
    """The resident token's router at 30B-A3B shapes (128 experts, H 2048, k 8, bf16) in a graph: the one kernel
    of kernels/decode_router.py (GEMV, top-k, table lookup, the rows) against the compiled router it replaces
    (cuBLAS's GEMV, the top-k kernel, the lookup kernel), over 200 random tokens: the same experts and slots
    wherever the reference's k-th and (k+1)-th logits are apart (near-ties counted, not failed)."""
    from vismmoe_edge.kernels.decode_layer import make_route
    from vismmoe_edge.kernels.decode_router import ROUTE_WARPS, route_and_lookup

    experts, hidden, k = 128, 2048, 8
    w = (torch.randn(experts, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    table = torch.randperm(4096, device="cuda")[:experts].to(torch.int32)
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    routing, missed = torch.zeros(k, dtype=torch.long, device="cuda"), torch.zeros((), dtype=torch.bool, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    compiled = torch.compile(make_route(k), dynamic=False, fullgraph=True)

    def compare(warps: int) -> tuple[int, int]:
        """(tokens differing from the compiled router, of which near-ties) over 200 random tokens."""
        differ = near_ties = 0
        for _ in range(200):
            x.copy_(torch.randn(1, hidden, device="cuda"))
            index, _, slots = route_and_lookup(x, w, table, routing, missed, counter, num_warps=warps)
            ref_index, _, ref_slots, _ = compiled(x, w, table, routing, missed)
            if not (torch.equal(index, ref_index) and torch.equal(slots, ref_slots)):
                logits = F.linear(x, w).float().topk(k + 1).values[0]
                near_ties += bool(logits[k - 1] - logits[k] <= 2 * torch.finfo(torch.bfloat16).eps * logits.abs().max())
                differ += 1
        return differ, near_ties

    # warps a program: time and tokens of each, for the next default (decode_router.ROUTE_WARPS, one of them)
    sweep = {}
    for warps in (1, 2, 4, 8):
        differ, near_ties = compare(warps)
        route = lambda warps=warps: route_and_lookup(x, w, table, routing, missed, counter, num_warps=warps)  # noqa: E731
        sweep[f"{warps}w"] = {"us": timed(in_graph(route)), "tokens_differing": differ, "of_which_near_ties": near_ties}
    shipped = sweep[f"{ROUTE_WARPS}w"]
    three_us = timed(in_graph(lambda: compiled(x, w, table, routing, missed)))
    return {
        "ok": shipped["tokens_differing"] == shipped["of_which_near_ties"] and int(counter) == 0
        and shipped["us"] < three_us,
        "one_kernel_us": shipped["us"],
        "compiled_three_kernels_us": three_us,
        "tokens_differing": shipped["tokens_differing"],
        "of_which_near_ties": shipped["of_which_near_ties"],
        "shipped_warps": ROUTE_WARPS,
        "warps_sweep": sweep,
    }


def hbm_bandwidth(timed) -> float:  # type: ignore[no-untyped-def]
    """Bytes per second a 2 GiB device-to-device copy moves (each byte read and written)."""
    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    return 2 * buf.numel() / (timed(lambda: dst.copy_(buf), 5) * 1e-6)


def moe_layer() -> dict:
    from vismmoe_edge.experts.pool_compute import decode_experts
    from vismmoe_edge.kernels import moe_decode as md

    hidden, inter, k, slots = 2048, 768, 8, 128
    gate_up = torch.randn(slots, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(slots, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    sel = torch.randperm(slots, device="cuda")[:k].view(1, k)
    w = torch.softmax(torch.randn(1, k, device="cuda"), -1)

    hbm = hbm_bandwidth(timed)

    fused = lambda: md.fused_decode(x, sel, w, gate_up, down, F.silu)  # noqa: E731
    torch_path = lambda: decode_experts(x, sel, w, gate_up, down, F.silu)  # noqa: E731
    a, b = fused().float(), torch_path().float()
    err = float((a - b).abs().max() / b.abs().max())
    bound_us = k * 3 * hidden * inter * 2 / hbm * 1e6
    fused_graph = in_graph(fused)
    fused_us, torch_us = timed(fused_graph), timed(in_graph(torch_path))
    fused_cold_us = timed_cold(fused_graph)
    # what every timing here includes besides its kernels: a graph's launch and one tiny kernel (a token's 48 layers
    # share one launch, so a layer inside a token costs its kernels, about the timing less this)
    tiny = torch.zeros(1, device="cuda")
    graph_floor_us = timed(in_graph(lambda: tiny.add_(1)))
    try:  # reported only: its failure must not hide the numbers above
        mapped = mapped_layer(x, sel, w, gate_up, down, timed, in_graph)
    except Exception as e:  # noqa: BLE001
        mapped = {"mapped_error": f"{type(e).__name__}: {e}"}
    try:
        int8 = int8_layer(x, sel, w, gate_up, down, hbm, timed, in_graph)
    except Exception as e:  # noqa: BLE001
        int8 = {"int8_error": f"{type(e).__name__}: {e}"}
    try:
        int4 = int4_layer(x, sel, w, gate_up, down, hbm, timed, in_graph)
    except Exception as e:  # noqa: BLE001
        int4 = {"int4_error": f"{type(e).__name__}: {e}"}
    return {"ok": err < 2e-2 and fused_us <= 2 * bound_us, "hbm_gb_s": hbm / 1e9, "byte_bound_us": bound_us,
            "fused_us": fused_us, "torch_us": torch_us, "fused_over_bound": fused_us / bound_us,
            "fused_cold_us": fused_cold_us, "fused_cold_over_bound": fused_cold_us / bound_us,
            "one_kernel_graph_us": graph_floor_us, "relative_error": err, **mapped, **int8, **int4}  # fmt: skip


def int8_layer(x, sel, w, gate_up, down, hbm, timed, in_graph) -> dict:  # type: ignore[no-untyped-def]
    """The same layer from int8 records (quant/record.py) read in place by the Triton kernel, against the int8
    byte bound and the dequantize-then-GEMM path; error against the dequantized weights (reported only)."""
    from vismmoe_edge.experts.quant_pool import decode_quantized
    from vismmoe_edge.kernels import moe_decode as md
    from vismmoe_edge.quant.config import make_config
    from vismmoe_edge.quant.kernels import dequantize_expert, expert_views
    from vismmoe_edge.quant.packing import ROWMAJOR
    from vismmoe_edge.quant.record import ExpertSpec, encode_expert
    from vismmoe_edge.quant.slot_form import SlotForm

    hidden, inter = gate_up.shape[2], down.shape[2]
    spec = ExpertSpec(make_config(8, None, ROWMAJOR), hidden, inter)
    rows = []
    for s in range(gate_up.shape[0]):
        parts = encode_expert(spec, gate_up[s].float().cpu(), down[s].float().cpu())
        rows.append(torch.cat([t.reshape(-1).view(torch.uint8) for t in parts]))
    records = torch.stack(rows).to(gate_up.device)
    form = SlotForm.for_device(spec, gate_up.device)
    fused = lambda: md.fused_decode_records(x, sel, w, records, form, F.silu)  # noqa: E731
    dequant = lambda: decode_quantized(x, sel, w, records, form, F.silu)  # noqa: E731
    ref_w = [dequantize_expert(expert_views(records[s].cpu(), spec)) for s in sel[0].tolist()]
    ref = torch.zeros(1, hidden)
    for j, (g, d) in enumerate(ref_w):
        gate, up = F.linear(x.float().cpu(), g).chunk(2, dim=-1)
        ref += F.linear(F.silu(gate) * up, d) * float(w[0, j])
    err = float((fused().float().cpu() - ref).abs().max() / ref.abs().max())
    bound_us = sel.shape[1] * spec.nbytes / hbm * 1e6
    graph = in_graph(fused)
    int8_us, dequant_us, cold_us = timed(graph), timed(in_graph(dequant)), timed_cold(graph)
    return {"int8_us": int8_us, "int8_byte_bound_us": bound_us, "int8_over_bound": int8_us / bound_us,
            "int8_cold_us": cold_us, "int8_cold_over_bound": cold_us / bound_us,
            "int8_dequantize_path_us": dequant_us, "int8_relative_error": err}  # fmt: skip


def int4_dequantize(records, form, timed) -> dict:  # type: ignore[no-untyped-def]
    """The int4 prefill's dequantize of every slot (kernels/dequant_int4.py, reading the records in place) against
    the torch ops it replaced (gathered records, float32 intermediates): equal bit for bit, and both timed."""
    from vismmoe_edge.experts.quant_pool import dequantize_rowmajor, dequantize_slots

    slots = torch.arange(records.shape[0], device=records.device)
    out: dict = {}
    for name in ("gate_up_proj", "down_proj"):
        kernel = dequantize_slots(records, form, slots, name, torch.bfloat16)
        ops = dequantize_rowmajor(form, records.index_select(0, slots), name, torch.bfloat16)
        out[f"int4_dequantize_{name}_equal"] = bool(torch.equal(kernel, ops))
    out["int4_dequantize_slots"] = int(slots.shape[0])
    out["int4_dequantize_kernel_us"] = timed(lambda: dequantize_slots(records, form, slots, "gate_up_proj",
                                                                      torch.bfloat16), 20)  # fmt: skip
    out["int4_dequantize_torch_us"] = timed(lambda: dequantize_rowmajor(
        form, records.index_select(0, slots), "gate_up_proj", torch.bfloat16), 20)  # fmt: skip
    out.update(int4_prefill_layer(records, form, timed))
    return out


def int4_prefill_layer(records, form, timed) -> dict:  # type: ignore[no-untyped-def]
    """One MoE layer's prefill from int4 slots, 1,089 tokens routed top-8 over every slot (a pinned layer's `run`):
    kernels/grouped_int4.py reading the codes in place against the slots dequantized, then torch's grouped GEMM;
    the two outputs' largest relative difference (the sums' order only)."""
    import torch.nn.functional as F

    from vismmoe_edge.experts.quant_pool import prefill_rowmajor_int4, reads_int4_in_place

    hidden, slots_n = form.spec.hidden, records.shape[0]
    g = torch.Generator(device=records.device).manual_seed(3)
    x = torch.randn(1089, hidden, device=records.device, generator=g).to(torch.bfloat16)
    k = min(8, slots_n)
    slots = torch.rand(1089, slots_n, device=records.device, generator=g).topk(k, dim=-1).indices
    weights = torch.full((1089, k), 1 / k, device=records.device, dtype=torch.bfloat16)

    def layer(in_place: bool) -> torch.Tensor:
        return prefill_rowmajor_int4(x, slots, weights, records, form, F.silu, grouped=True, run=(0, slots_n),
                                     in_place=in_place)  # fmt: skip

    out: dict = {"int4_prefill_in_place": reads_int4_in_place(records, form, torch.bfloat16)}
    if not out["int4_prefill_in_place"]:
        return out
    a, b = layer(True).float(), layer(False).float()
    out["int4_prefill_in_place_relative_difference"] = ((a - b).abs().max() / b.abs().max()).item()
    out["int4_prefill_in_place_us"] = timed(lambda: layer(True), 10)
    out["int4_prefill_dequantize_us"] = timed(lambda: layer(False), 10)
    return out


def int4_layer(x, sel, w, gate_up, down, hbm, timed, in_graph) -> dict:  # type: ignore[no-untyped-def]
    """The same layer from int4 g128 records: row-major nibbles read in place by the Triton GEMV (the slot form
    of the device decode path, kernels/moe_int4.py), against the int4 byte bound, and the same records in
    tinygemm's tiles through the torch path (gathered copy, then tinygemm per expert); each one's error against
    the dequantized weights' float32 computation (reported only)."""
    from vismmoe_edge.experts.quant_pool import decode_quantized
    from vismmoe_edge.kernels import moe_decode as md
    from vismmoe_edge.quant.config import make_config
    from vismmoe_edge.quant.kernels import dequantize_expert, expert_views
    from vismmoe_edge.quant.packing import ROWMAJOR
    from vismmoe_edge.quant.record import ExpertSpec, encode_expert
    from vismmoe_edge.quant.slot_form import SlotForm

    hidden, inter = gate_up.shape[2], down.shape[2]
    spec = ExpertSpec(make_config(4, 128, ROWMAJOR), hidden, inter)
    rows = []
    for s in range(gate_up.shape[0]):  # quantized on the GPU (plain tensor ops)
        parts = encode_expert(spec, gate_up[s].float(), down[s].float())
        rows.append(torch.cat([t.reshape(-1).view(torch.uint8) for t in parts]))
    records = torch.stack(rows)
    form = SlotForm.for_device(spec, records.device, triton=True)
    out: dict = {"int4_triton_form": form.triton_int4}
    ref_w = [dequantize_expert(expert_views(records[s].cpu(), spec)) for s in sel[0].tolist()]
    ref = torch.zeros(1, hidden)
    for j, (g, d) in enumerate(ref_w):
        gate, up = F.linear(x.float().cpu(), g).chunk(2, dim=-1)
        ref += F.linear(F.silu(gate) * up, d) * float(w[0, j])
    bound_us = sel.shape[1] * spec.nbytes / hbm * 1e6
    out["int4_byte_bound_us"] = bound_us
    if md.use_triton_int4(records, form):
        fused = lambda: md.fused_decode_records(x, sel, w, records, form, F.silu)  # noqa: E731
        out["int4_relative_error"] = float((fused().float().cpu() - ref).abs().max() / ref.abs().max())
        graph = in_graph(fused)
        out["int4_us"] = timed(graph)
        out["int4_over_bound"] = out["int4_us"] / bound_us
        out["int4_cold_us"] = timed_cold(graph)  # L2 evicted first, as in a token
        out["int4_cold_over_bound"] = out["int4_cold_us"] / bound_us
        out.update(int4_dequantize(records, form, timed))
    tiles = SlotForm.for_device(spec, records.device)  # the per-layer path's form: tinygemm's tiles
    tiled = records.clone()
    if tiles.rebuilds:
        for s in range(tiled.shape[0]):
            tiles.build(tiled[s])
    torch_path = lambda: decode_quantized(x, sel, w, tiled, tiles, F.silu)  # noqa: E731
    out["int4_tinygemm_relative_error"] = float((torch_path().float().cpu() - ref).abs().max() / ref.abs().max())
    out["int4_tinygemm_path_us"] = timed(in_graph(torch_path))
    return out


def mapped_layer(x, sel, w, gate_up, down, timed, in_graph) -> dict:  # type: ignore[no-untyped-def]
    """The same layer with 4 of its 8 experts read in place from pinned host memory (mapped_decode), against the
    bus bound: those experts' bytes at the pinned host-to-device bandwidth a 1 GiB copy reaches (reported only)."""
    from vismmoe_edge.kernels import moe_decode as md

    k = sel.shape[1]
    host = torch.empty(k // 2, gate_up[0].numel() + down[0].numel(), dtype=gate_up.dtype, pin_memory=True)
    for j in range(k // 2):  # experts sel[k/2:] copied to host, slot-shaped
        s = int(sel[0, k // 2 + j])
        host[j, : gate_up[0].numel()].copy_(gate_up[s].reshape(-1))
        host[j, gate_up[0].numel() :].copy_(down[s].reshape(-1))
    table = torch.full((gate_up.shape[0],), -1, dtype=torch.int32, device="cuda")
    index = torch.arange(k, device="cuda").view(1, k)  # expert ids 0..k-1 for the table
    table[: k // 2] = sel[0, : k // 2].to(torch.int32)
    host_row = torch.zeros(gate_up.shape[0], 2, dtype=torch.int64)
    for j in range(k // 2):
        base = host[j].data_ptr()
        host_row[k // 2 + j] = torch.tensor([base, base + gate_up[0].nbytes])
    host_row = host_row.cuda()

    def run():  # type: ignore[no-untyped-def]
        return md.mapped_decode(x, index, table, w, host_row, type("Pool", (), {"gate_up": gate_up, "down": down}),
                                F.silu)  # fmt: skip

    out, missed = run()
    ref = md.fused_decode(x, sel, w, gate_up, down, F.silu).float()
    err = float((out.float() - ref).abs().max() / ref.abs().max())
    big = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(big, device="cuda")
    pinned = big.numel() / (timed(lambda: dev.copy_(big, non_blocking=True), 5) * 1e-6)
    bus_us = host.nbytes / pinned * 1e6
    mapped_us = timed(in_graph(run))
    return {
        "mapped_relative_error": err,
        "mapped_missed": bool(missed),
        "pinned_gb_s": pinned / 1e9,
        "mapped_us": mapped_us,
        "mapped_bus_bound_us": bus_us,
        "mapped_over_bus_bound": mapped_us / bus_us,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--compile", action="store_true", help="the device token's layers compiled (torch.compile)")
    ap.add_argument("--skip-layer", action="store_true", help="skip the one-layer timings (MoE, attention)")
    ap.add_argument("--only-layer", action="store_true", help="only the one-layer timings")
    ap.add_argument("--only-mapped", action="store_true",
                    help="only the equivalence checks reading in place, without and with the lookahead")
    args = ap.parse_args(argv)
    global DEVICE, COMPILE
    DEVICE, COMPILE = args.device, args.compile
    from igpu_checks import make_images

    checks = Checks()
    if not args.only_layer:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            images = make_images(tmp)
            for dtype in () if args.only_mapped else (torch.bfloat16,) if COMPILE else (torch.float32, torch.bfloat16):
                for budget in ("100%", "25%"):
                    checks.run(f"equivalence {dtype} {budget}", lambda dtype=dtype, budget=budget: equivalence(
                        tmp, images, dtype, budget), needs_cuda=DEVICE == "cuda")  # fmt: skip
            checks.run("equivalence bf16 25% read in place from the host tier",
                       lambda: equivalence(tmp, images, torch.bfloat16, "25%", mapped=True))  # fmt: skip
            if args.only_mapped:  # (the lookahead is off by default: checked where it is about to be timed)
                staged = lambda: equivalence(tmp, images, torch.bfloat16, "25%", mapped=True, lookahead=2)  # noqa: E731
                checks.run("equivalence bf16 25% read in place, 2 experts a layer staged a layer ahead", staged)
            else:
                checks.run("host syncs per resident device token", lambda: host_syncs(tmp, images))
    if not args.skip_layer and not args.only_mapped:
        checks.run("one MoE layer against its byte bound", moe_layer)
        checks.run("one layer's attention: split-KV kernel against compiled SDPA", attention_layer)
        checks.run("dense projections: the Triton GEMV against cuBLAS", dense_projections)
    args.out.write_text(json.dumps(checks.results, indent=1))
    return 0 if all(r["status"] != "fail" for r in checks.results) else 1


if __name__ == "__main__":
    sys.exit(main())
