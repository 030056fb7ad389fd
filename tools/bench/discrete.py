#!/usr/bin/env python3
"""Discrete-GPU benchmark: Qwen3-VL-30B-A3B-sized synthetic checkpoint (all 48 layers) on one CUDA GPU.

Compares, in one run, decode tokens/s and prefill latency (a prompt with ~1,100 image tokens) of:
- transformers' own model with every weight on the GPU (the ceiling), and Hugging Face Accelerate offload at the
  same GPU budget (the seed paper's baseline), each in its own process;
- vismmoe-edge with every expert preloaded into the GPU pool (our ceiling);
- vismmoe-edge at the budget, with the pinned host tier the planner picks on this host: eviction by popularity
  (the default) and by LRU, without prediction, with the learned lookahead predictor (trace replay) and with
  CUDA graphs off (what the graphs buy);
- the integrated-GPU tiers at the same budget, held in pinned host memory instead of GPU memory (`unified-slots`:
  slots the GPU reads in place over the bus; `unified-registered`: the shards' own pages registered read-only).
  On a discrete GPU every expert byte a kernel reads crosses PCIe, so these are slow here by construction; the
  rows measure the Jetson path's bytes and overheads on the GPU we have;
- the oracle bound: Belady's fewest bytes for the recorded routing at the same slot count, moved at the
  measured pinned bandwidth, overlapped perfectly with the all-resident compute time;
and a torch.profiler window over decode steps at the budget: GPU compute busy, copy-engine busy, their union,
kernel launches, graph launches and synchronisations per token, the DMA bandwidth misses moved at.

One engine per configuration is loaded once and its GPU cache emptied before every trial (`pipeline.clear`),
so trials start cold while the host tier stays filled, as in a running server. Trials are interleaved.
Decode is sampled (temperature 1) or replayed from a real routing trace; never greedy on random weights.
Run on the GPU server:  python3 tools/bench/discrete.py --out-dir /tmp/bench --json $OUT/discrete.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.experts import compute as expert_compute  # noqa: E402
from vismmoe_edge.experts.compute import ARRIVAL_MIN_BYTES  # noqa: E402
from vismmoe_edge.experts.promotion import PROMOTIONS_PER_TOKEN  # noqa: E402
from vismmoe_edge.experts.recency import PROMPT_HALF_LIFE_TOKENS  # noqa: E402
from vismmoe_edge.kernels.dense_gemv import DEFAULT_PROJECTIONS, gemv_projections  # noqa: E402
from vismmoe_edge.kernels.mapped_prefetch import LOOKAHEAD_PER_LAYER  # noqa: E402

IMAGE_SIDE = int(os.environ.get("BENCH_IMAGE_SIDE", 1056))  # 66 x 66 patches of 16 px -> 33 x 33 = 1,089 visual tokens
# "cpu": a smoke run of the harness (`BENCH_DEVICE=cpu BENCH_IMAGE_SIDE=256 ... --layers 1 --new-tokens 4`: ~1 min)
DEVICE = os.environ.get("BENCH_DEVICE", "cuda")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()
PROMPT = "Describe everything in this picture in detail."


def gpu_normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random weights drawn on the GPU (the CPU generator needs minutes for 30 B values)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=g))
    cuda_g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=cuda_g, device="cuda", dtype=torch.float32) * std).to(dtype).cpu()


def build_checkpoint(out: Path, layers: int) -> Path:
    from checkpoints import synthetic_qwen3_vl_moe as msc

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_offline_processor

    if not (out / "model.safetensors.index.json").exists():
        if DEVICE == "cuda":
            msc._normal = gpu_normal  # same shapes and seeds per tensor, generated where it is fast
        start = time.perf_counter()
        msc.build_synthetic_checkpoint(out, layers=layers, vocab=151_936, shard_bytes=4 << 30, progress=True)
        print(f"built {out} in {time.perf_counter() - start:.0f} s", flush=True)
    # a processor that keeps a 1056 px image whole: ~1,100 visual tokens, as MME images give
    build_offline_processor(min_pixels=32 * 32 * 4, max_pixels=IMAGE_SIDE * IMAGE_SIDE).save_pretrained(out)
    return out


def make_image(path: Path) -> Path:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), (200, 200, 190))
    draw = ImageDraw.Draw(img)
    for i in range(12):
        x, y = 60 + (i * 211) % 900, 80 + (i * 137) % 880
        draw.ellipse((x, y, x + 90, y + 90), fill=((i * 70) % 256, (i * 40) % 256, 200 - i * 10))
    img.save(path)
    return path


class TokenClock:
    """A transformers streamer that timestamps every put(): the prompt first, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_inputs(model_dir: Path, image: Path) -> dict[str, torch.Tensor]:
    """The benchmark prompt as transformers' model takes it, on the GPU."""
    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor
    from vismmoe_edge.prompt import encode_prompt, load_image

    inputs = encode_prompt(load_processor(model_dir), PROMPT, [load_image(image)])
    kwargs = {
        "input_ids": inputs.input_ids,
        "attention_mask": torch.ones_like(inputs.input_ids),
        "pixel_values": inputs.pixel_values,
        "image_grid_thw": inputs.image_grid_thw,
        "mm_token_type_ids": inputs.mm_token_type_ids,
    }
    return {k: v.to("cuda") for k, v in kwargs.items()}


