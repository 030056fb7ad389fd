#!/usr/bin/env python3
"""Do promotions pay for their bus bytes? A replay of a routing trace through a slot pool, no model.

A device token reads the experts no GPU slot holds in place over the bus; after it, up to `limit` of them are
copied into slots (experts/promotion.py), evicting the least recently used. A promotion costs one expert's bytes
on the same bus and pays only if the expert is routed to again before it is evicted. This counts, per decode
token, the experts read in place and those promoted, for several limits (LRU, as the engine promotes; then
admission by decode popularity; then a clairvoyant static set, the floor without promotion), on the geometry
of tools/bench/discrete.py's 20 GiB rows (48 MoE layers of 128 experts, none pinned, 1,834 slots, MoE
layer i replaying trace layer i mod the trace's layers as vismmoe_edge/experts/replay.py does). The slots start
with the experts the prompt routed to most (the prefill's popularity, its last tokens weighing most as in the
engine: experts/recency.py), the prompt being the trace's tokens before the decode; the first table sets that
weighting against plain counts, without promotion.
    python3 tools/bench/promotion_sim.py TRACE.npz [--decode-tokens 64] [--json out.json]
    python3 tools/bench/promotion_sim.py TRACE.npz --recency-only --half-life 128 --starts "$(seq -s, 1000 1500 190000)"
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vismmoe_edge.experts.recency import PROMPT_HALF_LIFE_TOKENS  # noqa: E402
from vismmoe_edge.trace import RoutingTrace, load_trace  # noqa: E402

Key = tuple[int, int]


def routed(trace: RoutingTrace, token: int, layers: int, pinned: int) -> list[Key]:
    row = trace.expert_ids[token % trace.num_tokens]
    return [(m, int(e)) for m in range(pinned, layers) for e in row[m % trace.num_layers]]


def prompt_popularity(trace: RoutingTrace, start: int, prompt: int, layers: int, pinned: int,
                      half_life: float) -> collections.Counter:  # fmt: skip
    """Each expert's share of the prompt's tokens, a token `half_life` tokens before the prompt's last counting 1/2
    (0: each 1), as the engine ranks a prefill's experts (experts/recency.py)."""
    counts: collections.Counter = collections.Counter()
    total = 0.0
    for t in range(start, start + prompt):
        weight = 0.5 ** ((start + prompt - 1 - t) / half_life) if half_life > 0 else 1.0
        total += weight
        for k in routed(trace, t, layers, pinned):
            counts[k] += weight
    return collections.Counter({k: c / total for k, c in counts.items()})


