#!/usr/bin/env python3
"""Projected decode speed of Qwen3-VL-30B-A3B on Orin NX 16 GB and Orin Nano 8 GB with the integrated-GPU slot tier,
from named inputs only (each with its source). Nothing here was measured on a board.

    python3 tools/analysis/orin_projection.py            # the markdown table in docs/benchmarks.md

Per decode token (batch 1):
- expert memory M_e = MemAvailable - C_safe - R - KV - A - IO, the planner's rule (plan.py, memory_plan.py);
- cache share f = min(1, M_e / all expert bytes); with uniform routing (the synthetic benchmarks' worst case) the
  hit rate is f, so misses read (1 - f) x expert bytes per token from NVMe; a second column uses 85%, the middle
  of the 80-90% peers expect for ~9 GB of cache over ~16.5 GB of 4-bit experts [R: docs/platform-facts.md §5.2];
- DRAM traffic = dense bytes (read) + 3 x expert bytes (the slot pool's decode gathers each token's k experts:
  read + write, then the GEMMs read the copy: pool_compute.decode_experts) + 2 x miss bytes (a buffered pread
  copies page cache -> slot; O_DIRECT would save this), at a kernel efficiency of 50% of the DRAM peak (MLC-class
  on AGX Orin; llama.cpp reaches ~25% [R: docs/platform-facts.md §5.2]);
- time = NVMe time + DRAM time (not overlapped: SSD DMA and compute share the memory controller and flash-moe
  found them not profitably overlapped on unified memory [R: docs/platform-facts.md §5.3]); the overlapped bound max()
  is given too.

With `--measured board_proxy.json` (tools/bench/board_proxy.py: the board's plan run on a CPU under a cgroup of
the board's memory, int4 experts and int4 dense weights, sampled routing), the miss bytes are not modelled but
measured: the disk bytes each decode step read under that plan's cache; the dense bytes are the plan's language
weights (int4/int8 as converted); the token's expert bytes 8 x 48 x the checkpoint's expert record. Then the same
time rule with each board's DRAM peak and NVMe link (`MEASURED_BOARDS`, sources there).

With `--trace PATH` too (a routing trace given by path, e.g. the DeepSeek-V2-Lite measurement trace), a third
miss figure comes from real routing: each board row's plan (its pinned-layer count, and its cache's share of the
streamed layers' experts) is replayed on the trace with the engine's default eviction ("popularity",
experts/pipeline.py; LRU beside it), token by token, warm across prompts; the hit rate over the trace's streamed
layers gives misses per token = (1 - hit) x top-8 x (48 - pinned) layers x the checkpoint's expert record.

    python3 tools/analysis/orin_projection.py --measured board_proxy.json --trace PATH [--trace-max-tokens N]

With `--prefetch` too, a fourth table replays the engine's lookahead prefetch (depth 2, the board plans') on the
same trace, per predictor, with its own time rule: tools/analysis/prefetch_replay.py's docstring.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

for _root in Path(__file__).resolve().parents[1:3]:  # tools/ and the checkout: run without installing
    if str(_root) not in sys.path:
        sys.path.insert(0, str(_root))

GB, GIB = 1e9, 1 << 30

INPUTS = {
    "expert_bytes": (
        {"bf16": 9.44e6, "int4": 2.51e6},
        "one expert (bf16: platform-facts.md §5.1; int4 g128 with bf16 scale and zero per group: quantization.md §4)",
    ),
    "experts": (6144, "48 MoE layers x 128 experts (docs/platform-facts.md §5.1)"),
    "top_k_layers": (8 * 48, "experts a token touches: top-8 x 48 layers (docs/platform-facts.md §5.1)"),
    "dense_read_bytes": (
        2.46e9,
        "non-expert weights read per token, bf16 (platform-facts.md §5.1); "
        "they stay bf16 with int4 experts (quantization.md §5)",
    ),
    "language_weights_bytes": (
        3.09e9,
        "resident non-expert language weights incl. embeddings, bf16 (benchmarks.md, "
        "H200 run: 'keeps the 3.09 GB of non-expert weights resident')",
    ),
    "vision_weights_bytes": (
        1.08e9,
        "[I] 0.539 B parameters x 2 bytes: transformers 5.24's Qwen3VLMoeVisionConfig "
        "defaults (depth 27, hidden 1152, MLP 4304) with out_hidden 2048; not checked against the "
        "hub's config.json",
    ),
    "kv_bytes": (
        4608 * 48 * 2 * 4 * 128 * 2,
        "KV cache for 4,608 positions (memory_plan.DEFAULT_CONTEXT_TOKENS) x 48 layers x K,V x 4 KV heads x 128 x bf16",
    ),
    "activation_bytes": (4096 * 67584 * 2, "memory_plan.activation_bytes for a 4,096-token prefill [I]"),
    "boards": (
        {
            "Orin NX 16 GB": {"mem_available": 12582912 * 1024, "c_safe": 1.5 * GIB, "dram": 102.4e9},
            "Orin Nano 8 GB (Super)": {"mem_available": 5243904 * 1024, "c_safe": 1.0 * GIB, "dram": 102.0e9},
            "Orin Nano 8 GB": {"mem_available": 5243904 * 1024, "c_safe": 1.0 * GIB, "dram": 68.0e9},
        },
        "MemAvailable: the recorded board trees tests/fixtures/boards/orin-nx-16gb-jp5 and orin-nano-8gb-super-jp6 "
        "(/proc/meminfo); C_safe: profiles orin-nx-16gb--maxn (1.5 GiB), orin-nano-8gb[-super]--* (1.0 GiB); DRAM "
        "peak: docs/platform-facts.md §3.2 (102.4 GB/s NX; 68 -> 102 GB/s Nano Super)",
    ),
    "nvme": (
        (2.0e9, 3.5e9, 6.0e9),
        "NVMe read bandwidth classes of platform-facts.md §5.2 "
        "(Gen3 x4 ~3.5, Gen4 x4 ~6 GB/s); no board's NVMe was measured",
    ),
    "efficiency": (0.5, "share of the DRAM peak the kernels reach (MLC-class on AGX Orin, platform-facts.md §5.2)"),
}


def project(board: dict, precision: str, nvme: float, hit: float | None) -> dict:
    v = {k: value for k, (value, _) in INPUTS.items()}
    s_e = v["expert_bytes"][precision]
    io = 4 * s_e
    m_e = (board["mem_available"] - board["c_safe"] - v["language_weights_bytes"] - v["vision_weights_bytes"]
           - v["kv_bytes"] - v["activation_bytes"] - io)  # fmt: skip
    top_k_bytes = 8 * s_e
    if m_e < top_k_bytes:
        return {"m_e": m_e, "refused": True}
    f = min(1.0, m_e / (v["experts"] * s_e))
    h = f if hit is None else max(hit, f)
    per_token = v["top_k_layers"] * s_e
    miss = (1 - h) * per_token
    t_nvme = miss / nvme
    dram = v["dense_read_bytes"] + 3 * per_token + 2 * miss
    t_dram = dram / (board["dram"] * v["efficiency"])
    return {"m_e": m_e, "f": f, "hit": h, "miss": miss, "t_nvme": t_nvme, "t_dram": t_dram,
            "serial": 1 / (t_nvme + t_dram), "overlapped": 1 / max(t_nvme, t_dram), "refused": False}  # fmt: skip


# profile of the measured run -> (board, DRAM peak B/s, NVMe read B/s of its M.2 link class, NVMe source).
# DRAM: docs/platform-facts.md §3.2 (NVIDIA module data sheets; Orin Nano Super announcement). PCIe: the Jetson
# Orin Nano series data sheet gives the module PCIe Gen3 (1 x4 + 3 x1), the Orin NX series data sheet PCIe Gen4
# (1 x4 + 3 x1) (NVIDIA Jetson Download Center); ~3.5 GB/s and ~6 GB/s are the read classes of Gen3 x4 and Gen4 x4
# SSDs (platform-facts.md §5.2), not measured on a board. 2 GB/s stands for a DRAM-less budget SSD [I].
MEASURED_BOARDS = {
    "orin-nano-8gb-super--maxn-super": [
        ("Orin Nano 8 GB Super (MAXN SUPER)", 102.0e9),
        ("Orin Nano 8 GB (no Super)", 68.0e9),
    ],
    "orin-nx-16gb--maxn": [("Orin NX 16 GB (MAXN)", 102.4e9)],
}
NVME_BY_PROFILE = {"orin-nano-8gb-super--maxn-super": 3.5e9, "orin-nx-16gb--maxn": 6.0e9}


def project_measured(row: dict, dram: float, nvme: float, efficiency: float = INPUTS["efficiency"][0]) -> dict:
    """Decode tok/s on a board from one board_proxy.py row: its measured disk bytes per decode step (the misses),
    the plan's dense language bytes and the token's expert bytes (top-8 x layers x one record), with the module
    header's time rule: NVMe time + DRAM time at `efficiency` of the peak (serial), and max() of the two."""
    miss = float(row["decode_read_bytes_per_token"])
    touched = INPUTS["top_k_layers"][0] * float(row["expert_bytes"])
    dense = float(row["plan"]["language_weights_bytes"])
    t_nvme = miss / nvme
    dram_bytes = dense + 3 * touched + 2 * miss
    t_dram = dram_bytes / (dram * efficiency)
    return {"miss": miss, "touched": touched, "dense": dense, "dram_bytes": dram_bytes, "t_nvme": t_nvme,
            "t_dram": t_dram, "serial": 1 / (t_nvme + t_dram), "overlapped": 1 / max(t_nvme, t_dram)}  # fmt: skip