def hf_sampled_run(model, kwargs: dict[str, torch.Tensor], new_tokens: int, seed: int) -> tuple[float, list[float]]:
    """One sampled generate() of transformers' model: prefill seconds and the seconds of each decode step."""
    clock = TokenClock()
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            **kwargs,
            max_new_tokens=new_tokens + 1,
            min_new_tokens=new_tokens + 1,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            streamer=clock,
        )
    times = [start, *clock.times[1:]]  # the streamer's first put() is the prompt
    return times[1] - times[0], [b - a for a, b in zip(times[1:], times[2:], strict=False)]


def run_accelerate(model_dir: Path, image: Path, gpu_gib: float, new_tokens: int) -> dict:
    """Accelerate's big-model offload at `gpu_gib` of GPU memory; the rest of the layers stay in host RAM."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.backends.cuda.enable_cudnn_sdp(False)  # the same attention kernels as our engine uses (see engine.py)
    start = time.perf_counter()
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map="auto", max_memory={0: f"{gpu_gib}GiB", "cpu": "115GiB"}
    ).eval()
    load_s = time.perf_counter() - start
    on_gpu = sum(1 for d in model.hf_device_map.values() if str(d) in ("0", "cuda:0"))
    kwargs = hf_inputs(model_dir, image)
    prefill_s, steps = hf_sampled_run(model, kwargs, new_tokens, seed=0)
    return {
        "strategy": "accelerate-offload",
        "load_s": load_s,
        "modules_on_gpu": on_gpu,
        "prefill_s": prefill_s,
        "decode_s_per_token": statistics.median(steps),
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "visual_tokens": int((kwargs["input_ids"] == model.config.image_token_id).sum()),
    }


def run_hf_resident(
    model_dir: Path, image: Path, new_tokens: int, *, static: bool = False, cudnn: bool | None = None
) -> dict:
    """transformers' own model with every weight on the GPU: the ceiling any offloading runtime aims at. `static`:
    generation_config.cache_implementation = "static" (generate then compiles the decode step): the reference
    column; the DynamicCache row is kept beside it. `cudnn`: whether SDPA may take cuDNN's kernel (default: with a
    static cache only); the static cache is measured both ways, and the faster is the reference."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    # DynamicCache: cuDNN's SDPA builds a graph for every KV length (~30 ms a step on an H200, engine.py), so its
    # best is without it; a static cache has one KV length, and runs with torch's own choice of SDPA kernel
    torch.backends.cuda.enable_cudnn_sdp(static if cudnn is None else cudnn)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    if static:
        model.generation_config.cache_implementation = "static"
    kwargs = hf_inputs(model_dir, image)
    prefills, rates = [], []
    for seed in range(3):
        prefill_s, steps = hf_sampled_run(model, kwargs, new_tokens, seed)
        prefills.append(prefill_s)
        rates.append(1 / statistics.median(steps))
    return {
        "strategy": ("hf-static-cache" if static else "hf-all-resident") + ("-no-cudnn" if cudnn is False else ""),
        "routing": "sampled",
        "prefill_s": statistics.median(prefills),
        "decode_tokens_per_s": statistics.median(rates),
        "decode_s_per_token": 1 / statistics.median(rates),
        "decode_tokens_per_s_all": rates,
    }


UNIFIED = ("unified-slots", "unified-registered")
BASELINES = ("hf-static", "hf-static-no-cudnn", "hf-resident", "accelerate")
ROW_PREDICTORS = {"learned": "learned", "unified-slots-next-layer-gate": "next-layer-gate"}  # (others: none)


def load_engine(
    model_dir: Path, budget: str, *, pinned_layers: int = 0, host_tier: bool = True, tier: str | None = None,
    embedding: str = "auto",
) -> object:
    import vismmoe_edge

    gc.collect()
    before = 0
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()  # engines loaded earlier: not this one's
    start = time.perf_counter()
    engine = vismmoe_edge.load(
        model_dir, memory_budget=budget, pinned_layers=pinned_layers, device=DEVICE,
        tier=tier or ("gpu" if DEVICE == "cuda" else "host"), predictor="none", host_tier=host_tier,
        embedding=embedding,
    )  # fmt: skip
    engine.load_s = time.perf_counter() - start
    # after the previous engine was freed
    engine.peak_gpu_bytes = torch.cuda.max_memory_allocated() - before if DEVICE == "cuda" else 0
    engine.gpu_bytes_before = before  # for the trials' peak (main): what engines loaded earlier hold
    return engine


def set_predictor(engine, name: str, predictor_file: Path | None) -> None:
    from vismmoe_edge.experts.runtime import attach_predictor
    from vismmoe_edge.predict.factory import make_predictor

    runtime = engine.experts
    if runtime.predictor_worker is not None:
        runtime.predictor_worker.close()
    old_observe = getattr(runtime.predictor, "observe", None)
    if old_observe is not None:
        runtime.route_hooks.remove(old_observe)
    runtime.predictor, runtime.predictor_worker = None, None
    spec = str(predictor_file) if name == "learned" else name
    attach_predictor(
        runtime, make_predictor(spec, engine.model_dir, engine.context, engine.model, on_gpu=DEVICE == "cuda")
    )


