"""The engine's lookahead prefetch replayed on a routing trace, and the board projection it gives.

    python3 tools/analysis/orin_projection.py --measured board_proxy.json --trace PATH --prefetch

Per (token, MoE layer), as experts/pipeline.py orders it (begin_layer, then the predictor's prefetch, then finish):
1. demand: the layer's routed experts that are not resident are demand misses (bytes compute stalls on); each
   takes a slot from the lowest-priority Expired entry, else the lowest Speculative one;
2. prefetch: the predictor names experts of layers l+1..l+depth with a score; highest score first, an expert
   already resident gets its priority raised to the score until its layer runs (pipeline.prefetch), a new one is fetched
   speculatively while fewer than the cap are queued (runtime.py: min(depth x top-k, slots // 4) experts; the
   I/O is assumed to have drained the previous step's queue, so each call may queue up to the cap). A
   speculative fetch takes only a slot whose entry is worth less than its score (any Expired one: their
   priorities sit near EXPIRED_BASE), otherwise it is dropped. It enters as Speculative with its score;
3. when its layer comes, a prediction the layer did not route is Expired at EXPIRED_BASE - 1 (the first to go),
   and a resident expert raised in step 2 goes back to its priority before (pipeline._expire_unrouted_predictions,
   since 2026-12-03: before, the raise lasted until the expert was routed again); one it routed is a hit;
4. the step's experts become Expired at EXPIRED_BASE + popularity x POPULARITY_SCALE + use clock.
Pinned layers hit and take no slot; the predictor still runs at them, so it can name the first streamed layer.
Nothing is timed: fetches complete within the step. Whether the link can carry them is the time model's question.

Predictors, all from expert ids only: `previous-token` (the engine's: the previous trace token's experts at
l+1..l+depth, score 1/distance); `frequency` and `transfer` (predict/baselines.py's layer frequency and
P(next | current) matrix, counted here on the training prompts: those before --test-from whose routing does not
reappear after it; transfer chains the matrix for l+2); `random` (a control); `oracle` (the true experts of the
next layers: the best this cap can do). Frequency, transfer and random name top-k experts per layer.

Time per decode token (Qwen3-VL bytes: the replay's demand and speculative fetches per streamed access, times
top-8 x (48 - pinned) x the expert record, the share transfer of orin_projection --trace):
- DRAM time = (dense + 3 x touched + 2 x (demand + speculative)) / (50% of the DRAM peak) (every read is
  a buffered pread: two copies);
- prefetch: t = max((demand + speculative) / NVMe, DRAM time + demand / NVMe): the link carries every byte;
  compute waits for the demand bytes, and speculative bytes move while earlier layers compute. This is the
  optimistic end: a demand read queued behind a speculative one waits (the engine cannot preempt a read in
  flight), and SSD DMA and compute share the memory controller (platform-facts.md §5.3);
- serial: t = (demand + speculative) / NVMe + DRAM time: no overlap at all, the pessimistic end.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

EXPIRED, SPECULATIVE, REQUIRED = 0, 1, 2
PREDICTORS = ("none", "previous-token", "frequency", "transfer", "random", "oracle")
Requests = list[tuple[int, int, float]]  # (layer index on the trace's axis, expert, score)


@dataclass(frozen=True)
class PrefetchResult:
    accesses: int  # streamed-layer routed experts in the counted tokens
    demand: int  # of them, demand misses
    speculative: int  # speculative fetches issued in the counted tokens
    prefetch_hits: int  # routed experts found resident because a prediction fetched them (not used before)
    dropped: int  # predictions queued but given no slot (nothing cheaper to evict)
    tokens: int

    @property
    def demand_rate(self) -> float:
        return self.demand / self.accesses if self.accesses else 0.0

    @property
    def speculative_rate(self) -> float:
        return self.speculative / self.accesses if self.accesses else 0.0

    @property
    def wasted(self) -> float:
        """Share of the speculative fetches no route used before eviction (or the end)."""
        return 1 - self.prefetch_hits / self.speculative if self.speculative else 0.0


# ---------------------------------------------------------------------------------------------------- predictors


def layer_frequency(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 [L, E]: each expert's share of a layer's routing (baselines.layer_frequency on one-token samples)."""
    tokens, layers, k = ids.shape
    freq = np.stack([np.bincount(ids[:, li].ravel(), minlength=num_experts) for li in range(layers)])
    return (freq / max(tokens * k, 1)).astype(np.float32)