def project_miss(row: dict, miss: float, dram: float, nvme: float, efficiency: float = INPUTS["efficiency"][0]) -> dict:
    """`project_measured` with `miss` bytes per decode token in place of the run's measured ones."""
    return project_measured(row | {"decode_read_bytes_per_token": miss}, dram, nvme, efficiency)


def completed(rows: list[dict]) -> list[dict]:
    """The board_proxy.py rows that ran to the end, on a board `MEASURED_BOARDS` knows."""
    return [row for row in rows if row.get("returncode") == 0 and row["profile"] in MEASURED_BOARDS]


def uniform_miss_bytes(row: dict, layers: int = 48, experts: int = 128) -> float:
    """The miss bytes per token the run's plan would give if routing were uniform: a pinned layer always hits, a
    streamed one hits with the cache's share of the streamed layers' experts."""
    return trace_miss_bytes(row, cache_share(row, layers, experts), layers)


def cache_share(row: dict, layers: int = 48, experts: int = 128) -> float:
    """The plan's expert cache as a share of its streamed layers' experts."""
    streamed = (layers - int(row["plan"]["pinned_layers"])) * experts * float(row["expert_bytes"])
    return min(1.0, float(row["plan"]["cache_bytes"]) / streamed)


def replay_plan(trace, pinned_layers: int, share: float, policy: str = "popularity") -> dict:
    """Replay `trace` token by token, warm across prompts, with its first `pinned_layers` MoE layers pinned and a
    cache of `share` of the other layers' experts; the hit rate is over the streamed layers' accesses only."""
    import numpy as np

    from vismmoe_edge.experts.oracle import layer_steps, lru, popularity

    if not 0 <= pinned_layers < trace.num_layers:
        raise ValueError(f"{pinned_layers} pinned layers leave none of the trace's {trace.num_layers} streamed")
    streamed_layers = trace.num_layers - pinned_layers
    capacity = max(trace.top_k, round(share * streamed_layers * trace.num_experts))
    keys, steps = layer_steps(trace)
    pinned = [layer * trace.num_experts + e for layer in trace.layer_ids[:pinned_layers]
              for e in range(trace.num_experts)]  # fmt: skip
    result = popularity(keys, steps, capacity, pinned) if policy == "popularity" else lru(keys, capacity, pinned)
    streamed_accesses = result.accesses - int(np.isin(keys, pinned).sum())
    return {"capacity": capacity, "of": streamed_layers * trace.num_experts, "streamed_accesses": streamed_accesses,
            "misses": result.misses, "hit": 1 - result.misses / streamed_accesses}  # fmt: skip


