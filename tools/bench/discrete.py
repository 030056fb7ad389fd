#!/usr/bin/env python3
"""Discrete-GPU benchmark: Qwen3-VL-30B-A3B-sized synthetic checkpoint (all 48 layers) on one CUDA GPU.

Compares, in one run, decode tokens/s and prefill latency (a prompt with ~1,100 image tokens) of:
- Hugging Face Accelerate offload at the same GPU budget (the seed paper's baseline),
- vismmoe-edge with every expert resident (the ceiling),
- vismmoe-edge at the budget: LRU on demand, + previous-token prefetch, + next-layer-gate prefetch,
- the integrated-GPU tiers at the same budget, held in pinned host memory instead of GPU memory (`unified-slots`:
  slots the GPU reads in place over the bus; `unified-registered`: the shards' own pages registered read-only).
  On a discrete GPU every expert byte a kernel reads crosses PCIe, so these are slow here by construction; the
  rows exist to measure the Jetson path's bytes and overheads on the GPU we have,
- the oracle bound: Belady's fewest bytes for the recorded routing at the same slot count, moved at the
  measured pinned bandwidth, overlapped perfectly with the all-resident compute time.

Decode is sampled (temperature 1): random weights under greedy decoding repeat one token and flatter caches.
Run on the GPU server:  python3 tools/bench/discrete.py --out-dir /tmp/bench --json $OUT/discrete.json
A subset:               ... --strategies lru,unified-slots,unified-registered,accelerate --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

IMAGE_SIDE = 1056  # 66 x 66 patches of 16 px -> 33 x 33 = 1,089 visual tokens
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


def run_hf_resident(model_dir: Path, image: Path, new_tokens: int) -> dict:
    """transformers' own model with every weight on the GPU: the ceiling any offloading runtime aims at."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    torch.backends.cuda.enable_cudnn_sdp(False)
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    kwargs = hf_inputs(model_dir, image)
    prefills, rates = [], []
    for seed in range(3):
        prefill_s, steps = hf_sampled_run(model, kwargs, new_tokens, seed)
        prefills.append(prefill_s)
        rates.append(1 / statistics.median(steps))
    return {
        "strategy": "hf-all-resident",
        "routing": "sampled",
        "prefill_s": statistics.median(prefills),
        "decode_tokens_per_s": statistics.median(rates),
        "decode_s_per_token": 1 / statistics.median(rates),
        "decode_tokens_per_s_all": rates,
    }


STRATEGIES = ("all-resident", "lru", "previous-token", "next-layer-gate", "unified-slots", "unified-registered",
              "hf-resident", "accelerate")  # fmt: skip
DEFAULT_STRATEGIES = "all-resident,lru,previous-token,next-layer-gate,hf-resident,accelerate"


