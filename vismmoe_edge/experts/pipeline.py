"""The expert pipeline: a slot pool, a priority queue of fetches on an I/O thread, and entry states.

Compute (the engine's thread) and I/O (one worker thread) share one lock:
- a layer's router output makes its experts Required; missing ones are queued as demand fetches, which
  always go before speculative ones, and compute takes resident experts first, stalling only on the
  one it needs next (mixtral-offloading's unordered compute, ProMoE's demand-first);
- an expert whose layer has run for this token becomes Expired: the first to go when a slot is needed;
- predicted experts are Speculative until their layer routes them; speculative bytes in flight are
  capped and stale requests dropped (peers: speculation spends the binding bandwidth).

Where a slot's bytes live is the tier's business (host RAM, the page cache, GPU memory; experts/tier.py).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

import torch

from vismmoe_edge.experts.pipeline_stats import LayerStats, PipelineStats
from vismmoe_edge.experts.store import ExpertWeights
from vismmoe_edge.experts.tier import ExpertKey, Tier

DEMAND = 0  # queue classes: lower goes first
SPECULATIVE = 1
REQUIRED_PRIORITY = float("inf")
EXPIRED_BASE = -1e12  # Expired priorities are EXPIRED_BASE + use time: oldest first, below any prediction score
POLICIES = ("lru", "popularity")
POPULARITY_DECAY = 0.99  # keeps scores bounded (< 100) so Expired priorities stay below prediction scores
POPULARITY_SCALE = 1e9  # popularity dominates; use time (a counter) breaks ties


class State(Enum):
    LOADING = "loading"
    REQUIRED = "required"  # routed for the layer being computed and not computed yet: never evicted
    SPECULATIVE = "speculative"  # prefetched or queued on a prediction, not confirmed yet
    EXPIRED = "expired"  # its layer has run for this token


@dataclass
class Entry:
    key: ExpertKey
    state: State
    priority: float  # higher = more valuable; orders eviction within a state
    slot: int | None = None
    weights: ExpertWeights | None = None
    loaded: threading.Event = field(default_factory=threading.Event)
    speculative: bool = False  # fetched on a prediction; cleared when a layer routes it
    raised_from: float | None = None  # an Expired entry's priority before a prediction raised it
    used: bool = False


class ExpertPipeline:
    """Serves expert weights to compute from `capacity` slots of a tier, plus an always-resident pinned region."""

    def __init__(self, tier: Tier, *, capacity: int, pinned: dict[ExpertKey, ExpertWeights] | None = None,
                 speculative_cap_bytes: int = 0, io_workers: int = 1, policy: str = "lru") -> None:  # fmt: skip
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        if capacity < 1:
            raise ValueError("the pipeline needs at least one slot")
        self.tier = tier
        self.capacity = capacity
        self.policy = policy
        self._popularity: dict[ExpertKey, float] = {}
        self.pinned = pinned or {}
        self.speculative_cap_bytes = speculative_cap_bytes
        self.stats = PipelineStats(pinned_bytes=sum(w.nbytes for w in self.pinned.values()))
        self.layer_log: list[LayerStats] = []
        self._lock = threading.Condition()
        self._entries: dict[ExpertKey, Entry] = {}
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._queue: list[tuple[int, float, int, ExpertKey]] = []
        self._queued: dict[ExpertKey, int] = {}  # key -> queue class it is queued under
        # evictable entries by state, lowest priority first; stale heap items are skipped on pop
        self._evictable: dict[State, list[tuple[float, int, ExpertKey]]] = {State.EXPIRED: [], State.SPECULATIVE: []}
        self._speculative_by_layer: dict[int, set[ExpertKey]] = {}
        self._loaded_count = 0
        self._loading = 0
        self._slot_waiters = False  # an I/O thread holds a demand request but no slot is free
        self._seq = itertools.count()
        self._clock = itertools.count()
        self._speculative_in_flight = 0
        self._error: BaseException | None = None
        self._misses: set[int] = set()  # experts of the current layer that were demand misses
        self._closed = False
        self.residency_version = 0  # bumped whenever an expert enters or leaves a slot (experts/table.py syncs on it)
        self.pending_hits: list[tuple[LayerStats, torch.Tensor]] = []  # pinned layers' hits, counted on the device
        self._update_resident()
        self._workers = [
            threading.Thread(target=self._io_loop, name=f"vismmoe-io-{i}", daemon=True) for i in range(io_workers)
        ]
        for worker in self._workers:
            worker.start()

    # ---- compute side -------------------------------------------------------------------------------
    def begin_layer(self, layer: int, experts: Iterable[int], shares: Iterable[float] | None = None) -> list[int]:
        """Mark a layer's routed experts Required, queue the missing ones; return the order to compute them in.

        `shares`: the fraction of this step's tokens routed to each expert (the "popularity" policy's signal:
        a prompt's routing says which experts its reply will keep using).
        """
        self.layer_log.append(LayerStats(layer))
        experts = list(experts)
        if shares is not None and self.policy == "popularity":
            for expert, share in zip(experts, shares, strict=True):
                key = (layer, expert)
                self._popularity[key] = self._popularity.get(key, 0.0) * POPULARITY_DECAY + share
        ready: list[int] = []
        waiting: list[int] = []
        self._misses = set()
        with self._lock:
            self._expire_unrouted_predictions(layer, set(experts))
            for expert in experts:
                key = (layer, expert)
                if key in self.pinned:
                    ready.append(expert)
                    continue
                entry = self._entries.get(key)
                if entry is None:  # a demand miss: neither resident nor on its way
                    entry = self._entries[key] = Entry(key, State.REQUIRED, priority=REQUIRED_PRIORITY)
                    self._misses.add(expert)
                    if self._fetch_inline(entry):
                        ready.append(expert)
                    else:
                        self._enqueue(key, DEMAND, 0.0)
                        waiting.append(expert)
                    continue
                entry.priority = REQUIRED_PRIORITY
                if entry.state is not State.LOADING:
                    entry.state = State.REQUIRED
                if self._queued.get(key) == SPECULATIVE:  # a queued prediction came true: it is demand now
                    self._speculative_in_flight -= self.tier.slot_bytes
                    entry.speculative = False
                    self._enqueue(key, DEMAND, 0.0)
                    self._misses.add(expert)
                (ready if entry.loaded.is_set() else waiting).append(expert)
            if waiting:
                self._lock.notify_all()
        return ready + waiting

    def begin_pinned_layer(self, layer: int, experts: torch.Tensor, num_experts: int) -> None:
        """A layer whose experts are all pinned, routed to `experts` [T, k] (on the device): its hits, one per
        distinct expert as `acquire` counts them, are counted on the device and read by `count_pinned_hits`, so
        the layer needs no host synchronisation (OffloadedExperts.pinned_forward, which routes a suffix graph's
        padding rows as its first row before: they count no hit of their own)."""
        seen = torch.zeros(num_experts, dtype=torch.bool, device=experts.device)
        self.log_pinned_layer(layer, seen.index_fill_(0, experts.reshape(-1), True).sum())

    def log_pinned_layer(self, layer: int, hits: torch.Tensor) -> None:
        """A pinned layer's entry in the layer log, its hits a device count that `count_pinned_hits` reads."""
        self.layer_log.append(LayerStats(layer))
        self.pending_hits.append((self.layer_log[-1], hits))

    def unlog_pinned_layers(self, since: int) -> list[tuple[int, torch.Tensor]]:
        """Take back the pinned layers logged after the first `since` of `pending_hits`, as (layer, hits): a
        captured run logs once, each replay of it again (suffix_graph.py)."""
        taken, self.pending_hits = self.pending_hits[since:], self.pending_hits[:since]
        del self.layer_log[len(self.layer_log) - len(taken) :]
        return [(stats.layer, hits) for stats, hits in taken]

    def count_pinned_hits(self) -> None:
        """Add the pinned layers' hits counted on the device since the last call: one synchronisation for all."""
        if not self.pending_hits:
            return
        counts = torch.stack([count for _, count in self.pending_hits]).tolist()
        for (stats, _), hits in zip(self.pending_hits, counts, strict=True):
            stats.hits += hits
            self.stats.hits += hits
        self.pending_hits = []

    def acquire(self, layer: int, expert: int) -> ExpertWeights:
        """The weights of a Required expert; blocks only if it has not arrived yet."""
        key = (layer, expert)
        stats = self.layer_log[-1]
        if key in self.pinned:
            stats.hits += 1
            self.stats.hits += 1
            return self.pinned[key]
        entry = self._entries[key]  # a dict read is atomic; the entry cannot leave while Required
        if not entry.loaded.is_set():
            start = time.perf_counter()
            while not entry.loaded.wait(0.5):
                self._raise_if_failed()
            stall = time.perf_counter() - start
            stats.stall_s += stall
            self.stats.stall_s += stall
        self._raise_if_failed()
        if expert in self._misses:
            stats.misses += 1
            self.stats.misses += 1
        else:
            stats.hits += 1
            self.stats.hits += 1
            if entry.speculative and not entry.used:
                stats.prefetch_hits += 1
                self.stats.prefetch_hits += 1
        entry.used = True
        assert entry.slot is not None and entry.weights is not None
        self.tier.ready(key, entry.slot)
        return entry.weights

    def arrived(self, layer: int, experts: list[int]) -> list[int]:
        """Those of a layer's Required streamed `experts` that have arrived, waiting (a stall) until one has."""
        start = time.perf_counter()
        with self._lock:  # a fetch sets its event and notifies under this lock: no arrival is missed
            while not (now := [e for e in experts if self.is_streamed_and_loaded(layer, e)]):
                self._raise_if_failed()
                self._lock.wait(0.5)
        stall = time.perf_counter() - start
        self.layer_log[-1].stall_s += stall
        self.stats.stall_s += stall
        return now

    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot an acquired expert occupies: a cache slot, or the pinned prefix's slot where the tier keeps the
        prefix in the same pool (None otherwise)."""
        key = (layer, expert)
        if key in self.pinned:
            return self.tier.pinned_slot.get(key)
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    def finish(self, layer: int, expert: int) -> None:
        """The expert's layer has used it for this token: it may now be evicted (least recently used first)."""
        key = (layer, expert)
        if key in self.pinned:
            return
        with self._lock:
            entry = self._entries[key]
            assert entry.slot is not None
            self.tier.done(key, entry.slot)
            # lru: oldest use first; popularity: least used (decayed share of tokens) first, then oldest
            score = self._popularity.get(key, 0.0) * POPULARITY_SCALE if self.policy == "popularity" else 0.0
            self._set_evictable(entry, State.EXPIRED, EXPIRED_BASE + score + next(self._clock))
            if self._slot_waiters:
                self._lock.notify_all()  # a demand fetch is waiting for a slot to free up

    def prefetch(self, requests: Iterable[tuple[ExpertKey, float]], *, current_layer: int) -> None:
        """Replace the speculative queue with `requests` (key, score), highest score first.

        Stale requests (for layers at or before `current_layer`) and superseded predictions are dropped;
        resident entries named again get their priority raised, which protects them from eviction until their
        layer runs: if it does not route them, they go back to their Expired priority
        (`_expire_unrouted_predictions`), else a prediction would protect them for good.
        """
        queued = False
        with self._lock:
            for key, cls in list(self._queued.items()):
                if cls == SPECULATIVE:
                    self._drop_queued(key)
            for key, score in sorted(requests, key=lambda r: -r[1]):
                if key[0] <= current_layer or key in self.pinned:
                    continue
                entry = self._entries.get(key)
                if entry is not None:
                    if entry.state in (State.EXPIRED, State.SPECULATIVE) and entry.loaded.is_set():
                        if entry.state is State.EXPIRED and entry.raised_from is None and score > entry.priority:
                            entry.raised_from = entry.priority
                            self._speculative_by_layer.setdefault(key[0], set()).add(key)
                        self._set_evictable(entry, entry.state, max(entry.priority, score))
                    continue
                if self._speculative_in_flight + self.tier.slot_bytes > self.speculative_cap_bytes:
                    break
                self._entries[key] = Entry(key, State.SPECULATIVE, priority=score, speculative=True)
                self._speculative_by_layer.setdefault(key[0], set()).add(key)
                self._speculative_in_flight += self.tier.slot_bytes
                self._enqueue(key, SPECULATIVE, -score)
                queued = True
            if queued:
                self._lock.notify_all()

    def record_compute(self, seconds: float) -> None:
        self.layer_log[-1].compute_s += seconds
        self.layer_log[-1].resident_bytes = self.stats.resident_bytes

    def can_hold(self, layer: int, experts: list[int]) -> bool:
        """Whether these experts of one layer can all be resident at once (the pinned ones need no cache slot)."""
        return sum((layer, e) not in self.pinned for e in experts) <= self.capacity

    def is_streamed_and_loaded(self, layer: int, expert: int) -> bool:
        """True for a slot-held expert that has arrived (lock-free: a dict read and an Event check)."""
        entry = self._entries.get((layer, expert))
        return entry is not None and entry.loaded.is_set()

    def resident_slots(self) -> dict[ExpertKey, int]:
        """Every expert that can be read from the pool now (arrived, not evicted) -> its slot."""
        pinned_slot = self.tier.pinned_slot
        with self._lock:
            slots = {k: e.slot for k, e in self._entries.items() if e.loaded.is_set() and e.slot is not None}
        return slots | {k: pinned_slot[k] for k in self.pinned if k in pinned_slot}

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        """A token used these experts without acquiring them (the device-side decode, which runs only when every
        one was resident): count the hits, refresh their place in the eviction order as `finish` would, and their
        popularity."""
        with self._lock:
            for expert in experts:
                key = (layer, expert)
                self.stats.hits += 1
                entry = self._entries.get(key)
                if self.policy == "popularity":
                    self._popularity[key] = self._popularity.get(key, 0.0) * POPULARITY_DECAY + 1.0
                if entry is None or entry.state is not State.EXPIRED:
                    continue
                score = self._popularity.get(key, 0.0) * POPULARITY_SCALE if self.policy == "popularity" else 0.0
                self._set_evictable(entry, State.EXPIRED, EXPIRED_BASE + score + next(self._clock))

    def promote(self, layer: int, expert: int) -> int | None:
        """Bring an expert that device tokens read in place from the host tier into a slot, if a slot is free or
        holds an expert worth less (popularity, then age, as eviction ranks them); returns its slot, or None.

        Compute thread, between tokens. The fetch only queues a DMA from pinned memory (tiers that can fetch
        inline); the slot's event marks its end, and the device table adds the expert only once that event has
        completed (ExpertTable.sync), so no token reads a half-filled slot. The evicted expert stays readable
        from the host tier meanwhile, which is why no token needs to wait.
        """
        key = (layer, expert)
        if key in self.pinned or not self.tier.can_fetch_inline(key):
            return None
        with self._lock:
            if key in self._entries:
                return None
            score = self._popularity.get(key, 0.0) * POPULARITY_SCALE if self.policy == "popularity" else 0.0
            priority = EXPIRED_BASE + score + next(self._clock)
            taken = self._take_slot(for_demand=False, priority=priority)
            if taken is None:
                return None
            slot, victim = taken
            if victim is not None:
                self.tier.done(victim, slot)  # a token launched ahead may still read the victim: the fill waits
                self.tier.release(victim, slot)
            entry = self._entries[key] = Entry(key, State.EXPIRED, priority)
            start = time.perf_counter()
            entry.weights, entry.slot = self.tier.fetch(key, slot), slot
            self._loaded_count += 1
            self.stats.bytes_read += self.tier.read_bytes(key)
            self.stats.fetch_seconds += time.perf_counter() - start
            entry.loaded.set()  # for the per-layer path, which waits on the slot's event (tier.ready)
            self._set_evictable(entry, State.EXPIRED, priority)
            self._update_resident()
        return slot

    def resident_keys(self) -> set[ExpertKey]:
        with self._lock:
            return {k for k, e in self._entries.items() if e.loaded.is_set()} | set(self.pinned)

    def drain(self) -> None:
        """Wait until no fetch is queued or loading (benchmarks and tests)."""
        with self._lock:
            while (self._queued or self._loading) and not self._error:
                self._lock.wait(0.05)
        self._raise_if_failed()

    def clear(self) -> None:
        """Evict every streamed expert and forget popularity: a cold cache (benchmarks reuse one engine across
        trials this way; a pinned host tier below the cache stays filled, as it would in a running server)."""
        self.drain()
        with self._lock:
            for key, entry in list(self._entries.items()):
                if entry.loaded.is_set() and entry.slot is not None:
                    self.tier.release(key, entry.slot)
            self._entries.clear()
            self._free_slots = list(range(self.capacity - 1, -1, -1))
            self._evictable = {State.EXPIRED: [], State.SPECULATIVE: []}
            self._speculative_by_layer.clear()
            self._popularity.clear()
            self._loaded_count = 0
            self._speculative_in_flight = 0
            self._update_resident()

    def reset_stats(self) -> None:
        with self._lock:
            self.stats = PipelineStats(pinned_bytes=self.stats.pinned_bytes)
            self.layer_log = []
            self.pending_hits = []
            self._update_resident()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for worker in self._workers:
            worker.join(timeout=5)

    # ---- I/O side -----------------------------------------------------------------------------------
    def _io_loop(self) -> None:
        while True:
            with self._lock:
                job = self._next_job()
                if job is None:
                    return
                key, slot, cls, victim = job
            try:
                if victim is not None:
                    self.tier.release(victim, slot)
                start = time.perf_counter()
                weights = self.tier.fetch(key, slot)
                elapsed = time.perf_counter() - start
            except BaseException as e:  # surfaced on the compute thread, which is waiting for this expert
                with self._lock:
                    self._error = e
                    self._lock.notify_all()
                return
            with self._lock:
                entry = self._entries[key]
                entry.slot, entry.weights = slot, weights
                if entry.state is State.LOADING:
                    if entry.priority == REQUIRED_PRIORITY:
                        entry.state = State.REQUIRED
                    else:
                        self._set_evictable(entry, State.SPECULATIVE, entry.priority)
                self._loaded_count += 1
                self._loading -= 1
                nbytes = self.tier.read_bytes(key)
                if cls == SPECULATIVE:
                    self._speculative_in_flight -= self.tier.slot_bytes
                    self.stats.speculative_bytes += nbytes
                self.stats.bytes_read += nbytes
                if self.layer_log:
                    self.layer_log[-1].bytes_read += nbytes
                self.stats.fetch_seconds += elapsed
                entry.loaded.set()
                self._update_resident()
                self._lock.notify_all()

    def _next_job(self) -> tuple[ExpertKey, int, int, ExpertKey | None] | None:
        """Pop the most urgent request that can get a slot; wait while none can. Called with the lock held."""
        while True:
            if self._closed:
                return None
            while self._queue:
                cls, _, _, key = self._queue[0]
                if self._queued.get(key) != cls:
                    heapq.heappop(self._queue)  # superseded (re-queued under another class, or dropped)
                    continue
                taken = self._take_slot(for_demand=cls == DEMAND, priority=self._entries[key].priority)
                if taken is None:
                    if cls == SPECULATIVE:
                        self._drop_queued(key)  # nothing cheaper to evict: speculation yields
                        continue
                    break  # demand waits for compute to expire an entry
                heapq.heappop(self._queue)
                self._slot_waiters = False
                del self._queued[key]
                self._entries[key].state = State.LOADING
                self._loading += 1
                slot, victim = taken
                return key, slot, cls, victim
            self._slot_waiters = bool(self._queue)
            self._lock.wait()

    def _take_slot(self, *, for_demand: bool, priority: float) -> tuple[int, ExpertKey | None] | None:
        """A free slot, or the slot of an evicted entry and that entry's key (whose bytes the caller releases,
        outside the lock: on the page cache that is madvise/fadvise work)."""
        if self._free_slots:
            return self._free_slots.pop(), None
        victim = self._victim(for_demand=for_demand, priority=priority)
        if victim is None:
            return None
        entry = self._entries.pop(victim.key)
        self._loaded_count -= 1
        self._forget_speculative(entry.key)
        assert entry.slot is not None
        if entry.speculative and not entry.used:
            self.stats.wasted_speculative_bytes += self.tier.read_bytes(entry.key)
            if self.layer_log:
                self.layer_log[-1].wasted_bytes += self.tier.read_bytes(entry.key)
        self.stats.evictions += 1
        self._update_resident()
        return entry.slot, entry.key

    def _victim(self, *, for_demand: bool, priority: float) -> Entry | None:
        """Expired first, then Speculative; lowest priority first. Required and loading entries are never taken.

        A speculative fetch takes a slot only from an entry worth less than itself.
        """
        for state in (State.EXPIRED, State.SPECULATIVE):
            heap = self._evictable[state]
            while heap:
                prio, _, key = heap[0]
                entry = self._entries.get(key)
                if entry is None or entry.state is not state or entry.priority != prio or not entry.loaded.is_set():
                    heapq.heappop(heap)  # stale: the entry moved on since it was pushed
                    continue
                return entry if for_demand or prio < priority else None
        return None

    # ---- helpers (lock held) -----------------------------------------------------------------------
    def _fetch_inline(self, entry: Entry) -> bool:
        """A demand miss whose fetch only queues a DMA (the bytes are in pinned host memory) is fetched right
        here, on the compute thread: no hand-off to an I/O thread, no interpreter between the bytes and the bus."""
        if not self.tier.can_fetch_inline(entry.key):
            return False
        taken = self._take_slot(for_demand=True, priority=REQUIRED_PRIORITY)
        if taken is None:
            return False
        slot, victim = taken
        if victim is not None:
            self.tier.release(victim, slot)
        start = time.perf_counter()
        entry.weights = self.tier.fetch(entry.key, slot)
        entry.slot = slot
        self._loaded_count += 1
        nbytes = self.tier.read_bytes(entry.key)
        self.stats.bytes_read += nbytes
        self.layer_log[-1].bytes_read += nbytes
        self.stats.fetch_seconds += time.perf_counter() - start
        entry.loaded.set()
        self._update_resident()
        return True

    def _enqueue(self, key: ExpertKey, cls: int, order: float) -> None:
        self._queued[key] = cls
        heapq.heappush(self._queue, (cls, order, next(self._seq), key))

    def _drop_queued(self, key: ExpertKey) -> None:
        self._queued.pop(key, None)
        entry = self._entries.get(key)
        if entry is not None and entry.state is State.SPECULATIVE and not entry.loaded.is_set():
            del self._entries[key]
            self._forget_speculative(key)
            self._speculative_in_flight -= self.tier.slot_bytes

    def _set_evictable(self, entry: Entry, state: State, priority: float) -> None:
        entry.state, entry.priority = state, priority
        heapq.heappush(self._evictable[state], (priority, next(self._seq), entry.key))

    def _expire_unrouted_predictions(self, layer: int, routed: set[int]) -> None:
        """Predictions for `layer` that it did not route are worthless for this token: evict them first, and
        put resident experts a prediction raised back where they were."""
        for key in list(self._speculative_by_layer.pop(layer, ())):
            entry = self._entries.get(key)
            if entry is None:
                continue
            raised_from, entry.raised_from = entry.raised_from, None
            if key[1] in routed:
                continue  # acquired now: `finish` gives it its new Expired priority
            if raised_from is not None and entry.state is State.EXPIRED:
                self._set_evictable(entry, State.EXPIRED, raised_from)
                continue
            if not entry.loaded.is_set():
                if self._queued.get(key) == SPECULATIVE:
                    self._drop_queued(key)  # still queued: stale, never read
                continue
            if entry.state is State.SPECULATIVE:
                self._set_evictable(entry, State.EXPIRED, EXPIRED_BASE - 1)

    def _forget_speculative(self, key: ExpertKey) -> None:
        keys = self._speculative_by_layer.get(key[0])
        if keys is not None:
            keys.discard(key)

    def _update_resident(self) -> None:
        self.residency_version += 1
        self.stats.resident_bytes = self.stats.pinned_bytes + self._loaded_count * self.tier.slot_bytes
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