def run_trial(engine, image: Path, new_tokens: int, replay: Path | None, seed: int, *, policy: str = "popularity",
              graphs: bool = True, device_decode: str = "off", mapped: bool | str = False, compiled: bool | str = False,
              ahead: str = "auto", promotions: int = PROMOTIONS_PER_TOKEN, lookahead: int = LOOKAHEAD_PER_LAYER,
              gemv: str = DEFAULT_PROJECTIONS, arrival_min_bytes: float = ARRIVAL_MIN_BYTES,
              prompt_half_life: float = PROMPT_HALF_LIFE_TOKENS) -> dict:  # fmt: skip
    from vismmoe_edge.sampling import SamplingConfig

    pipeline = engine.experts.pipeline
    pipeline.policy = policy
    if engine.cuda_graphs != graphs:  # decoders are built with or without graphs
        engine.cuda_graphs = graphs
        engine._decoders.clear()
    engine.device_decode = device_decode  # the whole token on the device: its routing reaches no route hook
    engine.device_decode_mapped = mapped  # ... reading experts not in a slot from the pinned host tier in place
    engine.compile_decode = compiled  # ... with each layer's attention and router compiled (decode_layer.py)
    engine.decode_ahead = ahead  # ... each token launched before the host reads the one before it
    engine.promotions_per_token = promotions  # ... and up to this many experts it read in place moved into slots
    engine.mapped_lookahead = lookahead  # ... and this many of the next layer's likely ones staged a layer ahead
    engine.decode_gemv = gemv_projections(gemv)  # ... the compiled projections on the Triton GEMV (dense_gemv.py)
    engine.experts.prompt_half_life = prompt_half_life  # the prefill's experts ranked, last tokens first (recency.py)
    # a layer with this many bytes still being read computes its experts as they land (experts/arrival.py); inf:
    # it waits for every read, as before
    expert_compute.ARRIVAL_MIN_BYTES = arrival_min_bytes
    pipeline.clear()
    engine.observers = [o for o in engine.observers if type(o).__name__ != "TraceReplay"]
    engine.experts.replay = None
    if replay is not None:
        engine.replay_routing(replay, start_token=2000 * seed)  # each repeat replays another stretch
    routes: list[tuple[int, list[int]]] = []  # (layer, experts) in the order the engine used them, for the oracle

    def record(layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        routes.append((layer, sorted(set(index.flatten().tolist()))))

    if device_decode == "off":
        engine.experts.route_hooks.append(record)
    inputs = engine.encode(PROMPT, [image])
    pipeline.reset_stats()
    engine.experts.predict_seconds = 0.0
    times: list[float] = []
    sync()
    start = time.perf_counter()
    sampling = SamplingConfig(max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, temperature=1.0, seed=seed)
    before = {id(d): decoder_counts(d) for d in engine._decoders.values() if getattr(d, "on_device", False)}
    # no sync per token: a token reaches the host only once read back from the GPU anyway, and a sync here would
    # also wait for the token launched ahead of it (StaticDecoder.token_step), hiding what launching ahead saves
    allocator = allocator_counts()
    for _ in engine.stream(inputs, sampling):
        times.append(time.perf_counter())
        if len(times) == 1:  # what the prefill cost the caching allocator: cudaMalloc calls, frees and retries
            allocator = {k: v - allocator[k] for k, v in allocator_counts().items()}
            fetched_before_decode = pipeline.stats.bytes_read
    sync()
    if device_decode == "off":
        engine.experts.route_hooks.remove(record)
    decoders = [d for d in engine._decoders.values() if getattr(d, "on_device", False)]

    def this_trial(name: str) -> int:  # a device-decoder counter's growth in this trial (new decoders from 0)
        return sum(decoder_counts(d)[name] - before.get(id(d), {}).get(name, 0) for d in decoders)

    steps = [b - a for a, b in zip(times[1:], times[2:], strict=False)]  # the first decode step captures graphs
    s = pipeline.stats.as_dict()
    log = pipeline.layer_log
    n_layers = len(engine.catalogue.moe_layers)
    decode_bytes = sum(x.bytes_read for x in log[len(log) - (new_tokens - 1) * n_layers :])
    if decoders:  # device tokens log no layers: what the decode fetched (redone tokens' misses, promotions)
        decode_bytes = pipeline.stats.bytes_read - fetched_before_decode
    worker = engine.experts.predictor_worker
    fills = getattr(pipeline.tier, "fill_stats", None)  # unified-slots: bytes read straight in (O_DIRECT) or copied
    unified = pipeline.tier.name.startswith("unified")
    routed_k = engine.experts.replay.trace.top_k if engine.experts.replay is not None else engine.context.top_k
    return {
        "tier": pipeline.tier.name,
        # unified-slots: where a fill's time goes (the reads' rate per I/O thread; the wait for the GPU to release
        # the slot), over the whole trial
        "fill_gb": None if fills is None else {"direct": fills.direct_bytes / 1e9, "cpu": fills.buffered_bytes / 1e9,
                                               "read_s": fills.read_s, "wait_s": fills.wait_s},  # fmt: skip
        "routing": "trace-replay" if replay is not None else "sampled",
        "slots": pipeline.capacity,
        "prefill_s": times[0] - start,
        "first_decode_s": times[1] - times[0],  # a new decoder's capture (and compilation) lands here
        "decode_s_per_token": statistics.median(steps),
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "hit_rate": s["hit_rate"],
        "gb_read_per_decode_token": decode_bytes / (new_tokens - 1) / 1e9,  # what misses moved into the cache
        # the unified tiers on a discrete GPU: every expert a token computes is read from host memory (bus_gb_per_token)
        "experts_in_host_memory_per_token": n_layers * routed_k if unified and DEVICE == "cuda" else 0,
        # the GPU tier DMAs every byte it reads; the unified tiers' kernels read host memory in place instead
        "gb_copied_per_decode_token": 0.0 if unified else decode_bytes
        / (new_tokens - 1) / 1e9,
        "stall_s": s["stall_s"],
        "wasted_speculative_gb": s["wasted_speculative_bytes"] / 1e9,
        "predictor_critical_ms_per_token": engine.experts.predict_seconds * 1000 / (new_tokens + 1),
        "predictor_worker_ms_per_token": (worker.seconds * 1000 / (new_tokens + 1)) if worker else 0.0,
        "routes": routes,
        "expert_bytes": engine.catalogue.expert_bytes,
        "device_decode": bool(decoders),
        # this trial's device tokens that missed and ran again per layer
        "tokens_redone": this_trial("redone"),
        # this trial's tokens launched before the one before was read, and those thrown away
        "tokens_ran_ahead": this_trial("ran_ahead"),
        "tokens_discarded": this_trial("discarded"),
        # experts this trial's device tokens read in place from the host tier, per decode token
        "host_reads_per_token": this_trial("host_reads") / max(len(times) - 1, 1),
        "mapped_experts": max((d.mapped_experts for d in decoders), default=0),  # readable in place from the host
        "compiled": any(d.fused is not None and d.fused.compiled for d in decoders),
        "prefill_allocator": allocator,
    }


def bus_gb_per_token(row: dict) -> float:
    """GB a decode token moves over the host bus: what misses and promotions copied into the cache, plus the experts
    read in place from the host tier (which no copy counts). The unified tiers keep every slot in host memory, so
    on a discrete GPU each expert a token computes crosses the bus as the kernels read it (`experts_in_host_memory
    _per_token`), while their fills (a pread from the page cache into a slot, `gb_read_per_decode_token` in their
    rows) stay in host DRAM: those are not bus bytes here. Before run 12 the unified rows counted the fills
    instead, which made the bound ~3x too high (run 11: 91.6 tok/s printed for a row whose reads allow 30.6)."""
    if row.get("experts_in_host_memory_per_token"):
        return row["experts_in_host_memory_per_token"] * row["expert_bytes"] / 1e9
    in_place = row.get("host_reads_per_token", 0.0) * row.get("expert_bytes", 0) / 1e9
    return row.get("gb_read_per_decode_token", 0.0) + in_place


def decoder_counts(decoder) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """A device decoder's running counters, which the trial reports as growth."""
    return {name: getattr(decoder, name) for name in ("ran_ahead", "discarded", "redone", "host_reads")}


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's running counts that make a step slow when they move: a cudaMalloc, a cudaFree
    (it synchronises), a retry after freeing the cache to make room."""
    if DEVICE != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}


def profile_decode(engine, image: Path, replay: Path | None, tokens: int = 8) -> dict:
    """torch.profiler over `tokens` decode steps (after a warm-up that captured the graphs)."""
    from torch.profiler import ProfilerActivity, profile

    from vismmoe_edge.sampling import SamplingConfig

    if not engine.cuda_graphs:  # the trials may have left it off
        engine.cuda_graphs = True
        engine._decoders.clear()
    engine.experts.pipeline.clear()
    inputs = engine.encode(PROMPT, [image])
    sampling = SamplingConfig(max_new_tokens=tokens + 3, min_new_tokens=tokens + 3, temperature=1.0, seed=7)
    stream = engine.stream(inputs, sampling)
    next(stream)  # prefill
    next(stream)  # the first decode step (captures graphs on a new capacity)
    next(stream)
    sync()
    read_before = engine.experts.pipeline.stats.bytes_read
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(tokens):
            next(stream)
        sync()
        wall = time.perf_counter() - start
    expert_bytes = engine.experts.pipeline.stats.bytes_read - read_before
    for _ in stream:
        pass
    compute, copies, launches, graph_launches, syncs = [], [], 0, 0, 0
    kernels: dict[str, list[float]] = {}  # GPU time and count per kernel name, over the window
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0:
            span = (e.time_range.start, e.time_range.end)
            (copies if "Memcpy" in e.name or "memcpy" in e.name else compute).append(span)
            entry = kernels.setdefault(e.name[:90], [0.0, 0])
            entry[0] += e.time_range.elapsed_us()
            entry[1] += 1
        elif e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel"):
            launches += 1
        elif e.name in ("cudaGraphLaunch",):
            graph_launches += 1
        elif e.name in ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize"):
            syncs += 1
    htod_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA" and "HtoD" in e.name)
    return {
        "tokens": tokens,
        "wall_ms_per_token": wall * 1000 / tokens,
        "compute_busy": union_us(compute) / (wall * 1e6),
        "copy_busy": union_us(copies) / (wall * 1e6),
        "compute_or_copy_busy": union_us(compute + copies) / (wall * 1e6),
        "kernel_launches_per_token": launches / tokens,
        "graph_launches_per_token": graph_launches / tokens,
        "syncs_per_token": syncs / tokens,
        "expert_gb_per_token": expert_bytes / tokens / 1e9,
        "dma_gb_s": expert_bytes / (htod_us * 1e-6) / 1e9 if htod_us else None,  # while a host-to-device copy ran
        "routing": "trace-replay" if replay is not None else "sampled",
        "host_top": [
            (e.key, round(e.cpu_time_total / 1000 / tokens, 3))
            for e in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:12]
        ],
        "gpu_kernels_per_token": sum(n for _, n in kernels.values()) / tokens,
        # CUPTI records the kernels of the graphs launched inside the window: with tokens launched ahead that is one
        # fewer than `tokens` (the first token's graph ran before it), so per graph launch is the device token's
        # own count (run 11's "802 a token" was 917 a token graph)
        "gpu_kernels_per_graph_launch": (sum(n for _, n in kernels.values()) / graph_launches) if graph_launches
        else None,
        # where the GPU's time goes: (kernel, µs per token, launches per token), the 40 costliest
        "gpu_top": [(name, round(us / tokens, 1), n / tokens)
                    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:40]],  # fmt: skip
    }


def union_us(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def pinned_bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * (1 << 30) / (time.perf_counter() - start)


def oracle(
    routes: list[tuple[int, list[int]]],
    slots: int,
    expert_bytes: int,
    bandwidth: float,
    compute_s: float,
    tokens: int,
    num_layers: int,
) -> dict:
    """Belady's fewest decode misses for the recorded routing, with the cache warmed by the same prefill."""
    from vismmoe_edge.experts.oracle import belady_after_warmup

    prefill = [layer * 1000 + e for layer, ids in routes[:num_layers] for e in ids]
    decode = [layer * 1000 + e for layer, ids in routes[num_layers:] for e in ids]
    misses = belady_after_warmup(prefill, decode, slots)
    io_s = misses * expert_bytes / bandwidth / tokens
    return {
        "strategy": "oracle-bound",
        "slots": slots,
        "misses_per_token": misses / tokens,
        "gb_per_token": misses * expert_bytes / tokens / 1e9,
        "decode_s_per_token": max(compute_s, io_s),
        "decode_tokens_per_s": 1 / max(compute_s, io_s),
    }


def bytes_read_per_token(info: dict) -> float:
    """What a decode token reads of the weights (describe_checkpoint's `info`): the language model's non-expert
    weights but the token embedding (one row of it) and top_k / num_experts of the routed experts."""
    parts = info["parts"]
    dense = parts["language_bytes"] - parts["embedding_bytes"]
    return dense + info["total_expert_bytes"] * info["top_k"] / info["experts_per_layer"]


def hbm_bound(info: dict) -> dict:
    """The decode ceiling of memory bandwidth: the bytes a token reads (the language model's non-expert weights
    less the token embedding, of which it reads one row, and top_k/num_experts of the expert bytes), at the HBM
    bandwidth a 2 GiB device-to-device copy reaches here. Before run 21 the whole resident set counted, the
    embedding and the vision tower included: that bound was ~10% low (run 20's 630 tok/s)."""
    buf = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(buf)
    dst.copy_(buf)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(buf)
    torch.cuda.synchronize()
    hbm = 2 * 5 * buf.numel() / (time.perf_counter() - start)  # a copy reads and writes each byte
    del buf, dst
    per_token = bytes_read_per_token(info)
    return {"hbm_gb_s": hbm / 1e9, "bytes_per_token": per_token, "tokens_per_s": hbm / per_token}


def median_row(strategy: str, trials: list[dict]) -> dict:
    out = {k: v for k, v in trials[0].items() if k != "routes"}
    out["strategy"] = strategy
    for key in ("prefill_s", "decode_s_per_token", "hit_rate", "gb_read_per_decode_token", "gb_copied_per_decode_token",
                "host_reads_per_token", "stall_s",
                "wasted_speculative_gb", "predictor_critical_ms_per_token", "predictor_worker_ms_per_token"):
        out[key] = statistics.median(t[key] for t in trials)  # fmt: skip
    out["decode_tokens_per_s"] = 1 / out["decode_s_per_token"]
    out["decode_tokens_per_s_all"] = [round(t["decode_tokens_per_s"], 3) for t in trials]
    out["prefill_s_all"] = [round(t["prefill_s"], 4) for t in trials]  # the spread between rows is not understood
    out["prefill_allocator_all"] = [t["prefill_allocator"] for t in trials if "prefill_allocator" in t]
    return out


def subprocess_worker(args: argparse.Namespace, worker: str) -> dict:
    """Baselines run in their own process, so that their copy of the model leaves with them."""
    cmd = [sys.executable, __file__, "--worker", worker, "--out-dir", str(args.out_dir), "--layers", str(args.layers),
           "--gpu-gib", str(args.gpu_gib), "--accelerate-tokens", str(args.accelerate_tokens),
           "--new-tokens", str(args.new_tokens)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        return {"strategy": worker, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/vismmoe-bench"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--gpu-gib", type=float, default=20.0)
    ap.add_argument("--embedding", choices=("host", "device"), default="host",
                    help="the GPU-slot budget engine's token embedding: in pinned host memory, its GPU memory given "
                    "to expert slots (what the engine and the planner do where slots cannot hold every expert), or "
                    "in GPU memory (before run 21)")  # fmt: skip
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--accelerate-tokens", type=int, default=3)
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--skip-baselines", action="store_true", help="no transformers / Accelerate runs")
    ap.add_argument("--baselines-only", action="store_true")
    ap.add_argument("--build-only", action="store_true", help="build the checkpoint and the image, then stop")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--replay-trace", type=Path, help="also measure with routing replayed from this trace")
    ap.add_argument("--predictor-file", type=Path, help="a learned predictor (.onnx) for the replayed trace")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", help="comma-separated: all-resident, popularity, lru, graphs-off, learned, "
                    "device-resident, device-resident-compiled, "
                    "device-resident-compiled-serial (no token launched ahead), device-resident-compiled-cublas "
                    "(no Triton GEMV), device-resident-compiled-o-cublas (o_proj on cuBLAS: the default before run "
                    "15), device-resident-compiled-qkv-cublas (qkv on cuBLAS: the default before run 16), "
                    "device-popularity, device-mapped, "
                    "device-mapped-promotion-8, device-mapped-lookahead-2 (the next layer's likely experts "
                    "staged in HBM a layer ahead), device-mapped-flat-prompt (the slots' first experts by the "
                    "prompt's plain counts, as before run 20), "
                    "budget-default (the engine's own choices at the budget), "
                    "unified-slots, unified-slots-next-layer-gate (prefetching by the next layer's router), "
                    "unified-slots-wait-all (each layer waits for its last read before computing), "
                    "unified-registered, "
                    "device-unified-slots, hf-static, hf-static-no-cudnn, "
                    "hf-resident, accelerate (default: all but the unified tiers)")
    ap.add_argument("--routings", default="sampled,trace-replay")
    ap.add_argument("--compile-device-rows", action="store_true",
                    help="every device-* row with its layers compiled (engine.compile_decode)")
    ap.add_argument("--worker", choices=list(BASELINES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = set(args.routings.split(",")) - {"sampled", "trace-replay"}
    if unknown:  # run 20 lost a GPU call's rows to "replay": no row matched, and nothing said so
        ap.error(f"--routings {args.routings!r}: unknown {sorted(unknown)}; use sampled and/or trace-replay")
    args.strategies_given = args.strategies is not None
    if args.strategies is None:
        args.strategies = ("all-resident,popularity,lru,graphs-off,learned,device-resident,device-popularity,"
                           "device-mapped")
    model_dir = args.out_dir / f"qwen3vl-30b-a3b-{args.layers}layer"
    image = args.out_dir / "image-1056.png"

    if args.worker == "accelerate":  # runs in its own process so that its host copy of the model goes away
        print(json.dumps(run_accelerate(model_dir, image, args.gpu_gib, args.accelerate_tokens)))
        return
    if args.worker in ("hf-resident", "hf-static", "hf-static-no-cudnn"):
        static, cudnn = args.worker != "hf-resident", False if args.worker == "hf-static-no-cudnn" else None
        print(json.dumps(run_hf_resident(model_dir, image, args.new_tokens, static=static, cudnn=cudnn)))
        return

    args.out_dir.mkdir(parents=True, exist_ok=True)
    build_checkpoint(model_dir, args.layers)
    make_image(image)
    if args.build_only:
        return
    from vismmoe_edge.planning.describe import describe_checkpoint

    info = describe_checkpoint(model_dir)
    resident = info["resident_bytes"]
    expert_budget = int(args.gpu_gib * 2**30 - resident - 2**30)  # 1 GiB for activations and the KV cache
    # the GPU-slot engine at the budget: with its embedding in host memory, those bytes of GPU memory are slots
    slot_budget = expert_budget + (info["parts"]["embedding_bytes"] if args.embedding == "host" else 0)
    machine = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu (harness smoke run)"
    bandwidth = pinned_bandwidth() if DEVICE == "cuda" else 1e9
    print(f"{machine}: pinned host->device {bandwidth / 1e9:.1f} GB/s; resident {resident / 1e9:.2f} GB; "
          f"expert budget {expert_budget / 2**30:.2f} GiB ({slot_budget / 2**30:.2f} GiB for GPU slots, embedding in "
          f"{args.embedding} memory)", flush=True)  # fmt: skip
    wanted = set(args.strategies.split(","))
    results: list[dict] = []
    profiles: list[dict] = []
    engines: dict[str, object] = {}

    def summary(complete: bool) -> dict:
        """The call's JSON; written after each routing's rows too, so that a call cut off by its time limit
        (run 18's int4 rows) still leaves the trials it finished. The HBM bound is measured at the end only: its
        4 GiB of copies may not fit beside the engines."""
        out = {
            "machine": machine,
            "hbm_bound": hbm_bound(info) if DEVICE == "cuda" and complete else None,
            "date": time.strftime("%Y-%m-%d"),
            "pinned_gb_s": bandwidth / 1e9,
            "gpu_gib": args.gpu_gib,
            "expert_budget_bytes": expert_budget,
            "gpu_slot_budget_bytes": slot_budget,  # the budget engine's (the unified tiers take expert_budget)
            "embedding": args.embedding,
            "layers": args.layers,
            "torch": torch.__version__,
            "results": results,
            "profiles": profiles,
            "complete": complete,
        }
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
        return out

    if not args.baselines_only:
        if wanted & {"all-resident", "device-resident", "device-resident-compiled", "device-resident-compiled-serial",
                     "device-resident-compiled-cublas", "device-resident-compiled-o-cublas",
                     "device-resident-compiled-qkv-cublas"}:  # fmt: skip
            engines["all-resident"] = load_engine(model_dir, "100%", pinned_layers=args.layers, host_tier=False)
        budget_rows = {"popularity", "lru", "graphs-off", "learned", "device-popularity", "device-mapped",
                       "device-mapped-promotion-8", "device-mapped-lookahead-2", "device-mapped-flat-prompt",
                       "budget-default"}  # fmt: skip
        if wanted & budget_rows:
            engines["budget"] = load_engine(model_dir, str(slot_budget), host_tier=True, embedding=args.embedding)
        for name in UNIFIED:
            if name in wanted or f"device-{name}" in wanted or f"{name}-next-layer-gate" in wanted:
                engines[name] = load_engine(model_dir, str(expert_budget), host_tier=False, tier=name)
        for name, e in engines.items():
            print(f"{name}: loaded in {e.load_s:.1f} s, peak GPU {e.peak_gpu_bytes / 2**30:.2f} GiB, "
                  f"host tier {getattr(e.experts.pipeline.tier, 'mirror', None) is not None}", flush=True)  # fmt: skip
        routings = ([None] if "sampled" in args.routings else []) + (
            [args.replay_trace] if args.replay_trace and "trace-replay" in args.routings else []
        )
        failed: dict[str, str] = {}  # a row whose trial raised: the rest of the call still runs (GPU calls are few)
        for replay in routings:
            mode = "trace-replay" if replay is not None else "sampled"
            configs: list[tuple[str, str, dict]] = [
                ("all-resident", "all-resident", {}),
                ("budget", "popularity", {}),
                ("budget", "lru", {"policy": "lru"}),
                ("budget", "graphs-off", {"graphs": False}),
                ("all-resident", "device-resident", {"device_decode": "auto"}),
                ("all-resident", "device-resident-compiled", {"device_decode": "auto", "compiled": True}),
                ("all-resident", "device-resident-compiled-serial",
                 {"device_decode": "auto", "compiled": True, "ahead": "off"}),
                # compiled, every projection on cuBLAS (before dense_gemv.py): what the Triton GEMV gives
                ("all-resident", "device-resident-compiled-cublas", {"device_decode": "auto", "compiled": True,
                                                                     "gemv": ""}),  # fmt: skip
                # o_proj on cuBLAS, the router alone on our kernel: the default before run 15 (against which
                # o_proj's GEMV gave 4.4%; the row called device-resident-compiled-o-gemv then was today's default)
                ("all-resident", "device-resident-compiled-o-cublas", {"device_decode": "auto", "compiled": True,
                                                                       "gemv": "router"}),  # fmt: skip
                # qkv on cuBLAS: the default of runs 15-16, before qkv's GEMV joined it (0.5% in run 16)
                ("all-resident", "device-resident-compiled-qkv-cublas", {"device_decode": "auto", "compiled": True,
                                                                         "gemv": "router,o"}),  # fmt: skip
                ("budget", "device-popularity", {"device_decode": "on"}),
                ("budget", "device-mapped", {"device_decode": "on", "mapped": True}),
                # the same with up to 8 experts read in place promoted into slots a token (off by default since
                # run 8): do promotions pay for their bus bytes?
                ("budget", "device-mapped-promotion-8", {"device_decode": "on", "mapped": True, "promotions": 8}),
                # the same with up to 2 of the next layer's predicted experts a layer copied into HBM while this
                # layer computes (kernels/mapped_prefetch.py): does the lookahead hide bus reads behind compute?
                ("budget", "device-mapped-lookahead-2", {"device_decode": "on", "mapped": True, "lookahead": 2}),
                # the same with the prefill's experts ranked by plain counts (before run 20): what ranking the
                # prompt's last tokens first (experts/recency.py) saves in bus reads
                ("budget", "device-mapped-flat-prompt", {"device_decode": "on", "mapped": True,
                                                         "prompt_half_life": 0.0}),  # fmt: skip
                # the engine's own choices at this budget (device path, in-place reads, compiled layers: "auto")
                ("budget", "budget-default", {"device_decode": "auto", "mapped": "auto", "compiled": "auto"}),
            ]
            if replay is not None and args.predictor_file is not None:
                configs.append(("budget", "learned", {}))
            configs += [(name, name, {}) for name in UNIFIED]
            # the engine's unified-slots row with the next layer's router prefetching that layer's likely experts
            # into free slots while this layer computes (a fill then overlaps the kernels' reads)
            configs.append(("unified-slots", "unified-slots-next-layer-gate", {}))
            # the same tier with every layer waiting for its last read before computing (before experts/arrival.py)
            configs.append(("unified-slots", "unified-slots-wait-all", {"arrival_min_bytes": math.inf}))
            configs += [(name, f"device-{name}", {"device_decode": "on"}) for name in UNIFIED]
            # in the order --strategies names them: a row's place in each round is the caller's to choose (run
            # 20's qkv-cublas row ran last in every round and came out 2.9% faster)
            named = args.strategies.split(",")
            configs = sorted((c for c in configs if c[1] in wanted), key=lambda c: named.index(c[1]))
            trials: dict[str, list[dict]] = {name: [] for _, name, _ in configs}
            for seed in range(args.repeats):  # interleaved, so that drifts hit every strategy alike
                for engine_name, name, kw in configs:
                    if name in failed:
                        continue
                    engine = engines[engine_name]
                    set_predictor(engine, ROW_PREDICTORS.get(name, "none"), args.predictor_file)
                    if args.compile_device_rows and kw.get("device_decode", "off") != "off":
                        kw = {**kw, "compiled": True}
                    if DEVICE == "cuda":
                        torch.cuda.reset_peak_memory_stats()
                    try:
                        r = run_trial(engine, image, args.new_tokens, replay, seed, **kw)
                    except Exception as exc:  # noqa: BLE001 (recorded in the row and printed)
                        failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                        print(f"{name} {mode} FAILED: {failed[name]}", flush=True)
                        continue
                    # the budget held through a prefill and its decode (KV cache, activations), not only at load:
                    # the allocator's peak less what engines loaded before this one hold (one loaded after it counts)
                    peak = torch.cuda.max_memory_allocated() - engine.gpu_bytes_before if DEVICE == "cuda" else 0
                    r["peak_gpu_gib_trial"] = peak / 2**30
                    trials[name].append(r)
                    print(name, mode, {k: v for k, v in r.items() if k != "routes"}, flush=True)
            results += [{"strategy": n, "routing": mode, "error": failed[n]} for _, n, _ in configs if n in failed]
            configs = [c for c in configs if c[1] not in failed]
            rows = [median_row(name, trials[name]) for _, name, _ in configs]
            for (engine_name, _, _), row in zip(configs, rows, strict=True):
                row["peak_gpu_gib"] = engines[engine_name].peak_gpu_bytes / 2**30  # at load
                row["peak_gpu_gib_trials"] = max(t["peak_gpu_gib_trial"] for t in trials[row["strategy"]])
                bus_gb = bus_gb_per_token(row)
                if bus_gb:  # the bus alone: the bytes a token moves over it at the pinned rate
                    row["bus_gb_per_token"] = bus_gb
                    row["bus_bound_tokens_per_s"] = bandwidth / (bus_gb * 1e9)
            results += rows
            summary(complete=False)
            ceiling = next((r for r in rows if r["strategy"] == "all-resident"), None)
            if ceiling is not None and trials.get("popularity"):
                ours = trials["popularity"][0]
                bound = oracle(ours["routes"], ours["slots"], ours["expert_bytes"], bandwidth,
                               ceiling["decode_s_per_token"], args.new_tokens, args.layers)  # fmt: skip
                results.append({**bound, "routing": mode})
            if "budget" in engines:
                set_predictor(engines["budget"], "none", None)
                engines["budget"].device_decode = "off"
                profiles.append({"engine": "20 GiB, host path", **profile_decode(engines["budget"], image, replay)})
                print("profile", profiles[-1], flush=True)
                # where a 20 GiB device token's time goes, reading in place without and with the lookahead
                for row, per_layer in (("device-mapped", 0), ("device-mapped-lookahead-2", 2)):
                    if row not in wanted:
                        continue
                    engines["budget"].device_decode, engines["budget"].device_decode_mapped = "on", True
                    engines["budget"].mapped_lookahead = per_layer
                    engines["budget"].experts.prompt_half_life = PROMPT_HALF_LIFE_TOKENS  # a trial may have set 0
                    mapped = profile_decode(engines["budget"], image, replay)
                    staged = f", {per_layer} a layer staged ahead" if per_layer else ""
                    profiles.append({"engine": f"20 GiB, device path, misses read in place{staged}", **mapped})
                    print("profile", profiles[-1], flush=True)
            if "unified-slots" in wanted and "unified-slots" in engines and "unified-slots" not in failed:
                # where its token's time goes (run 20: 89.6 ms against a 34 ms bus bound): the engine's own path
                set_predictor(engines["unified-slots"], "none", None)
                expert_compute.ARRIVAL_MIN_BYTES = ARRIVAL_MIN_BYTES  # the wait-all row's trials set it to inf
                profiles.append({"engine": "unified-slots", **profile_decode(engines["unified-slots"], image, replay)})
                print("profile", profiles[-1], flush=True)
            if "all-resident" in engines:  # the device path where it runs by default: every expert resident
                engines["all-resident"].device_decode = "auto"
                engines["all-resident"].compile_decode = False
                engines["all-resident"].decode_ahead = "auto"
                engines["all-resident"].decode_gemv = gemv_projections(DEFAULT_PROJECTIONS)  # (a trial may have set "")
                resident = profile_decode(engines["all-resident"], image, replay)
                profiles.append({"engine": "every expert resident, device path", **resident})
                print("profile", profiles[-1], flush=True)
                # compiled layers: the row that asks for them, or every device row (the int4 call's): where the
                # token's time goes with the kernels a user gets
                compiled = "device-resident-compiled" in wanted or args.compile_device_rows
                if compiled and "device-resident-compiled" not in failed:
                    engines["all-resident"].compile_decode = True
                    resident = profile_decode(engines["all-resident"], image, replay)
                    profiles.append({"engine": "every expert resident, device path, compiled layers", **resident})
                    print("profile", profiles[-1], flush=True)
        for e in engines.values():
            e.experts.pipeline.close()
        engines.clear()
        gc.collect()
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
            torch._C._host_emptyCache()  # the pinned host tier's memory, which torch's host allocator keeps cached
    baselines = [b for b in BASELINES if b in wanted] if args.strategies_given else list(BASELINES)
    if args.skip_accelerate and "accelerate" in baselines:
        baselines.remove("accelerate")
    if DEVICE == "cuda" and baselines and not args.skip_baselines and torch.cuda.memory_reserved() > 1 << 30:
        # (runs 13 and 16 on an 80 GB H100: the baseline's 57 GB did not fit beside what this process kept)
        held = torch.cuda.memory_reserved() / 2**30
        print(f"note: this process still holds {held:.1f} GiB of GPU memory after its rows; where a baseline "
              "runs out of memory, run it alone with --baselines-only", flush=True)  # fmt: skip
    for name in [] if args.skip_baselines else baselines:
        results.append(subprocess_worker(args, name))
        print(results[-1], flush=True)
    print(json.dumps(summary(complete=True), indent=1))


if __name__ == "__main__":
    main()
