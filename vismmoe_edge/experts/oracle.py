"""The offline bound every cache policy is judged against: Belady's MIN on a routing trace.

Model: demand paging of unit-size items (all experts of a model have the same size). Every miss loads the expert
into the cache (no bypass), evicting one resident expert when the cache is full; this is what `ExpertCache` does.
Belady evicts the resident item whose next use is farthest in the future, which minimises misses for that model.

Keys are integers `layer_id * num_experts + expert`, with `layer_id` the model layer index (as `ExpertCache`
and `--pinned-layers` use); `split_keys` turns them back into (layer, expert).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vismmoe_edge.trace import RoutingTrace

_CHUNK = 1 << 20  # accesses converted to Python lists at a time: bounds memory on 30M-access traces


@dataclass(frozen=True)
class OracleResult:
    misses: int
    hits: int
    evictions: int

    @property
    def accesses(self) -> int:
        return self.misses + self.hits

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else 0.0


# --------------------------------------------------------------------------------------------------- access order


def expert_access_sequence(trace: RoutingTrace, *, decode_order: bool = True) -> np.ndarray:
    """The int64 keys (see module docstring) in the order an engine touches them.

    decode_order=True: token by token; within a token, layers in order; within a layer, the token's experts by
    ascending id with duplicates collapsed. decode_order=False: each prompt's prefill rows are batched, so each
    layer touches the union of the prompt's experts once (ascending), layer after layer; decode rows (if the
    trace marks any) stay token by token after their prompt's prefill.
    """
    return _access_sequence(trace, decode_order=decode_order)[0]


def split_keys(keys: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(layer_ids, experts) of keys made by `expert_access_sequence`."""
    return np.divmod(np.asarray(keys), num_experts)