def replay(trace: RoutingTrace, start: int, *, limit: int, slots: int, layers: int, pinned: int, experts: int,
           prompt: int, decode: int, half_life: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(experts read in place, experts promoted) per decode token."""
    counts = prompt_popularity(trace, start, prompt, layers, pinned, half_life)
    capacity = slots - pinned * experts  # the pinned layers' experts take slots of their own
    resident = collections.OrderedDict((k, None) for k, _ in counts.most_common(capacity))  # first out first
    reads = promoted = 0
    for t in range(start + prompt, start + prompt + decode):
        missed = []
        for key in routed(trace, t, layers, pinned):
            if key in resident:
                resident.move_to_end(key)
            elif key not in missed:
                missed.append(key)
        reads += len(missed)
        for key in missed[:limit]:  # in routing order, as promote_host_reads takes them
            if len(resident) >= capacity:
                resident.popitem(last=False)
            resident[key] = None
            promoted += 1
    return reads / decode, promoted / decode


def replay_frequency(trace: RoutingTrace, start: int, *, limit: int, slots: int, layers: int, pinned: int,
                     experts: int, prompt: int, decode: int, decay: float = 0.98,
                     half_life: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """As `replay`, but a read expert is promoted only if its decode popularity (a count decayed by `decay` a token,
    seeded with its prompt frequency a token) beats the least popular resident's, which it evicts: admission by
    frequency, so that one-off experts do not displace reused ones."""
    counts = prompt_popularity(trace, start, prompt, layers, pinned, half_life)
    capacity = slots - pinned * experts
    score = collections.defaultdict(float, counts)
    resident = {k for k, _ in counts.most_common(capacity)}
    reads = promoted = 0
    for t in range(start + prompt, start + prompt + decode):
        used = list(dict.fromkeys(routed(trace, t, layers, pinned)))
        for k in score:
            score[k] *= decay
        for k in used:
            score[k] += 1.0
        missed = [k for k in used if k not in resident]
        reads += len(missed)
        for key in sorted(missed, key=lambda k: -score[k])[:limit]:
            victim = min(resident, key=score.__getitem__)
            if score[key] > score[victim]:
                resident.remove(victim)
                resident.add(key)
                promoted += 1
    return reads / decode, promoted / decode


def clairvoyant_static(trace: RoutingTrace, start: int, *, slots: int, layers: int, pinned: int, experts: int,
                       prompt: int, decode: int) -> float:  # fmt: skip
    """Experts read in place a token if the slots held, from the start, the experts the decode itself routes to
    most (known only afterwards): a floor for every policy that keeps its slots and promotes nothing."""
    used = [set(routed(trace, t, layers, pinned)) for t in range(start + prompt, start + prompt + decode)]
    best = {k for k, _ in collections.Counter(k for u in used for k in u).most_common(slots - pinned * experts)}
    return sum(len(u - best) for u in used) / decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--pinned", type=int, default=0,
                    help="MoE layers pinned whole (discrete.py's 20 GiB engine pins none; the 2026-12-05 table: 3)")
    ap.add_argument("--slots", type=int, default=1834)
    ap.add_argument("--expert-mb", type=float, default=9.437184, help="one expert's bytes (bf16 30B-A3B)")
    ap.add_argument("--prompt-tokens", type=int, default=1100)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--starts", default="0,2000,4000", help="trace positions of the prompts (one trial each)")
    ap.add_argument("--limits", default="0,8,16,32,64,100000")
    ap.add_argument("--half-life", type=float, default=PROMPT_HALF_LIFE_TOKENS,
                    help="the slots' first experts: the prompt's tokens weighted by recency with this half-life, "
                    "as the engine does (0: plain counts, the engine before run 20)")  # fmt: skip
    ap.add_argument("--recency-only", action="store_true",
                    help="only the first table: no promotion, the prompt's counts plain against weighted")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    trace = load_trace(args.trace)
    geometry = {"slots": args.slots, "layers": args.layers, "pinned": args.pinned, "experts": args.experts,
                "prompt": args.prompt_tokens, "decode": args.decode_tokens}  # fmt: skip
    starts = [int(x) for x in args.starts.split(",")]
    rows = []
    print(f"{len(starts)} prompts, medians a decode token\n{'limit':>7} {'read in place':>14} {'promoted':>9} "
          f"{'bus MB/token':>13}")  # fmt: skip
    for half_life in sorted({0.0, args.half_life}):
        reads = statistics.median(replay(trace, s, limit=0, half_life=half_life, **geometry)[0] for s in starts)
        rows.append({"limit": 0, "policy": "prompt popularity", "half_life": half_life, "reads_per_token": reads,
                     "bus_mb": reads * args.expert_mb})  # fmt: skip
        label = f"the prompt's last tokens first, half-life {half_life:g}" if half_life else "the prompt's counts"
        print(f"{'0':>7} {reads:>14.1f} {0:>9.1f} {reads * args.expert_mb:>13.0f}  ({label})")
    if args.recency_only:
        if args.json:
            args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
        return
    print("with promotion (the slots' first experts weighted as the engine weighs them):")
    for limit in (int(x) for x in args.limits.split(",")):
        trials = [replay(trace, s, limit=limit, half_life=args.half_life, **geometry) for s in starts]
        reads = statistics.median(r for r, _ in trials)
        promoted = statistics.median(p for _, p in trials)
        bus_mb = (reads + promoted) * args.expert_mb
        rows.append({"limit": limit, "reads_per_token": reads, "promoted_per_token": promoted, "bus_mb": bus_mb})
        print(f"{limit:>7} {reads:>14.1f} {promoted:>9.1f} {bus_mb:>13.0f}")
    for limit in (4, 8):  # admission by decode popularity
        trials = [replay_frequency(trace, s, limit=limit, half_life=args.half_life, **geometry) for s in starts]
        reads = statistics.median(r for r, _ in trials)
        promoted = statistics.median(p for _, p in trials)
        bus_mb = (reads + promoted) * args.expert_mb
        rows.append({"limit": limit, "policy": "frequency", "reads_per_token": reads, "promoted_per_token": promoted,
                     "bus_mb": bus_mb})  # fmt: skip
        print(f"{limit:>7} {reads:>14.1f} {promoted:>9.1f} {bus_mb:>13.0f}  (promoted by decode popularity)")
    floor = statistics.median(clairvoyant_static(trace, s, **geometry) for s in starts)
    rows.append({"limit": 0, "policy": "clairvoyant static", "reads_per_token": floor,
                 "bus_mb": floor * args.expert_mb})  # fmt: skip
    print(
        f"{'-':>7} {floor:>14.1f} {0:>9.1f} {floor * args.expert_mb:>13.0f}  (the decode's own most routed, "
        "known in advance)"
    )
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
