"""LRU vs Belady (the offline optimum) on a routing trace, as a markdown table.

    python tools/analysis/trace_stats.py TRACE --capacity-experts 166,416,25% --expert-mib 9.0 [--max-tokens 20000]

TRACE is a `.npz` measurement trace or a `vismmoe-edge run --trace-out` JSONL file, always given by path.
Replay model: one cache shared by all MoE layers, capacity counted in experts (a value ending in % is that share
of layers x experts), warm across prompts, which are replayed back to back in file order. Pinned layers hold all
their experts outside that capacity and always hit.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from vismmoe_edge.errors import VismmoeError  # noqa: E402
from vismmoe_edge.experts.oracle import belady, expert_access_sequence, lru  # noqa: E402
from vismmoe_edge.trace import RoutingTrace, load_trace  # noqa: E402

MIB = 1 << 20


def parse_capacities(text: str, total_experts: int) -> list[int]:
    capacities = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = round(float(item[:-1]) / 100 * total_experts) if item.endswith("%") else int(item)
        except ValueError as exc:
            raise VismmoeError(f"--capacity-experts: {item!r} is neither an integer nor a percentage") from exc
        if value < 1:
            raise VismmoeError(f"--capacity-experts: {item!r} gives {value} experts; use at least 1")
        capacities.append(value)
    return capacities


def truncate(trace: RoutingTrace, max_tokens: int) -> RoutingTrace:
    """The first `max_tokens` rows (the last prompt may be cut short)."""
    if max_tokens >= trace.num_tokens:
        return trace
    offsets = trace.prompt_offsets[trace.prompt_offsets < max_tokens]
    return RoutingTrace(
        expert_ids=trace.expert_ids[:max_tokens],
        prompt_offsets=offsets,
        num_experts=trace.num_experts,
        layer_ids=list(trace.layer_ids),
        source=f"{trace.source} [first {max_tokens} tokens]",
        decode=None if trace.decode is None else trace.decode[:max_tokens],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="routing trace (.npz or .jsonl)")
    parser.add_argument("--capacity-experts", required=True, help="comma-separated cache sizes, in experts or N%%")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--expert-mib", type=float, help="size of one expert in MiB (2^20 bytes)")
    size.add_argument("--expert-bytes", type=int, help="size of one expert in bytes")
    parser.add_argument("--max-tokens", type=int, default=0, help="replay only the first N tokens (0: all)")
    parser.add_argument(
        "--order",
        choices=("decode", "prefill"),
        default="decode",
        help="decode: token by token; prefill: each prompt's tokens batched, each layer's union once",
    )
    parser.add_argument("--pinned-layers", default="", help="comma-separated model layer ids kept fully resident")
    parser.add_argument("--dedupe", action="store_true", help="drop prompts identical to an earlier one")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.trace)
        if args.dedupe:
            trace = trace.dedupe()
        if args.max_tokens > 0:
            trace = truncate(trace, args.max_tokens)
        total_experts = trace.num_layers * trace.num_experts
        capacities = parse_capacities(args.capacity_experts, total_experts)
        pinned_layers = [int(x) for x in args.pinned_layers.split(",") if x.strip()]
    except VismmoeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: --pinned-layers: {exc}", file=sys.stderr)
        return 2
    expert_bytes = args.expert_bytes if args.expert_bytes is not None else round(args.expert_mib * MIB)
    keys = expert_access_sequence(trace, decode_order=args.order == "decode")
    pinned = {layer * trace.num_experts + e for layer in pinned_layers for e in range(trace.num_experts)}
    tokens = max(trace.num_tokens, 1)

    print(f"trace: {trace.source}")
    print(
        f"{trace.num_tokens:,} tokens, {trace.num_prompts:,} prompts, {trace.num_layers} MoE layers x "
        f"{trace.num_experts} experts (top-{trace.top_k}), {len(keys):,} accesses in {args.order} order; "
        f"expert {expert_bytes:,} B ({expert_bytes / MIB:.2f} MiB); pinned layers: {pinned_layers or 'none'}"
    )
    print()
    print(
        "| capacity (experts) | % of all | LRU miss rate | Belady miss rate | LRU MiB/token | Belady MiB/token "
        "| Belady / LRU bytes | replay s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for capacity in capacities:
        start = time.perf_counter()
        ref, opt = lru(keys, capacity, pinned), belady(keys, capacity, pinned)
        seconds = time.perf_counter() - start
        ratio = opt.misses / ref.misses if ref.misses else 1.0
        print(
            f"| {capacity:,} | {100 * capacity / total_experts:.1f}% | {ref.miss_rate:.3f} | {opt.miss_rate:.3f} "
            f"| {ref.misses * expert_bytes / tokens / MIB:,.1f} | {opt.misses * expert_bytes / tokens / MIB:,.1f} "
            f"| {ratio:.2f} | {seconds:.0f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
