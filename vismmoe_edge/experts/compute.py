"""The routed-experts module that replaces transformers' fused experts: same forward, weights from the pipeline."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from vismmoe_edge.experts.arrival import RowForm, compute_as_they_arrive, row_form
from vismmoe_edge.experts.pipeline import ExpertKey, ExpertPipeline
from vismmoe_edge.experts.pool_compute import decode_experts, expert_mlp, grouped_mm_works, prefill_experts
from vismmoe_edge.experts.quant_pool import pool_forward
from vismmoe_edge.experts.recency import PROMPT_HALF_LIFE_TOKENS, prompt_shares
from vismmoe_edge.experts.store import ExpertWeights
from vismmoe_edge.quant.kernels import QuantizedExpert, expert_forward

# Computing experts as they arrive costs host work per batch (small tensors, a call a batch: ~0.8 ms a layer step
# on this project's 2-core VM, where the one batched call costs less): it pays only where the reads still to come
# take longer. 1 MiB is ~0.1 ms of memory copy and ~0.3-0.5 ms of NVMe read; a 30B-A3B expert is 9.4 MB in bf16,
# 2.5 MB in int4, the demo model's 55 KB (where it cost the CPU's host-tier decode 5-13%: docs/benchmarks.md).
ARRIVAL_MIN_BYTES = 1 << 20

RouteHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]  # layer, hidden, index, weights


class Predictor(Protocol):
    name: str

    def predict(self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor) -> list[tuple[ExpertKey, float]]:
        """After `layer` has routed: (key, score) of experts of later layers worth fetching now."""
        ...


class Router(Protocol):
    def route(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class ExpertRuntime:
    """What every OffloadedExperts module shares: the pipeline, the predictor, observers, a routing override."""

    pipeline: ExpertPipeline
    predictor: Predictor | None = None
    replay: Router | None = None  # trace replay: routed ids come from a trace, not from the model's router
    route_hooks: list[RouteHook] = field(default_factory=list)
    predict_seconds: float = 0.0  # predictor time on compute's critical path
    lock_report: object | None = None  # unified memory: what of the pinned prefix mlock could hold
    predictor_worker: Any = None  # a PredictorWorker: the predictor runs beside compute instead
    counted_rows: torch.Tensor | None = None  # [T] bool: rows that count hits (a captured suffix's padding does not)
    prompt_half_life: float = PROMPT_HALF_LIFE_TOKENS  # a prefill's popularity weighs its last tokens most (recency.py)


class OffloadedExperts(nn.Module):
    """forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], as transformers' experts.

    With a slot pool (the host, GPU and unified slot tiers) the layer's experts are one batched computation from
    their slots, or for one token with ARRIVAL_MIN_BYTES or more still being read, the resident ones at once and
    the missing ones as they land (experts/arrival.py); on the page-cache tiers resident experts are computed
    first, then the missing ones as they arrive.
    """

    def __init__(
        self, layer: int, runtime: ExpertRuntime, act_fn: Callable[[torch.Tensor], torch.Tensor], num_experts: int
    ):
        super().__init__()
        self.layer = layer
        self.runtime = runtime
        self.act_fn = act_fn
        self.num_experts = num_experts
        self._order: list[int] = []  # the experts acquired by prepare_pool_step, finished by finish_pool_step
        self._arriving: tuple[list[int], tuple[list[int], list[int]], RowForm] | None = None  # computed as they land
        self._pinned_run: int | None = -1  # pinned_run's answer once asked (-1: not yet)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        rt = self.runtime
        if rt.replay is not None:
            top_k_index, top_k_weights = rt.replay.route(self.layer, hidden_states.shape[0])
            top_k_index = top_k_index.to(hidden_states.device)
            top_k_weights = top_k_weights.to(hidden_states.device, hidden_states.dtype)
        first = self.pinned_run()
        if first is not None and hidden_states.shape[0] > 1 and rt.predictor is None and rt.predictor_worker is None:
            return self.pinned_forward(hidden_states, top_k_index, top_k_weights, first)
        index_cpu = top_k_index.cpu()  # one sync per layer: the routing decides what to fetch anyway
        order = self.route(hidden_states, top_k_index, top_k_weights, index_cpu)
        pipeline = rt.pipeline
        start = time.perf_counter()
        stalled_before = pipeline.layer_log[-1].stall_s
        pool = pipeline.tier.pool
        if pool is not None and pipeline.can_hold(self.layer, order):  # all of them can be resident at once
            arriving = self._arrival(order) if hidden_states.shape[0] == 1 else None
            if arriving is not None:  # some still being read: compute them as they land (experts/arrival.py)
                out = self._compute_as_they_arrive(hidden_states, index_cpu[0].tolist(), top_k_weights, *arriving)
            else:
                slot_of = self._acquire_slots(order)
                slots = slot_ids(index_cpu, slot_of).to(pool.device)
                out = self.pool_compute(hidden_states, slots, top_k_weights)
            self._finish(order)
        else:
            out = self._loop_compute(hidden_states, index_cpu, top_k_weights, order)
        stalled = pipeline.layer_log[-1].stall_s - stalled_before
        pipeline.record_compute(time.perf_counter() - start - stalled)
        return out

    def route(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, index_cpu: torch.Tensor
    ) -> list[int]:
        """Observers see the routing, the pipeline marks the experts Required and queues the missing ones, the
        predictor queues later layers' experts; returns the order to take the experts in."""
        rt, pipeline = self.runtime, self.runtime.pipeline
        for hook in rt.route_hooks:
            hook(self.layer, hidden, top_k_index, top_k_weights)
        experts, shares = prompt_shares(index_cpu, rt.prompt_half_life)
        order = pipeline.begin_layer(self.layer, experts.tolist(), shares.tolist())
        if rt.predictor_worker is not None:
            start = time.perf_counter()
            rt.predictor_worker.submit(self.layer, hidden, index_cpu)  # already on the host: no second sync
            rt.predict_seconds += time.perf_counter() - start
        elif rt.predictor is not None:
            start = time.perf_counter()
            pipeline.prefetch(rt.predictor.predict(self.layer, hidden, top_k_index), current_layer=self.layer)
            rt.predict_seconds += time.perf_counter() - start
        return order

    # ---- a pinned layer's prefill: no host work ----------------------------------------------------------------
    def pinned_run(self) -> int | None:
        """Where every expert of this layer is pinned in the slot pool at slot `first` + expert (the pinned prefix,
        or every layer where the GPU slots hold them all: experts/runtime.resident_layers), `first`; else None."""
        if self._pinned_run == -1:
            pipeline = self.runtime.pipeline
            slot = pipeline.tier.pinned_slot
            first = slot.get((self.layer, 0))
            in_order = first is not None and all(
                (self.layer, e) in pipeline.pinned and slot.get((self.layer, e)) == first + e
                for e in range(self.num_experts)
            )
            self._pinned_run = first if in_order and pipeline.tier.pool is not None else None
        return self._pinned_run

    def pinned_forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, first: int) -> torch.Tensor:
        """A prefill through a pinned layer (pinned_run): the slots follow from the routing on the device, with no
        host work per expert and no synchronisation, so the host queues the next layers while this one runs. The
        hits are counted on the device (ExpertPipeline.begin_pinned_layer); the prefill reads them at its end."""
        rt, pipeline = self.runtime, self.runtime.pipeline
        for hook in rt.route_hooks:
            hook(self.layer, x, index, weights)
        start = time.perf_counter()
        if rt.counted_rows is not None:  # a captured suffix's padding rows (discarded) take the first row's experts:
            # routed as they come, each could read up to k experts' weights the question does not, and count hits
            index = torch.where(rt.counted_rows[:, None], index, index[:1])
        pipeline.begin_pinned_layer(self.layer, index, self.num_experts)
        slots = (index + first).to(pipeline.tier.pool.device)
        out = self.pool_compute(x, slots, weights, run=(first, self.num_experts))
        pipeline.record_compute(time.perf_counter() - start)
        return out

    # ---- the slot-pool path (one batched call per layer) ----------------------------------------------------
    def pool_compute(
        self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, run: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """x [T, H], slots [T, k] (on the pool's device), weights [T, k] -> [T, H]. Device ops only when T == 1,
        so a CUDA graph can replay it. `run` (first slot, count): the slots are of one pinned layer's experts."""
        pool = self.runtime.pipeline.tier.pool
        if getattr(pool, "form", None) is not None:  # quantized records (experts/tiers/quant_slots.py)
            if x.shape[0] == 1 and pool.form.triton_int4:  # int4 slots for the Triton GEMV: torch has no kernel
                # imported here: kernels/ imports experts/
                from vismmoe_edge.kernels.moe_decode import fused_decode_records, use_triton_int4

                if use_triton_int4(pool.records, pool.form):
                    return fused_decode_records(x, slots, weights, pool.records, pool.form, self.act_fn)
            return pool_forward(x, slots, weights, pool.records, pool.form, self.act_fn, run)
        if x.shape[0] == 1:
            return decode_experts(x, slots, weights, pool.gate_up, pool.down, self.act_fn)
        grouped = grouped_mm_works(pool.gate_up.dtype, pool.gate_up.device)
        return prefill_experts(x, slots, weights, pool.gate_up, pool.down, self.act_fn, grouped=grouped, run=run)

    def prepare_pool_step(
        self, hidden: torch.Tensor, router_index: torch.Tensor, router_weights: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The graph path's routing, for one token: `router_index` / `router_weights` [1, k] are the router's
        choice in host memory. Returns the slot and weight of each expert the token uses [1, r] (r = k, or the
        trace's top-k under replay), on the host; the slots are None where some experts are still being read:
        then `arriving_step` computes the layer, the experts as they land, instead of the graph."""
        rt = self.runtime
        index, weights = router_index.clone(), router_weights.clone()  # observers may keep them
        if rt.replay is not None:
            index, weights = rt.replay.route(self.layer, 1)
        self._order = self.route(hidden, index, weights, index)
        arriving = self._arrival(self._order)
        self._arriving = None if arriving is None else (index[0].tolist(), *arriving)
        if arriving is not None:
            return None, weights.float()
        slot_of = self._acquire_slots(self._order)
        return torch.tensor([[slot_of[int(e)] for e in index[0].tolist()]]), weights.float()

    def arriving_step(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [1, H] and the routing weights [1, r] on the device -> [1, H]: the experts of the step that
        prepare_pool_step left to compute as they arrive (experts/arrival.py)."""
        assert self._arriving is not None, "prepare_pool_step returned slots: the graph computes this step"
        routed, split, form = self._arriving
        return self._compute_as_they_arrive(x, routed, weights, split, form)

    def _compute_as_they_arrive(
        self, x: torch.Tensor, routed: list[int], weights: torch.Tensor, split: tuple[list[int], list[int]],
        form: RowForm,
    ) -> torch.Tensor:  # fmt: skip
        pipeline = self.runtime.pipeline
        return compute_as_they_arrive(x, routed, weights, *split, partial(pipeline.arrived, self.layer),
                                      self._acquire_slots, form, pipeline.tier.pool.device)  # fmt: skip

    def finish_pool_step(self) -> None:
        self._finish(self._order)
        self._order = []

    def _arrival(self, order: list[int]) -> tuple[tuple[list[int], list[int]], RowForm] | None:
        """(_arrival_split's answer, the pool's row form) where the step computes its experts as they land; None
        where it runs the one batched call (everything resident, little still being read, or a pool whose decode
        has no rows: int8 dequantized as a batch on CUDA)."""
        split = self._arrival_split(order)
        form = None if split is None else row_form(self.runtime.pipeline.tier.pool, self.act_fn)
        return None if form is None else (split, form)

    def _arrival_split(self, order: list[int]) -> tuple[list[int], list[int]] | None:
        """Where experts of at least ARRIVAL_MIN_BYTES are still being read: (those resident now, those being
        read, in the pipeline's order); else None (the batched call)."""
        pipeline, layer = self.runtime.pipeline, self.layer
        resident = [e for e in order if (layer, e) in pipeline.pinned or pipeline.is_streamed_and_loaded(layer, e)]
        reading = len(order) - len(resident)
        if reading == 0 or reading * pipeline.tier.slot_bytes < ARRIVAL_MIN_BYTES:
            return None
        return resident, [e for e in order if e not in resident]

    def _acquire_slots(self, order: list[int]) -> dict[int, int]:
        """Wait for each expert to be fetched (on the GPU: the copy's event, queued on the compute stream)."""
        pipeline = self.runtime.pipeline
        slot_of: dict[int, int] = {}
        for expert in order:
            pipeline.acquire(self.layer, expert)
            slot = pipeline.slot_of(self.layer, expert)
            assert slot is not None, "a slot-pool tier keeps every resident expert in the pool"
            slot_of[expert] = slot
        return slot_of

    def _finish(self, order: list[int]) -> None:
        for expert in order:
            self.runtime.pipeline.finish(self.layer, expert)

    # ---- the page-cache path ---------------------------------------------------------------------------------
    def _loop_compute(
        self, hidden_states: torch.Tensor, index_cpu: torch.Tensor, top_k_weights: torch.Tensor, order: list[int]
    ) -> torch.Tensor:
        pipeline = self.runtime.pipeline
        out = torch.zeros_like(hidden_states)
        if hidden_states.shape[0] == 1:  # decode: one token, each routed expert once; no index juggling
            slot_of = {e: j for j, e in enumerate(index_cpu[0].tolist())}
            for expert in order:
                weights = pipeline.acquire(self.layer, expert)
                out += self._expert(hidden_states, weights) * top_k_weights[:, slot_of[expert], None]
                pipeline.finish(self.layer, expert)
            return out
        by_slot = index_cpu.t()  # [k, T]: torch.where then yields (slot, token) pairs as transformers does
        for expert in order:
            slot, token = torch.where(by_slot == expert)
            slot, token = slot.to(out.device), token.to(out.device)
            weights = pipeline.acquire(self.layer, expert)
            y = self._expert(hidden_states[token], weights) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
            pipeline.finish(self.layer, expert)
        return out

    def _expert(self, x: torch.Tensor, weights: ExpertWeights | QuantizedExpert) -> torch.Tensor:
        if isinstance(weights, QuantizedExpert):  # int4/int8 in place: the unified tier's mmap views
            return expert_forward(x, weights, self.act_fn)
        return expert_mlp(x, weights.gate_up, weights.down, self.act_fn)


def slot_ids(index: torch.Tensor, slot_of: dict[int, int]) -> torch.Tensor:
    """Expert ids [T, k] -> the slot of each, through a lookup table (a prefill routes thousands of pairs)."""
    table = torch.zeros(max(slot_of) + 1, dtype=torch.long)
    table[list(slot_of)] = torch.tensor(list(slot_of.values()))
    return table[index]