def _token_keys(trace: RoutingTrace, rows: slice | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keys of the given rows token-major, and the row of each key."""
    ids = np.sort(trace.expert_ids[rows].astype(np.int64), axis=2)
    layer = np.asarray(trace.layer_ids, dtype=np.int64)[None, :, None]
    keys = layer * trace.num_experts + ids
    keep = np.ones(ids.shape, dtype=bool)
    keep[:, :, 1:] = ids[:, :, 1:] != ids[:, :, :-1]  # a set may repeat an id: the engine computes it once
    row_ids = np.arange(trace.num_tokens)[rows]
    token = np.broadcast_to(row_ids[:, None, None], ids.shape)
    return keys[keep], token[keep]


def _access_sequence(trace: RoutingTrace, *, decode_order: bool) -> tuple[np.ndarray, np.ndarray]:
    """(keys, row of the token that caused each access). Batched prefill accesses go to the prompt's first row."""
    if decode_order:
        return _token_keys(trace, slice(None))
    decode = trace.decode if trace.decode is not None else np.zeros(trace.num_tokens, dtype=bool)
    keys_parts, token_parts = [], []
    for start, end in trace.prompts():
        prefill = np.flatnonzero(~decode[start:end]) + start
        if len(prefill):
            ids = trace.expert_ids[prefill].astype(np.int64)  # [n, L, k]
            for li, layer in enumerate(trace.layer_ids):
                union = np.unique(ids[:, li, :])
                keys_parts.append(layer * trace.num_experts + union)
                token_parts.append(np.full(len(union), prefill[0], dtype=np.int64))
        gen = np.flatnonzero(decode[start:end]) + start
        if len(gen):
            keys, tokens = _token_keys(trace, gen)
            keys_parts.append(keys)
            token_parts.append(tokens)
    if not keys_parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate(keys_parts), np.concatenate(token_parts)


# ------------------------------------------------------------------------------------------------------ policies


def _as_codes(accesses: Sequence[Hashable], pinned: Iterable[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """Integer codes of the accesses (keys themselves when already integers) and a mask of pinned accesses."""
    if isinstance(accesses, np.ndarray) and np.issubdtype(accesses.dtype, np.integer):
        codes = accesses.astype(np.int64, copy=False)
        pinned_ints = [p for p in pinned if isinstance(p, (int, np.integer))]
        return codes, np.isin(codes, np.array(pinned_ints, dtype=np.int64))
    index: dict[Hashable, int] = {}
    codes = np.fromiter((index.setdefault(a, len(index)) for a in accesses), dtype=np.int64, count=len(accesses))
    pinned_codes = np.array([index[p] for p in pinned if p in index], dtype=np.int64)
    return codes, np.isin(codes, pinned_codes)


def next_use(codes: np.ndarray) -> np.ndarray:
    """For each position, the next position holding the same code, or len(codes) if none (O(n log n))."""
    n = len(codes)
    order = np.argsort(codes, kind="stable")  # positions grouped by code, ascending within a code
    nxt = np.full(n, n, dtype=np.int64)
    same = codes[order[1:]] == codes[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def _belady_streamed(codes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """(miss mask, evictions) of MIN over unpinned accesses: a max-heap on next use with lazy deletion."""
    n = len(codes)
    missed = bytearray(n)
    if capacity <= 0:
        return np.ones(n, dtype=bool), 0
    nxt = next_use(codes)
    resident: dict[int, int] = {}  # code -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next use, code); an entry is stale unless it matches `resident`
    evictions = 0
    push, pop = heapq.heappush, heapq.heappop
    compact_at = 4 * capacity + 1024
    for base in range(0, n, _CHUNK):
        for i, (c, nu) in enumerate(
            zip(codes[base : base + _CHUNK].tolist(), nxt[base : base + _CHUNK].tolist(), strict=True), base
        ):
            if c not in resident:
                missed[i] = 1
                if len(resident) >= capacity:
                    while True:
                        neg, victim = pop(heap)
                        if resident.get(victim) == -neg:  # next-use positions are unique, so this is current
                            break
                    del resident[victim]
                    evictions += 1
            resident[c] = nu
            push(heap, (-nu, c))
            if len(heap) > compact_at:  # drop stale entries so the heap stays O(capacity)
                heap = [(-v, k) for k, v in resident.items()]
                heapq.heapify(heap)
    return np.frombuffer(bytes(missed), dtype=np.uint8).astype(bool), evictions


def _lru_streamed(codes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    n = len(codes)
    missed = bytearray(n)
    if capacity <= 0:
        return np.ones(n, dtype=bool), 0
    order: OrderedDict[int, None] = OrderedDict()
    evictions = 0
    for base in range(0, n, _CHUNK):
        for i, c in enumerate(codes[base : base + _CHUNK].tolist(), base):
            if c in order:
                order.move_to_end(c)
                continue
            missed[i] = 1
            if len(order) >= capacity:
                order.popitem(last=False)
                evictions += 1
            order[c] = None
    return np.frombuffer(bytes(missed), dtype=np.uint8).astype(bool), evictions


def _replay(
    policy: Any, accesses: Sequence[Hashable], capacity: int, pinned: Iterable[Hashable]
) -> tuple[np.ndarray, int]:
    """Full-length miss mask: pinned accesses are hits and never reach the policy (they take no capacity)."""
    codes, is_pinned = _as_codes(accesses, pinned)
    missed = np.zeros(len(codes), dtype=bool)
    streamed = ~is_pinned
    missed[streamed], evictions = policy(codes[streamed], capacity)
    return missed, evictions


def _result(missed: np.ndarray, evictions: int) -> OracleResult:
    misses = int(missed.sum())
    return OracleResult(misses=misses, hits=len(missed) - misses, evictions=evictions)


def belady(accesses: Sequence[Hashable], capacity: int, pinned: Iterable[Hashable] = frozenset()) -> OracleResult:
    """Belady/MIN: the fewest misses any replacement policy can have on `accesses` with `capacity` unit slots.

    Items in `pinned` are always resident: they hit and take no capacity. Integer numpy arrays take a fast path.
    """
    return _result(*_replay(_belady_streamed, accesses, capacity, pinned))


def belady_after_warmup(warmup: Sequence[Hashable], accesses: Sequence[Hashable], capacity: int) -> int:
    """Belady's fewest misses on `accesses` when the cache has first served `warmup` (e.g. decode after the
    prompt's prefill): the misses of the whole sequence less those of the warm-up alone."""
    return belady([*warmup, *accesses], capacity).misses - belady(warmup, capacity).misses


def lru(accesses: Sequence[Hashable], capacity: int, pinned: Iterable[Hashable] = frozenset()) -> OracleResult:
    """Least-recently-used replacement, the reference online policy (same model as `belady`)."""
    return _result(*_replay(_lru_streamed, accesses, capacity, pinned))


def layer_steps(trace: RoutingTrace) -> tuple[np.ndarray, np.ndarray]:
    """Decode-order keys (as `expert_access_sequence`) and the (token, layer) step of each: one id per step."""
    keys, token = _token_keys(trace, slice(None))
    layer = keys // trace.num_experts
    change = (token[1:] != token[:-1]) | (layer[1:] != layer[:-1])
    return keys, np.concatenate([[0], np.cumsum(change)]).astype(np.int64)


def popularity(keys: np.ndarray, steps: np.ndarray, capacity: int, pinned: Iterable[int] = frozenset()) -> OracleResult:
    """The engine's default "popularity" eviction (experts/pipeline.py), replayed one token at a time.

    Each routed expert's score decays by POPULARITY_DECAY and gains its share of the step's tokens (1 for a
    single token) when it is routed; the score outlives eviction. A miss evicts the resident expert with the
    lowest EXPIRED_BASE + score x POPULARITY_SCALE + use clock, never one routed in the same step (Required).
    `steps` groups the accesses of one (token, layer), as `layer_steps` gives them.
    """
    from vismmoe_edge.experts.pipeline import EXPIRED_BASE, POPULARITY_DECAY, POPULARITY_SCALE  # here: it pulls torch

    codes, is_pinned = _as_codes(np.asarray(keys, dtype=np.int64), pinned)
    streamed = np.flatnonzero(~is_pinned)
    missed = np.zeros(len(codes), dtype=bool)  # pinned accesses are hits and never reach the cache
    score: dict[int, float] = {}
    prio: dict[int, float] = {}  # resident code -> eviction priority (nan while Required); others on the heap are stale
    heap: list[tuple[float, int]] = []
    clock = evictions = 0
    steps = np.asarray(steps, dtype=np.int64)
    routed: list[int] = []  # the current step's experts
    step = None

    def finish() -> None:  # the step ends: its experts become evictable at their new priority
        nonlocal clock
        for c in routed:
            clock += 1
            prio[c] = EXPIRED_BASE + score[c] * POPULARITY_SCALE + clock
            heapq.heappush(heap, (prio[c], c))
        routed.clear()

    for base in range(0, len(streamed), _CHUNK):
        where = streamed[base : base + _CHUNK]
        for i, c, s in zip(where.tolist(), codes[where].tolist(), steps[where].tolist(), strict=True):
            if s != step:
                finish()
                step = s
            routed.append(c)
            score[c] = score.get(c, 0.0) * POPULARITY_DECAY + 1.0
            if c not in prio:
                missed[i] = True
                if len(prio) >= capacity:
                    while True:  # lowest valid priority; nan never equals itself, so Required entries are skipped
                        if not heap:
                            raise ValueError(f"capacity {capacity} cannot hold one step's experts")
                        p, victim = heapq.heappop(heap)
                        if prio.get(victim) == p:
                            break
                    del prio[victim]
                    evictions += 1
            prio[c] = math.nan  # Required for this step: not evictable until it finishes
    finish()
    return _result(missed, evictions)


# --------------------------------------------------------------------------------------------------------- bound


def oracle_bound(
    trace: RoutingTrace,
    *,
    capacity_experts: int,
    expert_bytes: int,
    bandwidth_bytes_per_s: float,
    compute_seconds_per_token: float,
    pinned_layers: Sequence[int] = (),
) -> dict[str, Any]:
    """Minimal expert bytes moved and the best time per token for a token-by-token engine on `trace`.

    The cache holds `capacity_experts` streamed experts; `pinned_layers` (model layer ids) keep all their experts
    resident outside that capacity. Bytes moved = Belady misses x `expert_bytes`.

    Time assumes perfect overlap of I/O and compute within a token and none across tokens: token t costs
    max(compute_seconds_per_token, misses_t x expert_bytes / bandwidth), summed over tokens with the misses of
    Belady's schedule. (MIN minimises total misses, not this sum, so the sum is the MIN schedule's time.) The
    unconditional floor, allowing any prefetch across tokens, is `floor_seconds_total` = max(total compute,
    minimal bytes / bandwidth).
    """
    keys, token_of = _access_sequence(trace, decode_order=True)
    pinned = {layer * trace.num_experts + e for layer in pinned_layers for e in range(trace.num_experts)}
    missed, evictions = _replay(_belady_streamed, keys, capacity_experts, pinned)
    per_token_misses = np.bincount(token_of[missed], minlength=trace.num_tokens)
    per_token_io = per_token_misses * expert_bytes / bandwidth_bytes_per_s
    per_token_seconds = np.maximum(per_token_io, compute_seconds_per_token)
    tokens = max(trace.num_tokens, 1)
    misses = int(missed.sum())
    bytes_total = misses * expert_bytes
    compute_total = compute_seconds_per_token * trace.num_tokens
    seconds_total = float(per_token_seconds.sum())
    return {
        "tokens": trace.num_tokens,
        "accesses": len(keys),
        "capacity_experts": capacity_experts,
        "pinned_layers": list(pinned_layers),
        "misses": misses,
        "hits": len(keys) - misses,
        "evictions": evictions,
        "miss_rate": misses / len(keys) if len(keys) else 0.0,
        "bytes_total": bytes_total,
        "bytes_per_token": bytes_total / tokens,
        "misses_per_token": misses / tokens,
        "compute_seconds_total": compute_total,
        "io_seconds_total": bytes_total / bandwidth_bytes_per_s,
        "seconds_total": seconds_total,
        "seconds_per_token": seconds_total / tokens,
        "tokens_per_second": trace.num_tokens / seconds_total if seconds_total else float("inf"),
        "io_bound_token_fraction": float(np.mean(per_token_io > compute_seconds_per_token))
        if trace.num_tokens
        else 0.0,
        "floor_seconds_total": max(compute_total, bytes_total / bandwidth_bytes_per_s),
        "per_token_misses": per_token_misses,
        "per_token_seconds": per_token_seconds,
    }