def trace_miss_bytes(row: dict, hit: float, layers: int = 48, top_k: int = 8) -> float:
    """Miss bytes per token of the run's plan at a hit rate `hit` over its streamed layers (pinned ones hit)."""
    streamed = layers - int(row["plan"]["pinned_layers"])
    return (1 - hit) * top_k * streamed * float(row["expert_bytes"])


def trace_table(rows: list[dict], trace) -> list[str]:
    lines = [f"trace: {trace.source}: {trace.num_tokens:,} tokens, {trace.num_prompts:,} prompts, "
             f"{trace.num_layers} MoE layers x {trace.num_experts} experts (top-{trace.top_k})", "",
             "| board (plan) | pinned layers; cache share of streamed experts | trace replay: cache (experts of "
             "streamed) | hit rate over streamed layers: popularity (LRU) | GB missed / token (Qwen3-VL bytes) | "
             "at the board's link class: tok/s serial, overlapped | measured proxy; uniform: tok/s serial |",
             "|---|---|---|---|---:|---|---|"]  # fmt: skip
    for row in completed(rows):
        pinned, share = int(row["plan"]["pinned_layers"]), cache_share(row)
        pop, ref = replay_plan(trace, pinned, share, "popularity"), replay_plan(trace, pinned, share, "lru")
        miss = trace_miss_bytes(row, pop["hit"])
        link = NVME_BY_PROFILE[row["profile"]]
        for name, dram in MEASURED_BOARDS[row["profile"]]:
            own = project_miss(row, miss, dram, link)
            measured = project_measured(row, dram, link)
            uniform = project_miss(row, uniform_miss_bytes(row), dram, link)
            lines.append(f"| {name} | {pinned}; {share:.1%} | {pop['capacity']:,} of {pop['of']:,} | "
                         f"{pop['hit']:.1%} ({ref['hit']:.1%}) | {miss / GB:.3f} | "
                         f"{link / GB:.1f} GB/s: {own['serial']:.2f}, {own['overlapped']:.2f} | "
                         f"{measured['serial']:.2f}; {uniform['serial']:.2f} |")  # fmt: skip
    return lines