def run_ours(
    model_dir: Path,
    image: Path,
    budget: str,
    predictor: str,
    new_tokens: int,
    replay: Path | None,
    seed: int,
    tier: str = "gpu",
) -> dict:
    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    start = time.perf_counter()
    engine = vismmoe_edge.load(model_dir, memory_budget=budget, device="cuda", tier=tier, predictor=predictor)
    load_s = time.perf_counter() - start
    if replay is not None:
        engine.replay_routing(replay, start_token=2000 * seed)  # each repeat replays another stretch
    routes: list[tuple[int, list[int]]] = []  # (layer, experts) in the order the engine used them, for the oracle

    def record(layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        routes.append((layer, sorted(set(index.flatten().tolist()))))

    engine.experts.route_hooks.append(record)
    inputs = engine.encode(PROMPT, [image])
    pipeline = engine.experts.pipeline
    pipeline.reset_stats()
    times: list[float] = []
    start = time.perf_counter()
    sampling = SamplingConfig(max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, temperature=1.0, seed=seed)
    for _ in engine.stream(inputs, sampling):
        torch.cuda.synchronize()
        times.append(time.perf_counter())
    prefill_s = times[0] - start
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    s = pipeline.stats.as_dict()
    tier_impl = pipeline.tier
    fills = getattr(tier_impl, "fill_stats", None)
    result = {
        "strategy": tier if tier.startswith("unified") else (
            "all-resident" if budget == "100%" else ("lru" if predictor == "none" else predictor)),
        "tier": tier_impl.name,
        "routing": "trace-replay" if replay is not None else "sampled",
        "budget": budget,
        "slots": pipeline.capacity,
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_s_per_token": statistics.median(steps),
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "hit_rate": s["hit_rate"],
        "gb_copied_per_decode_token": None,
        "stall_s": s["stall_s"],
        "wasted_speculative_gb": s["wasted_speculative_bytes"] / 1e9,
        "routes": routes,
        "expert_bytes": engine.catalogue.expert_bytes,
        "resident_bytes": torch.cuda.max_memory_allocated(),
    }
    log = pipeline.layer_log
    moe_layers = len(engine.catalogue.moe_layers)
    decode_bytes = sum(x.bytes_read for x in log[len(log) - new_tokens * moe_layers :])
    result["gb_read_per_decode_token"] = decode_bytes / new_tokens / 1e9  # what misses moved from disk/page cache
    # the discrete tier DMAs every byte it reads to the GPU; the unified tiers never copy to the GPU
    result["gb_copied_per_decode_token"] = 0.0 if tier.startswith("unified") else decode_bytes / new_tokens / 1e9
    if fills is not None:  # unified-slots: page cache -> slot copies by the CPU (0 for O_DIRECT reads), whole run
        result["fill_gb"] = {"direct": fills.direct_bytes / 1e9, "buffered_cpu_copy": fills.buffered_bytes / 1e9}
    if getattr(tier_impl, "pool", None) is not None:  # decode gathers each token's k experts per layer (a copy)
        k = engine.context.top_k
        result["gb_gathered_per_decode_token"] = k * moe_layers * tier_impl.slot_bytes / 1e9
    pipeline.close()
    del engine
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return result


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


def median_row(trials: list[dict]) -> dict:
    trials = [t for t in trials if "error" not in t] or trials[:1]
    out = dict(trials[0])
    if "error" in out:
        return out
    for key in (
        "prefill_s",
        "decode_s_per_token",
        "hit_rate",
        "gb_copied_per_decode_token",
        "gb_read_per_decode_token",
        "stall_s",
        "wasted_speculative_gb",
    ):
        out[key] = statistics.median(t[key] for t in trials)
    out["decode_tokens_per_s"] = 1 / out["decode_s_per_token"]
    out["decode_tokens_per_s_all"] = [round(t["decode_tokens_per_s"], 3) for t in trials]
    return out


def subprocess_worker(args: argparse.Namespace, worker: str) -> dict:
    """Baselines run in their own process, so that their copy of the model leaves with them."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        worker,
        "--out-dir",
        str(args.out_dir),
        "--layers",
        str(args.layers),
        "--gpu-gib",
        str(args.gpu_gib),
        "--accelerate-tokens",
        str(args.accelerate_tokens),
        "--new-tokens",
        str(args.new_tokens),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        return {"strategy": worker, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/vismmoe-bench"))
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--gpu-gib", type=float, default=20.0)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--accelerate-tokens", type=int, default=3)
    ap.add_argument("--skip-accelerate", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--replay-trace", type=Path, help="also measure with routing replayed from this trace")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                    help=f"comma-separated, from {','.join(STRATEGIES)}")  # fmt: skip
    ap.add_argument("--worker", choices=["accelerate", "hf-resident"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    wanted = [w.strip() for w in args.strategies.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(STRATEGIES))
    if unknown:
        ap.error(f"--strategies: unknown {', '.join(unknown)}; use {', '.join(STRATEGIES)}")
    model_dir = args.out_dir / f"qwen3vl-30b-a3b-{args.layers}layer"
    image = args.out_dir / "image-1056.png"

    if args.worker == "accelerate":  # runs in its own process so that its host copy of the model goes away
        print(json.dumps(run_accelerate(model_dir, image, args.gpu_gib, args.accelerate_tokens)))
        return
    if args.worker == "hf-resident":
        print(json.dumps(run_hf_resident(model_dir, image, args.new_tokens)))
        return

    args.out_dir.mkdir(parents=True, exist_ok=True)
    build_checkpoint(model_dir, args.layers)
    make_image(image)
    from vismmoe_edge.describe import describe_checkpoint

    info = describe_checkpoint(model_dir)
    resident = info["resident_bytes"]
    expert_budget = int(args.gpu_gib * 2**30 - resident - 2**30)  # 1 GiB for activations and the KV cache
    results = []
    machine = torch.cuda.get_device_name(0)
    bandwidth = pinned_bandwidth()
    print(
        f"{machine}: pinned host->device {bandwidth / 1e9:.1f} GB/s; resident {resident / 1e9:.2f} GB; "
        f"expert budget {expert_budget / 2**30:.2f} GiB",
        flush=True,
    )
    routings = [None] + ([args.replay_trace] if args.replay_trace else [])
    configs = {  # strategy: (budget, predictor, tier)
        "all-resident": ("100%", "none", "gpu"),
        "lru": (str(expert_budget), "none", "gpu"),
        "previous-token": (str(expert_budget), "previous-token", "gpu"),
        "next-layer-gate": (str(expert_budget), "next-layer-gate", "gpu"),
        "unified-slots": (str(expert_budget), "none", "unified-slots"),
        "unified-registered": (str(expert_budget), "none", "unified-registered"),
    }
    for replay in routings:
        mode = "trace-replay" if replay is not None else "sampled"
        # next-layer-gate guesses from the model's own router, which replayed routing ignores: skip it there
        cfgs = [c for c in wanted if c in configs and not (replay is not None and c == "next-layer-gate")]
        trials: dict[str, list[dict]] = {c: [] for c in cfgs}
        for seed in range(args.repeats):  # interleaved, so that drifts hit every strategy alike
            for name in cfgs:
                budget, predictor, tier = configs[name]
                try:
                    r = run_ours(model_dir, image, budget, predictor, args.new_tokens, replay, seed, tier)
                except Exception as e:  # noqa: BLE001 - one failing strategy must not lose the others' rows
                    r = {"strategy": name, "error": f"{type(e).__name__}: {e}"}
                    torch.cuda.empty_cache()
                trials[name].append(r)
                print({k: v for k, v in r.items() if k != "routes"}, flush=True)
        rows = [median_row(trials[c]) for c in cfgs]
        results += rows
        ceiling = next((r for r in rows if r["strategy"] == "all-resident" and "error" not in r), None)
        lru = next((r for r in rows if r["strategy"] == "lru" and "error" not in r), None)
        if ceiling is not None and lru is not None:
            bound = oracle(lru["routes"], lru["slots"], lru["expert_bytes"], bandwidth,
                           ceiling["decode_s_per_token"], args.new_tokens, args.layers)  # fmt: skip
            results.append({**bound, "routing": mode})
    if "hf-resident" in wanted:
        results.append(subprocess_worker(args, "hf-resident"))
        print(results[-1], flush=True)
    if "accelerate" in wanted and not args.skip_accelerate:
        results.append(subprocess_worker(args, "accelerate"))
        print(results[-1], flush=True)
    for r in results:
        r.pop("routes", None)
    summary = {
        "machine": machine,
        "date": time.strftime("%Y-%m-%d"),
        "pinned_gb_s": bandwidth / 1e9,
        "gpu_gib": args.gpu_gib,
        "expert_budget_bytes": expert_budget,
        "layers": args.layers,
        "torch": torch.__version__,
        "results": results,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
