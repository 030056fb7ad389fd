"""Assemble the expert runtime from options: the pinned region, the tier, the pipeline, the predictor."""

from __future__ import annotations

import os

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime, Predictor
from vismmoe_edge.experts.pipeline import ExpertPipeline
from vismmoe_edge.experts.predictor_worker import PredictorWorker
from vismmoe_edge.experts.recency import prompt_half_life
from vismmoe_edge.experts.store import ExpertStore
from vismmoe_edge.experts.tiers.host_mirror import HostMirror
from vismmoe_edge.experts.tiers.registry import resolve_auto, tier_kind
from vismmoe_edge.units import format_bytes

# Layers of top-k experts that predictions may have in flight when no plan set a depth: two, the bound peers
# found before speculative bytes start to slow demand misses (docs/platform-facts.md §5.3).
DEFAULT_PREFETCH_DEPTH = 2


def build_runtime(
    store: ExpertStore,
    *,
    budget_bytes: int,
    pinned_layers: list[int],
    tier: str = "auto",
    policy: str = "popularity",
    speculative_experts: int = 2 * 8,
    host_tier: bool = False,
) -> ExpertRuntime:
    """The pinned prefix is loaded now and counts against `budget_bytes`; the rest becomes cache slots (GPU slots
    with a budget that holds every expert: all loaded now, `resident_layers`).

    `host_tier` (CUDA slot pools): mirror every streamed expert in pinned host memory, filled now, so that a miss
    is one DMA; the planner asks for it where host RAM holds them all."""
    half_life = prompt_half_life(os.environ.get("VISMMOE_PROMPT_HALF_LIFE"))  # a bad value fails before any work
    kind = tier_kind(resolve_auto(tier, store.device.type))
    per_expert = store.expert_nbytes()
    num_experts = store.catalogue.num_experts
    pinned_bytes = len(pinned_layers) * num_experts * per_expert
    if pinned_bytes > budget_bytes:
        raise VismmoeError(
            f"the pinned prefix of {len(pinned_layers)} layers needs {format_bytes(pinned_bytes)}, more than the "
            f"memory budget {format_bytes(budget_bytes)}; lower --pinned-layers or raise --memory-budget"
        )
    pinned_layers = resident_layers(kind.memory, store.catalogue.moe_layers, pinned_layers, num_experts * per_expert,
                                    budget_bytes)  # fmt: skip
    pinned_bytes = len(pinned_layers) * num_experts * per_expert
    streamed = [layer for layer in store.catalogue.moe_layers if layer not in pinned_layers]
    slots = min((budget_bytes - pinned_bytes) // per_expert, len(streamed) * num_experts)
    if kind.memory == "kernel":  # the kernel decides what stays: no slots to bound
        slots = max(len(streamed) * num_experts, 1)
    if streamed and slots < 1:
        raise VismmoeError(
            f"the memory budget leaves {format_bytes(budget_bytes - pinned_bytes)} for streamed experts, less than "
            f"one expert ({format_bytes(per_expert)}); raise --memory-budget or lower --pinned-layers"
        )
    keys = [(layer, e) for layer in pinned_layers for e in range(num_experts)]
    mirror = None
    if host_tier and streamed and store.device.type == "cuda" and kind.memory == "device":
        mirror = HostMirror(store.catalogue, [(layer, e) for layer in streamed for e in range(num_experts)])
        mirror.fill()
    tier_impl = kind.build(store, max(slots, 1), pinned=len(keys), mirror=mirror)
    # The slot pool's own slots; unified memory: the page cache, mlocked where allowed; else ordinary tensors.
    pinned, lock_report = tier_impl.pin(keys)

    pipeline = ExpertPipeline(
        tier_impl,
        capacity=max(slots, 1),
        pinned=pinned,
        # Speculative bytes in flight spend the bandwidth demand misses need (platform-facts.md §5.3): the plan's
        # prefetch depth in layers of top-k experts, never more than a quarter of the cache.
        speculative_cap_bytes=min(speculative_experts, slots // 4) * tier_impl.slot_bytes,
        io_workers=4 if store.device.type == "cuda" else 1,  # CUDA: parallel memcpy into pinned staging
        policy=policy,
    )
    return ExpertRuntime(pipeline=pipeline, lock_report=lock_report, prompt_half_life=half_life)


def resident_layers(
    memory: str, moe_layers: list[int], pinned_layers: list[int], layer_bytes: int, budget_bytes: int
) -> list[int]:
    """The MoE layers whose experts are all loaded now: the pinned prefix, or every layer where the budget holds
    every expert in device memory (GPU slots). There a slot pool would only start cold and fill through misses,
    each of which redoes a device token and stops tokens launching ahead; loaded up front, no token misses. The
    engine's own pinned prefix (where compression cuts) stays what the caller chose."""
    if memory == "device" and len(moe_layers) * layer_bytes <= budget_bytes:
        return list(moe_layers)
    return pinned_layers


def attach_predictor(runtime: ExpertRuntime, predictor: Predictor | None, *, background: bool = True) -> None:
    """`background`: run it on a worker thread beside compute (predictors that need the device's hidden state,
    the next-layer gate, stay inline)."""
    runtime.predictor = predictor
    observe = getattr(predictor, "observe", None)
    if observe is not None:
        runtime.route_hooks.append(observe)
    if predictor is not None and background and not getattr(predictor, "reads_device_hidden", False):
        runtime.predictor_worker = PredictorWorker(predictor, runtime.pipeline)
