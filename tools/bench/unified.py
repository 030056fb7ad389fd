#!/usr/bin/env python3
"""Unified-memory (Jetson proxy) benchmark: decode under a memory cgroup that caps the process, page cache included.

One run compares, at each cap (a share of the checkpoint's size), with the page cache evicted before each trial:
- plain mmap: experts are views of the mapping, the kernel pages them in on faults (what llama.cpp does),
- our LRU on demand (unified tier: exact-range preads into the page cache, exact-range drops out),
- our pipeline with each simple predictor (previous-token, next-layer-gate),
- the oracle bound: Belady's fewest bytes for the LRU trials' own routing at the same slot count, read at the
  best disk bandwidth seen in this run, overlapped perfectly with the all-resident compute time of this run.

Quantized experts (issue 16): `--quant-model DIR` (the same weights through `vismmoe-edge quantize`) adds each
strategy named `q:<strategy>` (e.g. `q:popularity`) on that directory, at the same caps (shares of the bf16
file), and `--llama-gguf NAME=PATH` (repeatable: Q4_K_M, Q8_0, ...) adds llama.cpp's llama-bench on that GGUF;
with `--interleave` each repeat runs every strategy of ours and then one llama-bench process per GGUF, so a noisy
neighbour slows all of them alike. Each row reports its bytes read per token and Belady's fewest for its own
routing at its own slot count (`belady_read_bytes_per_token`).

Steady state (issue 25): every measured trial, ours and llama-bench's alike, runs straight after
`--warmup-trials` (default 1) discarded trials of the same strategy, cap and start; a row is the median of the
measured trials only (the discarded ones are kept as `warmup_tokens_per_s`). Without it, a llama-bench process
that ran straight after one of our trials was measured in the state our process left the host (see
docs/benchmarks.md, "The CPU proxy's baseline at its steady state"). `--llama-resident` adds, beside the
`--resident` rows, each GGUF uncapped with its file already in the page cache (llama.cpp warm).

Routing: `--routing replay` takes routed experts from a real trace (`--trace PATH`, e.g. the DeepSeek-V2-Lite
prefill trace: a text model's real token-to-token locality, 64 experts top-6 per layer, replayed on our layers);
`--routing sampled` decodes with temperature 1 through the synthetic model's own routers.

    python tools/bench/unified.py --model $BENCH_DATA/qwen3vl-30b-a3b-8layer \
        --trace $TRACES/deepseek_v2_lite_chat_puffin_prefill_top6.npz --caps 0.4,0.6 --repeats 3

($BENCH_DATA, $TRACES and the llama.cpp variables are defined in docs/benchmark-setup.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TOOLS))
sys.path.insert(0, str(TOOLS.parent))

PROMPT_TOKENS = 64
STRATEGIES = {  # name -> (tier, predictor, eviction policy)
    "plain-mmap": ("mmap", "none", "lru"),
    "lru": ("unified", "none", "lru"),
    "popularity": ("unified", "none", "popularity"),
    "popularity+previous-token": ("unified", "previous-token", "popularity"),
    "popularity+next-layer-gate": ("unified", "next-layer-gate", "popularity"),
    "popularity+learned": ("unified", "learned-file", "popularity"),  # --predictor-file, an exported ONNX
    "popularity+learned-unfiltered": ("unified", "learned-file", "popularity"),  # no score threshold
}


def proc_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def prompt_ids(processor, n: int) -> list[int]:
    text = " ".join(f"word{i} is here" for i in range(n))
    ids = processor.tokenizer(text)["input_ids"]
    return ids[:n]


def worker(args: argparse.Namespace) -> dict:
    """One trial inside the cgroup: load, prefill PROMPT_TOKENS, decode --tokens; report as JSON."""
    import torch

    import vismmoe_edge
    from vismmoe_edge.planning.describe import describe_checkpoint
    from vismmoe_edge.prompt import PromptInputs
    from vismmoe_edge.sampling import SamplingConfig

    torch.set_num_threads(2)
    tier, predictor, policy = STRATEGIES.get(args.strategy.removeprefix("q:"), ("host", "none", "lru"))
    if predictor == "learned-file":
        predictor = str(args.predictor_file)
    info = describe_checkpoint(args.model)
    baseline_rss = rss_bytes()  # python + torch + transformers, before any weight
    if args.strategy.removeprefix("q:") == "resident":
        budget = "100%"
    else:
        # what the cap leaves for expert pages: minus the process itself, the resident weights and a margin
        # for activations, the KV cache and allocator slack
        budget = str(int(args.cap_bytes - baseline_rss - info["resident_bytes"] - args.margin_mib * 2**20))
    engine = vismmoe_edge.load(
        args.model, memory_budget=budget, tier=tier, predictor=predictor, policy=policy, device="cpu"
    )
    if args.routing == "replay":
        engine.replay_routing(args.trace, start_token=args.start_token)
    if args.strategy.endswith("learned-unfiltered"):
        engine.experts.predictor.min_score = 0.0
    pipeline = engine.experts.pipeline
    routes: list[list[int]] = []  # the keys each MoE layer call used, for Belady on this trial's own routing
    engine.experts.route_hooks.append(
        lambda layer, hidden, index, weights: routes.append([layer * 1000 + int(e) for e in index.unique()])
    )
    inputs = PromptInputs(input_ids=torch.tensor([prompt_ids(engine.processor, PROMPT_TOKENS)]))
    sampling = SamplingConfig(
        max_new_tokens=args.tokens + 1, min_new_tokens=args.tokens + 1, temperature=1.0, seed=args.start_token
    )
    if args.strategy.removeprefix("q:") == "resident":  # warm every expert once, then time compute alone
        for layer in engine.catalogue.moe_layers:
            for e in range(engine.catalogue.num_experts):
                pipeline.begin_layer(layer, [e])
                pipeline.acquire(layer, e)
                pipeline.finish(layer, e)
    pipeline.reset_stats()
    routes.clear()
    read_before = proc_read_bytes()
    times: list[float] = []
    start = time.perf_counter()
    read_after_prefill = 0
    for _ in engine.stream(inputs, sampling):
        times.append(time.perf_counter())
        if len(times) == 1:
            read_after_prefill = proc_read_bytes()
    steps = [b - a for a, b in zip(times, times[1:], strict=False)]
    stats = pipeline.stats.as_dict()
    from vismmoe_edge.experts.oracle import belady_after_warmup

    layers = len(engine.catalogue.moe_layers)
    prefill = [k for step in routes[:layers] for k in step]
    decode = [k for step in routes[layers:] for k in step]
    oracle_misses = belady_after_warmup(prefill, decode, pipeline.capacity)
    decode_read = proc_read_bytes() - read_after_prefill
    return {
        "strategy": args.strategy,
        "cap_bytes": args.cap_bytes,
        "budget_bytes": int(budget) if budget.isdigit() else None,
        "slots": pipeline.capacity,
        "prefill_s": times[0] - start,
        "decode_s_per_token": statistics.median(steps),
        "decode_tokens_per_s": 1 / statistics.median(steps),
        "decode_read_bytes_per_token": decode_read / len(steps),
        "prefill_read_bytes": read_after_prefill - read_before,
        "hit_rate": stats["hit_rate"],
        "stall_s": stats["stall_s"],
        "speculative_bytes": stats["speculative_bytes"],
        "wasted_speculative_bytes": stats["wasted_speculative_bytes"],
        "refault_bytes": getattr(pipeline.tier, "refault_bytes", 0),
        "fetch_gb_s": stats["bytes_read"] / stats["fetch_seconds"] / 1e9 if stats["fetch_seconds"] else None,
        "oracle_read_bytes_per_token": oracle_misses * engine.catalogue.expert_bytes / len(steps),
        "expert_bytes": engine.catalogue.expert_bytes,
        "model": str(args.model),
    }


def disk_bandwidth(catalogue, trials: int = 3, experts: int = 24) -> float:
    """Median GB/s of reading random experts cold, exactly as the unified tier fetches them (pread pool)."""
    from vismmoe_edge.experts import pagecache

    rng = random.Random(0)
    keys = list(catalogue.experts)
    shards = sorted({p.shard for loc in catalogue.experts.values() for p in loc.parts})
    files = {shard: pagecache.MappedFile(shard) for shard in shards}
    for mf in files.values():
        mf.set_random()
    rates = []
    for _ in range(trials):
        for shard in shards:
            pagecache.release(files[shard], [(0, files[shard].size)])
        picks = rng.sample(keys, experts)
        start = time.perf_counter()
        for key in picks:
            for part in catalogue.expert(*key).parts:
                pagecache.prefetch_pread(files[part.shard], [(part.offset, part.nbytes)], threads=8)
        rates.append(experts * catalogue.expert_bytes / (time.perf_counter() - start) / 1e9)
    for mf in files.values():
        mf.close()
    return statistics.median(rates)


def oracle_row(lru: dict, bandwidth_gb_s: float, compute_s: float) -> dict:
    """Belady's fewest bytes for the LRU trials' own routing at the same slots (median over trials), read at the
    best bandwidth seen in this run and overlapped perfectly with the all-resident compute time."""
    per_token = lru["oracle_read_bytes_per_token"]
    seconds = max(compute_s, per_token / (bandwidth_gb_s * 1e9))
    return {
        "strategy": "oracle-bound",
        "slots": lru["slots"],
        "decode_read_bytes_per_token": per_token,
        "decode_s_per_token": seconds,
        "decode_tokens_per_s": 1 / seconds,
        "bandwidth_gb_s": bandwidth_gb_s,
    }


def run_trial(args: argparse.Namespace, strategy: str, cap_bytes: int | None, shards: list[Path], start_token: int):
    from bench import memcgroup

    model = args.model
    if strategy.startswith("q:"):  # the quantized copy: its own shards are the ones to evict
        model = args.quant_model
        shards = sorted(model.glob("*.safetensors"))

    cmd = [
        sys.executable,
        __file__,
        "--worker",
        strategy,
        "--model",
        str(model),
        "--routing",
        args.routing,
        "--tokens",
        str(args.tokens),
        "--start-token",
        str(start_token),
        "--cap-bytes",
        str(cap_bytes or 0),
        "--margin-mib",
        str(args.margin_mib),
    ]
    if args.predictor_file:
        cmd += ["--predictor-file", str(args.predictor_file)]
    if args.trace:
        cmd += ["--trace", str(args.trace)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    run = memcgroup.run_capped(cmd, cap_bytes, evict=shards, env=env, capture_output=True, timeout=1800)
    if run.returncode != 0:
        tail = (run.stderr or "").strip().splitlines()[-3:]
        return {
            "strategy": strategy,
            "cap_bytes": cap_bytes,
            "error": f"rc={run.returncode} {' | '.join(tail)}",
            "oom_killed": run.oom_killed,
        }
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result.update(peak_cgroup_bytes=run.max_usage_bytes, cgroup_failcnt=run.failcnt, oom_killed=run.oom_killed)
    return result


def parse_ggufs(values: list[str] | None) -> dict[str, Path]:
    """`--llama-gguf NAME=PATH` (or a bare PATH, named llama.cpp) -> {strategy name: path}."""
    out = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        out["llama.cpp" if not sep else f"llama.cpp {name}"] = Path(path if sep else name)
    return out


def trial_order(
    names: list[str], starts: list[int], *, interleave: bool, warmups: int
) -> list[tuple[str, int, bool]]:
    """(strategy, start, measured) in the order to run them. Every measured trial comes straight after `warmups`
    discarded trials of the same strategy and start, so that each engine is measured at its steady state, not in
    whatever state the previous engine's process left the host (issue 25: a llama-bench process right after one
    of ours decoded at a quarter of its steady speed). The same rule applies to every strategy, ours included."""
    if interleave:  # round-robin over strategies, so that a noisy neighbour slows them alike
        pairs = [(strategy, start) for start in starts for strategy in names]
    else:
        pairs = [(strategy, start) for strategy in names for start in starts]
    return [(s, start, measured) for s, start in pairs for measured in [False] * warmups + [True]]


def run_llamacpp(
    args: argparse.Namespace, cap_bytes: int | None, gguf: Path, name: str = "llama.cpp", runs: int = 0,
    *, warm: bool = False
) -> dict:
    """llama.cpp's own llama-bench tg on the same expert bytes (converted to GGUF); `runs` separate processes
    (default --repeats). Capped at `cap_bytes` with the GGUF evicted before each process, or (`warm`, for the
    resident row) uncapped with the GGUF read into the page cache first and left there."""
    from bench import llamacpp as llamacpp_baseline

    result = llamacpp_baseline.llama_bench(
        gguf,
        args.llama_build,
        test=f"tg{args.llama_tokens}",
        limit=cap_bytes,
        runs=runs or args.repeats,
        evict=not warm,
        log=lambda line: None,
        timeout=args.llama_timeout,
        extra_args=tuple(args.llama_args.split()),
    )
    if result.tok_s_median is None:
        return {"strategy": name, "cap_bytes": cap_bytes, "error": str([r.error for r in result.runs])}
    probes = [
        {
            "resident_at_timed_start": r.resident_at_timed_start,
            "resident_at_exit": r.resident_at_exit,
            "timed_read_bytes": r.timed_read_bytes,
            "wall_s": r.wall_s,
            "cpu_s": r.cpu_s,
            "to_timed_s": r.to_timed_s,
            **{k: r.host.get(k) for k in ("cpu_share.steal", "cpu_share.iowait", "vm.pgmajfault", "loadavg_1m")},
        }
        for r in result.runs
    ]
    return {
        "strategy": name,
        "gguf": str(gguf),
        "gguf_bytes": result.gguf_bytes,
        "peak_cgroup_bytes": max(r.max_usage_bytes for r in result.runs),
        "cap_bytes": cap_bytes,
        "decode_tokens_per_s": result.tok_s_median,
        "decode_s_per_token": 1 / result.tok_s_median,
        "decode_read_bytes_per_token": result.read_bytes_per_token_median,
        "decode_tokens_per_s_all": [round(r.tok_s, 3) for r in result.runs],
        "trials": len(result.runs),
        "routing": "llama.cpp's own (random prompt ids through the synthetic routers)",
        "probes": probes,
    }


def median_of(trials: list[dict], warmups: list[dict] | None = None) -> dict:
    """The median row of the measured `trials`; the discarded warm-up trials' tok/s are kept for the record."""
    ok = [t for t in trials if "error" not in t]
    if not ok:
        return trials[0]
    out = dict(ok[0])
    for key in (
        "prefill_s",
        "decode_s_per_token",
        "decode_tokens_per_s",
        "decode_read_bytes_per_token",
        "hit_rate",
        "stall_s",
        "wasted_speculative_bytes",
        "peak_cgroup_bytes",
        "oracle_read_bytes_per_token",
        "fetch_gb_s",
    ):
        values = [t[key] for t in ok if t.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["decode_tokens_per_s"] = 1 / out["decode_s_per_token"]
    out["trials"] = len(ok)
    out["decode_tokens_per_s_all"] = [round(1 / t["decode_s_per_token"], 3) for t in ok]
    if "oracle_read_bytes_per_token" in out:
        out["belady_read_bytes_per_token"] = out["oracle_read_bytes_per_token"]
    if len(ok) < len(trials):
        out["failed_trials"] = [t["error"] for t in trials if "error" in t]
    if warmups:
        out["warmup_tokens_per_s"] = [round(t["decode_tokens_per_s"], 3) if "error" not in t else None
                                      for t in warmups]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--trace", type=Path)
    ap.add_argument("--routing", choices=["replay", "sampled"], default="replay")
    ap.add_argument("--caps", default="0.4,0.6", help="memory caps as shares of the checkpoint's bytes")
    ap.add_argument("--strategies", help=f"comma-separated, of {', '.join(STRATEGIES)} (default: all that apply)")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--margin-mib", type=int, default=384)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--llama-gguf", action="append", help="NAME=PATH of the same weights as GGUF (repeatable)")
    ap.add_argument("--llama-timeout", type=float, default=900, help="seconds per llama-bench process")
    ap.add_argument("--llama-args", default="", help="extra llama-bench arguments, e.g. '--repack 0'")
    ap.add_argument("--quant-model", type=Path, help="our quantized copy of --model, for the q:<strategy> rows")
    ap.add_argument("--resident", default="resident", help="comma-separated all-resident baselines to time")
    ap.add_argument("--llama-build", type=Path, help="llama.cpp build directory (bin/llama-bench)")
    ap.add_argument("--llama-tokens", type=int, default=32)
    ap.add_argument("--predictor-file", type=Path, help="an exported predictor for the popularity+learned strategy")
    ap.add_argument("--starts", help="comma-separated trace tokens where the repeats start (default 1000, 2000, ...)")
    ap.add_argument(
        "--interleave", action="store_true", help="run a cap's trials round-robin over the strategies (noisy hosts)"
    )
    ap.add_argument(
        "--warmup-trials",
        type=int,
        default=1,
        help="discarded trials of the same strategy straight before each measured one (ours and llama.cpp's)",
    )
    ap.add_argument(
        "--llama-resident",
        action="store_true",
        help="with --resident: also time each --llama-gguf uncapped, its file in the page cache (warm)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--cap-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--start-token", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.strategy = args.worker
        print(json.dumps(worker(args)))
        return
    if args.routing == "replay" and args.trace is None:
        ap.error("--routing replay needs --trace PATH")

    from tqdm import tqdm

    from vismmoe_edge.checkpoint import read_tensor_table
    from vismmoe_edge.models.registry import model_family

    family = model_family(args.model)  # Qwen3-VL-MoE, GLM-4.5V or DeepSeek-VL2, from config.json
    config = family.read_config(args.model)
    catalogue = family.catalogue_for(config, family.select_tensors(config, read_tensor_table(args.model)))
    shards = sorted(args.model.glob("*.safetensors"))
    checkpoint_bytes = sum(s.stat().st_size for s in shards)
    caps = [float(c) for c in args.caps.split(",")]
    strategies = (args.strategies or ",".join(STRATEGIES)).split(",")
    if args.routing == "replay" and args.strategies is None:  # it guesses from the model's router, which replayed
        strategies = [s for s in strategies if "next-layer-gate" not in s]  # routing ignores: only when asked for
    if args.predictor_file is None:
        strategies = [s for s in strategies if "learned" not in s]
    bandwidth = disk_bandwidth(catalogue)
    print(f"disk: {bandwidth:.2f} GB/s for cold expert-sized preads", flush=True)

    if args.starts:
        starts = [int(s) for s in args.starts.split(",")]
    else:
        starts = [1000 * (r + 1) for r in range(args.repeats)]  # each repeat replays a different stretch
    ggufs = parse_ggufs(args.llama_gguf)
    results = []
    every_trial: list[dict] = []  # in the order they ran, warm-ups included, for the record
    resident = None
    warmups = args.warmup_trials

    def run_all(names: list[str], cap_bytes: int | None, cap: float | None) -> list[dict]:
        """Every strategy of `names` at one cap (None: the resident rows), each measured trial after its
        discarded warm-up trials (trial_order); one row per strategy, the median of its measured trials."""
        trials: dict[str, list[dict]] = {name: [] for name in names}
        discarded: dict[str, list[dict]] = {name: [] for name in names}
        for strategy, start, measured in trial_order(names, starts, interleave=args.interleave, warmups=warmups):
            if strategy in ggufs:  # one llama-bench process per trial; warm and uncapped for the resident row
                trial = run_llamacpp(args, cap_bytes, ggufs[strategy], strategy, runs=1, warm=cap_bytes is None)
            else:
                trial = run_trial(args, strategy, cap_bytes, shards, start)
            (trials if measured else discarded)[strategy].append(trial)
            every_trial.append({"cap": cap, "start": start, "measured": measured, **trial})
            print(json.dumps({"cap": cap, "start": start, "measured": measured, **trial})[:400], flush=True)
            bar.update()
        rows = []
        for strategy in names:
            row = {**median_of(trials[strategy], discarded[strategy]), "cap": cap}
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows

    resident_names = [r for r in args.resident.split(",") if r]
    if resident_names and args.llama_resident:
        resident_names += list(ggufs)
    caps_total = len(caps) * (len(strategies) + len(ggufs)) + len(resident_names)
    bar = tqdm(total=caps_total * len(starts) * (1 + warmups), desc="trials")
    if resident_names:
        results += run_all(resident_names, None, None)
        resident = next((r for r in results if "error" not in r and r["strategy"] not in ggufs), None)
    for cap in caps:
        cap_bytes = int(cap * checkpoint_bytes)
        rows = run_all(strategies + list(ggufs), cap_bytes, cap)
        lru = next((r for r in rows if r["strategy"] == "lru" and "error" not in r), None)
        if lru is not None and resident is not None:
            fastest = max([bandwidth] + [r["fetch_gb_s"] for r in rows if r.get("fetch_gb_s")])
            rows.append({**oracle_row(lru, fastest, resident["decode_s_per_token"]), "cap": cap})
        results += rows
    bar.close()
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}, {os.uname().release}",
        "model": str(args.model),
        "quant_model": str(args.quant_model) if args.quant_model else None,
        "llama_ggufs": {name: str(path) for name, path in ggufs.items()},
        "command": " ".join(sys.argv),
        "llama_args": args.llama_args,
        "checkpoint_bytes": checkpoint_bytes,
        "routing": args.routing,
        "trace": str(args.trace) if args.trace else None,
        "prompt_tokens": PROMPT_TOKENS,
        "decode_tokens": args.tokens,
        "repeats": len(starts),
        "interleaved": args.interleave,
        "warmup_trials": warmups,
        "starts": starts,
        "predictor_file": str(args.predictor_file) if args.predictor_file else None,
        "disk_gb_s": bandwidth,
        "results": results,
        "trials": every_trial,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