def transfer_matrix(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """float32 [L, E, E]: P(f at l+1 | e at l), as baselines.transfer_matrix counts it (each token adds the outer
    product of its shares at l and l+1; rows normalised). The last layer's rows are zero."""
    tokens, layers, k = ids.shape
    out = np.zeros((layers, num_experts, num_experts), dtype=np.float32)
    for li in range(layers - 1):
        now = np.repeat(ids[:, li].astype(np.int64), k, axis=1)  # [T, k*k]: every pair (e, f) of the token
        nxt = np.tile(ids[:, li + 1].astype(np.int64), (1, k))
        counts = np.bincount((now * num_experts + nxt).ravel(), minlength=num_experts**2).astype(np.float64)
        counts = counts.reshape(num_experts, num_experts)
        totals = counts.sum(axis=1, keepdims=True)
        out[li] = counts / np.where(totals > 0, totals, 1.0)
    return out


def make_predictor(name: str, ids: np.ndarray, num_experts: int, depth: int, train: np.ndarray | None = None,
                   seed: int = 0) -> Callable[[int, int], Requests] | None:  # fmt: skip
    """requests(t, li) for the step (token t, layer index li) of `ids` [T, L, k]; None for no prefetch.
    `train` [N, L, k]: the ids frequency and transfer are counted on."""
    tokens, layers, k = ids.shape
    if name == "none" or depth == 0:
        return None
    if name == "previous-token":

        def previous(t: int, li: int) -> Requests:
            if t == 0:
                return []
            return [(lj, int(e), 1.0 / (lj - li)) for lj in range(li + 1, min(li + 1 + depth, layers))
                    for e in ids[t - 1, lj]]  # fmt: skip

        return previous
    if name == "oracle":

        def oracle(t: int, li: int) -> Requests:
            return [(lj, int(e), 1.0 / (lj - li)) for lj in range(li + 1, min(li + 1 + depth, layers))
                    for e in ids[t, lj]]  # fmt: skip

        return oracle
    if name == "random":
        rng = np.random.default_rng(seed)

        def random(t: int, li: int) -> Requests:
            out: Requests = []
            for lj in range(li + 1, min(li + 1 + depth, layers)):
                out += [(lj, int(e), float(rng.random())) for e in rng.choice(num_experts, k, replace=False)]
            return out

        return random
    if train is None:
        raise ValueError(f"predictor {name!r} needs training ids")
    if name == "frequency":
        freq = layer_frequency(train, num_experts)
        best = [[(int(e), float(freq[lj, e])) for e in np.argsort(-freq[lj], kind="stable")[:k]]
                for lj in range(layers)]  # fmt: skip

        def frequency(t: int, li: int) -> Requests:
            return [(lj, e, s) for lj in range(li + 1, min(li + 1 + depth, layers)) for e, s in best[lj]]

        return frequency
    if name == "transfer":
        matrix = transfer_matrix(train, num_experts)

        def transfer(t: int, li: int) -> Requests:
            scores = matrix[li][ids[t, li]].sum(axis=0) / k  # the current layer's shares @ P(next | current)
            out: Requests = []
            for lj in range(li + 1, min(li + 1 + depth, layers)):
                top = np.argpartition(-scores, k - 1)[:k]
                out += [(lj, int(e), float(scores[e])) for e in top]
                scores = scores @ matrix[lj]  # chained for the layer after
            return out

        return transfer
    raise ValueError(f"unknown predictor {name!r}; use one of {PREDICTORS}")


# ------------------------------------------------------------------------------------------------------- replay


def replay(ids: np.ndarray, num_experts: int, pinned_layers: int, capacity: int, cap: int,
           predictor: Callable[[int, int], Requests] | None, count_from: int = 0) -> PrefetchResult:  # fmt: skip
    """Replay `ids` [T, L, k] token by token with `capacity` slots for the unpinned layers, the engine's
    popularity eviction and up to `cap` speculative fetches queued per predictor call; count from token
    `count_from` (the tokens before it warm the cache)."""
    from vismmoe_edge.experts.pipeline import EXPIRED_BASE, POPULARITY_DECAY, POPULARITY_SCALE  # pulls torch

    tokens, layers, k = ids.shape
    kind: dict[int, int] = {}  # resident code -> state
    prio: dict[int, float] = {}
    heaps: tuple[list, list] = ([], [])  # (priority, code) per evictable state; stale items skipped on pop
    score: dict[int, float] = {}
    unused: set[int] = set()  # fetched on a prediction, not routed since
    by_layer: dict[int, set[int]] = {}  # predictions per layer index, until that layer routes
    raised: dict[int, float] = {}  # resident Expired code a prediction raised -> its priority before
    clock = accesses = demand = speculative = hits = dropped = 0

    def put(c: int, state: int, p: float) -> None:
        kind[c], prio[c] = state, p
        heapq.heappush(heaps[state], (p, c))

    def victim(below: float | None) -> int | None:
        for state in (EXPIRED, SPECULATIVE):
            heap = heaps[state]
            while heap:
                p, c = heap[0]
                if kind.get(c) != state or prio[c] != p:
                    heapq.heappop(heap)
                    continue
                if below is not None and p >= below:
                    return None  # a speculative fetch takes only a slot worth less than itself
                heapq.heappop(heap)
                del kind[c], prio[c]
                unused.discard(c)
                raised.pop(c, None)
                return c
        return None

    for t in range(tokens):
        counted = t >= count_from
        rows = ids[t].tolist()
        for li in range(layers):
            routed = sorted(set(rows[li]))
            codes = [li * num_experts + e for e in routed] if li >= pinned_layers else []
            if li >= pinned_layers:
                for c in by_layer.pop(li, ()):  # predictions this layer did not route go first
                    before = raised.pop(c, None)
                    if c % num_experts in routed:
                        continue
                    if before is not None and kind.get(c) == EXPIRED:
                        put(c, EXPIRED, before)  # a raised resident expert goes back where it was
                    elif kind.get(c) == SPECULATIVE:
                        put(c, EXPIRED, EXPIRED_BASE - 1)
                for c in codes:
                    score[c] = score.get(c, 0.0) * POPULARITY_DECAY + 1.0
                    if c in kind:
                        if c in unused:
                            unused.discard(c)
                            hits += counted
                    else:
                        demand += counted
                        if len(kind) >= capacity and victim(None) is None:
                            raise ValueError(f"capacity {capacity} cannot hold one step's experts")
                    kind[c], prio[c] = REQUIRED, float("inf")
                accesses += counted * len(codes)
            if predictor is not None:
                queued = 0
                for lj, e, s in sorted(predictor(t, li), key=lambda r: -r[2]):
                    if lj <= li or lj < pinned_layers:
                        continue
                    c = lj * num_experts + e
                    state = kind.get(c)
                    if state is not None:
                        if state != REQUIRED and s > prio[c]:
                            if state == EXPIRED and c not in raised:
                                raised[c] = prio[c]
                                by_layer.setdefault(lj, set()).add(c)
                            put(c, state, s)  # named again: protected from eviction until layer lj runs
                        continue
                    if queued >= cap:
                        break
                    queued += 1
                    if len(kind) >= capacity and victim(s) is None:
                        dropped += counted
                        continue
                    put(c, SPECULATIVE, s)
                    unused.add(c)
                    by_layer.setdefault(lj, set()).add(c)
                    speculative += counted
            for c in codes:  # the step ends: its experts may go, least popular then oldest first
                clock += 1
                put(c, EXPIRED, EXPIRED_BASE + score[c] * POPULARITY_SCALE + clock)
    return PrefetchResult(accesses, demand, speculative, hits, dropped, max(tokens - count_from, 0))


# ------------------------------------------------------------------------------------------------- board table


def split_train(trace, test_from: int) -> tuple[np.ndarray, int]:
    """(training ids, first counted token): prompts ending by `test_from` whose routing does not reappear in a
    prompt starting at or after it (the trace's duplicate prompts would leak); counting starts at the first
    prompt that starts at or after `test_from`."""
    bounds = list(trace.prompts())
    first = next((a for a, _ in bounds if a >= test_from), trace.num_tokens)
    ids = trace.expert_ids
    held_out = {ids[a:b].tobytes() for a, b in bounds if a >= first}
    train = [ids[a:b] for a, b in bounds if b <= first and ids[a:b].tobytes() not in held_out]
    shape = (0, trace.num_layers, trace.top_k)
    return (np.concatenate(train) if train else np.zeros(shape, ids.dtype)), first


def time_per_token(row: dict, demand: float, spec: float, dram: float, nvme: float, efficiency: float = 0.5) -> dict:
    """Tokens per second for demand and speculative bytes per token (module docstring's rules): orin_projection's
    rule with every byte read, except that compute stalls only on the demand bytes when speculation overlaps."""
    from analysis.orin_projection import project_miss

    p = project_miss(row, demand + spec, dram, nvme, efficiency)
    overlapped = max(p["t_nvme"], p["t_dram"] + demand / nvme)
    return {"t_dram": p["t_dram"], "prefetch": 1 / overlapped, "serial": p["serial"]}


def prefetch_table(rows: list[dict], trace, predictors: list[str], depth: int = 2, test_from: int = 160_000,
                   warmup: int = 40_000, seed: int = 0) -> list[str]:  # fmt: skip
    """Markdown rows: each board plan x predictor, replayed on the trace's tokens from `test_from` after
    `warmup` tokens of the same replay."""
    from analysis.orin_projection import (
        MEASURED_BOARDS,
        NVME_BY_PROFILE,
        cache_share,
        completed,
        project_miss,
        trace_miss_bytes,
    )

    train, first = split_train(trace, test_from)
    start = max(0, first - warmup)
    ids = trace.expert_ids[start:]
    lines = [f"trace: {trace.source}: counted tokens {first:,}..{trace.num_tokens:,} ({trace.num_tokens - first:,}), "
             f"replay from token {start:,}; frequency/transfer counted on {len(train):,} earlier tokens; "
             f"prefetch depth {depth}", "",
             "| board (plan) | predictor | demand misses / token (Qwen3-VL experts) | speculative GB / token | "
             "wasted share | dropped / token | tok/s: overlapped speculation, all serial | no prefetch, this "
             "replay's misses: tok/s serial, overlapped |", "|---|---|---:|---:|---:|---:|---|---|"]  # fmt: skip
    cache: dict[tuple, PrefetchResult] = {}
    for row in completed(rows):
        pinned, share = int(row["plan"]["pinned_layers"]), cache_share(row)
        streamed = trace.num_layers - pinned
        capacity = max(trace.top_k, round(share * streamed * trace.num_experts))
        cap = min(depth * trace.top_k, capacity // 4)  # runtime.py's speculative cap, in experts
        per_access = trace_miss_bytes(row, 0.0)  # Qwen3-VL bytes per token at a miss rate of 1
        link = NVME_BY_PROFILE[row["profile"]]
        for name in ["none", *[p for p in predictors if p != "none"]]:
            key = (pinned, capacity, name)
            if key not in cache:
                fn = make_predictor(name, ids, trace.num_experts, depth, train, seed)
                cache[key] = replay(ids, trace.num_experts, pinned, capacity, cap, fn, count_from=first - start)
            r = cache[key]
            demand, spec = r.demand_rate * per_access, r.speculative_rate * per_access
            none = cache[(pinned, capacity, "none")].demand_rate * per_access
            for board, dram in MEASURED_BOARDS[row["profile"]]:
                t = time_per_token(row, demand, spec, dram, link)
                base = project_miss(row, none, dram, link)
                qwen = 8 * (48 - pinned)
                lines.append(f"| {board} | {name} | {r.demand_rate * qwen:.1f} | {spec / 1e9:.3f} | "
                             f"{r.wasted:.0%} | {r.dropped / max(r.tokens, 1) * qwen / (streamed * trace.top_k):.1f}"
                             f" | {link / 1e9:.1f} GB/s: {t['prefetch']:.2f}, {t['serial']:.2f} | "
                             f"{base['serial']:.2f}, {base['overlapped']:.2f} |")  # fmt: skip
    return lines