def measured_table(rows: list[dict]) -> list[str]:
    lines = ["| board (plan) | measured GB read / decode token | dense GB / token | DRAM GB / token | "
             "NVMe 2 / 3.5 / 6 GB/s: tok/s (serial) | at the board's link class: serial, overlapped | "
             "uniform routing instead: GB missed, tok/s serial at the link |",
             "|---|---:|---:|---:|---|---|---|"]  # fmt: skip
    for row in completed(rows):
        link = NVME_BY_PROFILE[row["profile"]]
        for name, dram in MEASURED_BOARDS[row["profile"]]:
            grid = [project_measured(row, dram, nvme) for nvme in INPUTS["nvme"][0]]
            own = project_measured(row, dram, link)
            speeds = " / ".join(f"{g['serial']:.2f}" for g in grid)
            uniform = project_miss(row, uniform_miss_bytes(row), dram, link)
            lines.append(f"| {name} | {own['miss'] / GB:.3f} | {own['dense'] / GB:.2f} | "
                         f"{own['dram_bytes'] / GB:.2f} | {speeds} | "
                         f"{link / GB:.1f} GB/s: {own['serial']:.2f}, {own['overlapped']:.2f} | "
                         f"{uniform['miss'] / GB:.3f}, {uniform['serial']:.2f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", type=Path, help="tools/bench/board_proxy.py's JSON: project from its bytes per token")
    ap.add_argument("--trace", type=Path, help="with --measured: a routing trace (.npz or .jsonl, by path) to replay "
                    "each board's plan on")  # fmt: skip
    ap.add_argument("--trace-max-tokens", type=int, default=0, help="replay only the trace's first N tokens (0: all)")
    ap.add_argument("--prefetch", nargs="?", const="previous-token,frequency,transfer,random,oracle",
                    help="with --trace: replay lookahead prefetch with these predictors (comma-separated; "
                    "prefetch_replay.PREDICTORS)")  # fmt: skip
    ap.add_argument("--prefetch-depth", type=int, default=2, help="MoE layers predicted ahead (the board plans': 2)")
    ap.add_argument("--test-from", type=int, default=160_000, help="--prefetch: first counted token; the "
                    "baselines are counted on earlier prompts")  # fmt: skip
    ap.add_argument("--warmup-tokens", type=int, default=40_000, help="--prefetch: tokens replayed before it")
    args = ap.parse_args(argv)
    if args.trace is not None and args.measured is None:
        ap.error("--trace needs --measured (the board rows whose plans it replays)")
    if args.measured is not None:
        rows = json.loads(args.measured.read_text())["rows"]
        print("\n".join(measured_table(rows)))
        print()
        if args.trace is not None:
            from analysis.trace_stats import truncate

            from vismmoe_edge.errors import VismmoeError
            from vismmoe_edge.trace import load_trace

            try:
                trace = load_trace(args.trace)
            except VismmoeError as e:
                ap.exit(2, f"error: {e}\n")
            if args.trace_max_tokens > 0:
                trace = truncate(trace, args.trace_max_tokens)
            print("\n".join(trace_table(rows, trace)))
            print()
            if args.prefetch:
                from analysis.prefetch_replay import prefetch_table

                names = [p for p in args.prefetch.split(",") if p]
                print("\n".join(prefetch_table(rows, trace, names, args.prefetch_depth, args.test_from,
                                                args.warmup_tokens)))  # fmt: skip
                print()
        return
    boards, _ = INPUTS["boards"]
    print(
        "| board | experts | M_e (GB) | cache share f | hit rate | miss GB/token | NVMe 2 / 3.5 / 6 GB/s: tok/s "
        "(serial) | at 3.5 GB/s, overlapped bound |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for name, board in boards.items():
        for precision in ("bf16", "int4"):
            for hit in (None, 0.85):
                rows = [project(board, precision, nvme, hit) for nvme in INPUTS["nvme"][0]]
                r = rows[1]
                if r["refused"]:
                    if hit is None:
                        print(
                            f"| {name} | {precision} | {r['m_e'] / GB:.2f} | refused: less than one layer's "
                            "top-8 left for experts | | | | |"
                        )
                    continue
                label = "= f (uniform routing)" if hit is None else "85% (peers' range)"
                speeds = " / ".join(f"{x['serial']:.2f}" for x in rows)
                print(
                    f"| {name} | {precision} | {r['m_e'] / GB:.2f} | {r['f']:.0%} | {label}: {r['hit']:.0%} | "
                    f"{r['miss'] / GB:.2f} | {speeds} | {r['overlapped']:.2f} |"
                )
    print()
    for key, (_, source) in INPUTS.items():
        print(f"- `{key}`: {source}")


if __name__ == "__main__":
    main()
