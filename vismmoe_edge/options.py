"""What a user chooses when loading a model, and the one place where "auto" becomes numbers from the plan.

`run`, `eval`, `serve`, `bench`, `profile`, `calibrate` and `analyze` all build a `LoadOptions` and call
`resolve` (or `load_engine`), so the same arguments give the same plan whichever command reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.tiers.registry import AUTO, tier_kind
from vismmoe_edge.units import format_bytes

if TYPE_CHECKING:  # torch and the checkpoint readers load with the model, not with the options (serve --help)
    import torch

    from vismmoe_edge.checkpoint_info import CheckpointInfo
    from vismmoe_edge.compress.config import CompressionConfig
    from vismmoe_edge.engine import Engine
    from vismmoe_edge.hardware.gpu_access import GpuAccess
    from vismmoe_edge.hardware.profiles import Profile
    from vismmoe_edge.planning.plan import Plan


@dataclass(frozen=True)
class LoadOptions:
    """Every loading choice; None or "auto" leaves it to the planner."""

    memory_budget: str = "auto"  # a size ("2GiB"), a share of all expert bytes ("40%"), or "auto"
    pinned_layers: int | None = None
    tier: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    predictor: str = "auto"
    policy: str = "popularity"  # beat lru in every median of the discrete and unified benchmarks (1.02-1.16x)
    profile: str = "auto"  # the hardware profile the plan is made for
    prefetch_depth: int | None = None  # MoE layers of predicted experts in flight ahead of compute
    host_tier: str = "auto"  # GPU slot pools: mirror the streamed experts in pinned host RAM (auto: where they fit)
    compression: CompressionConfig | None = None
    prefix_cache_bytes: str = "auto"  # the prefix cache's bound: a size ("256MiB"), 0 (off), or auto (plan)

    @property
    def leaves_anything_to_plan(self) -> bool:
        return "auto" in (self.memory_budget, self.tier) or self.pinned_layers is None


@dataclass(frozen=True)
class ResolvedOptions:
    """LoadOptions with every planner choice filled in: what `loader.load` takes."""

    memory_budget_bytes: int  # pinned prefix + cache, at the compute dtype (config.budget_bytes)
    pinned_layers: int
    tier: str
    prefetch_depth: int
    host_tier: bool = False
    note: str = ""  # one line saying where the planned values came from ("" when nothing was planned)
    plan: Plan | None = None
    device: str = "auto"  # the plan's device where the user left it to the plan and this machine has it
    prefix_cache_bytes: int = 0  # the prefix cache's bound (0: off)
    embedding: str = "auto"  # the token embedding's place (loader.load): the plan's where it planned one


def resolve(
    options: LoadOptions,
    checkpoint: CheckpointInfo,
    *,
    mem_available: int | None = None,
    gpu_free: int | None = None,
) -> ResolvedOptions:
    """Fill what the user left to the planner from the plan for this machine (or the given memory readings).

    A fixed --memory-budget with no --pinned-layers pins no deeper than fits in that budget, with room left for
    one streamed expert.
    """
    from vismmoe_edge.config import budget_bytes
    from vismmoe_edge.experts.runtime import DEFAULT_PREFETCH_DEPTH

    o = options
    if o.host_tier not in ("auto", "on", "off"):
        raise VismmoeError(f"--host-tier {o.host_tier!r}: use auto, on or off")
    prefix_cache = parse_prefix_cache(o.prefix_cache_bytes)
    place = embedding_setting()
    depth = o.prefetch_depth
    if not o.leaves_anything_to_plan:
        assert o.pinned_layers is not None
        depth = DEFAULT_PREFETCH_DEPTH if depth is None else depth
        dtype = compute_dtype(o, checkpoint, o.device)
        budget = budget_bytes(o.memory_budget, checkpoint.catalogue, dtype)
        check_fixed_budget(budget, o.tier, checkpoint)
        host, _ = resolve_host_tier(o, checkpoint, o.tier, o.pinned_layers, mem_available)
        if prefix_cache is None:
            from vismmoe_edge.planning.memory_plan import DEFAULT_PROMPT_TOKENS, default_prefix_cache_bytes

            prefix_cache = default_prefix_cache_bytes(checkpoint, DEFAULT_PROMPT_TOKENS, dtype.itemsize)
        return ResolvedOptions(budget, o.pinned_layers, o.tier, depth, host, device=o.device,
                               prefix_cache_bytes=prefix_cache, embedding=place)  # fmt: skip
    from vismmoe_edge.hardware.profiles import select_profile
    from vismmoe_edge.planning.plan import make_plan

    chosen, reason, warnings = select_profile(o.profile, cuda_available=False if o.device == "cpu" else None)
    gpu, here, gpu_note = plan_gpu(o.device, chosen, named=o.profile != "auto")
    dtype = compute_dtype(o, checkpoint, "cuda" if o.device == "auto" and here else o.device)
    plan = make_plan(
        checkpoint, chosen, profile_reason=reason, mem_available=mem_available, gpu_free=gpu_free, gpu=gpu,
        dtype=dtype, prefix_cache_bytes=prefix_cache, embedding=place,
    )  # fmt: skip
    plan.warnings[:0] = warnings + ([gpu_note] if gpu_note else [])
    pinned = o.pinned_layers
    if o.memory_budget == "auto":
        budget = plan.memory_budget_bytes
    else:
        budget = budget_bytes(o.memory_budget, checkpoint.catalogue, dtype)
        if pinned is None:
            fits = max(0, (budget - plan.bytes_per_expert) // plan.s_layer_bytes)
            pinned = min(plan.pinned_layers, fits)
        check_fixed_budget(budget, o.tier if o.tier != "auto" else plan.tier, checkpoint)
    pinned = plan.pinned_layers if pinned is None else pinned
    device = plan.device if o.device == "auto" and here else o.device
    tier = plan.tier if o.tier == "auto" else o.tier
    fallback = tier_kind(tier).without_cuda
    if fallback is not None and o.tier == "auto" and not here:
        tier = fallback  # planned for a board's iGPU, loaded where torch has no CUDA: the CPU page-cache tier
    depth = plan.prefetch_depth if depth is None else depth
    host, why = resolve_host_tier(o, checkpoint, tier, pinned, mem_available)
    if why:
        plan.why.append(why)
    # the plan counted the embedding out of GPU memory only for its own budget and tier, on this machine's GPU
    planned_here = o.memory_budget == "auto" and tier == plan.tier and here
    embedding = ("host" if plan.embedding_in_host else "device") if planned_here else place
    note = (
        f"[plan: profile {chosen.name}: {pinned} pinned layers, expert budget {format_bytes(budget)}, tier {tier}, "
        f"device {device if device != 'auto' else plan.device}, prefetch depth {depth}"
        f"{', pinned host tier' if host else ''}{', token embedding in host memory' if embedding == 'host' else ''}; "
        "`vismmoe-edge plan` says why]"
    )
    return ResolvedOptions(budget, pinned, tier, depth, host, note, plan, device, plan.prefix_cache_bytes, embedding)


def embedding_setting() -> str:
    """VISMMOE_EMBEDDING (auto, host or device): the commands' and the daemon's way to place the token embedding
    beside GPU slots (loader.load takes `embedding`; models/host_embedding.py); a bad value is a one-line error."""
    from vismmoe_edge.models.host_embedding import check_embedding_place

    place = os.environ.get("VISMMOE_EMBEDDING", "auto")
    check_embedding_place(place, "VISMMOE_EMBEDDING")
    return place


def parse_prefix_cache(text: str) -> int | None:
    """--prefix-cache-bytes: "auto" (None: the plan's share), 0 or "off" (no cache), or a size ("256MiB")."""
    from vismmoe_edge.units import parse_size

    text = str(text).strip()
    if text == "auto":
        return None
    if text in ("0", "off"):
        return 0
    if text.startswith("-"):
        raise VismmoeError(f"--prefix-cache-bytes {text!r}: must not be negative; use 0 to turn the cache off")
    try:
        return parse_size(text, what="--prefix-cache-bytes")
    except VismmoeError:
        raise VismmoeError(
            f"--prefix-cache-bytes {text!r}: use auto (the plan's share), 0 (off), or a size like 256MiB"
        ) from None


def compute_dtype(options: LoadOptions, checkpoint: CheckpointInfo, device: str) -> torch.dtype:
    """The dtype experts are cached at on `device` (--dtype, else the checkpoint's): what budgets are counted in.
    Only the device's type matters here (a plan may be for a board's GPU this machine lacks)."""
    import torch

    from vismmoe_edge.config import resolve_dtype

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device("cuda" if device.startswith("cuda") else "cpu")
    return resolve_dtype(options.dtype, checkpoint.stored_dtype, kind)


def resolve_host_tier(
    options: LoadOptions, checkpoint: CheckpointInfo, tier: str, pinned_layers: int, mem_available: int | None
) -> tuple[bool, str]:
    """The pinned host tier serves GPU slot pools only; "auto" takes it where every streamed expert fits."""
    in_gpu_memory = tier == AUTO or tier_kind(tier).memory == "device"
    if options.host_tier == "off" or not in_gpu_memory or options.device == "cpu":
        return False, ""
    if options.host_tier == "on":
        return True, "host tier: asked for (--host-tier on)"
    import torch

    if not torch.cuda.is_available():
        return False, ""
    from vismmoe_edge.hardware import system
    from vismmoe_edge.planning.plan import host_tier_decision

    catalogue = checkpoint.catalogue
    streamed = len(catalogue.moe_layers[pinned_layers:]) * catalogue.num_experts * catalogue.expert_bytes
    available = system.mem_available_bytes() if mem_available is None else mem_available
    return host_tier_decision(streamed, available)


def plan_gpu(device: str, profile: Profile, *, named: bool) -> tuple[GpuAccess | None, bool, str | None]:
    """(the CUDA device to plan for, whether this machine has it, a note). None under --device cpu or without CUDA;
    for a Jetson profile named on a machine without CUDA, the board's documented iGPU, so that
    `plan --profile <jetson>` says what that board runs (loading here then computes on the CPU)."""
    from vismmoe_edge.hardware.gpu_access import ORIN_DOCUMENTED, probe_quietly

    if device == "cpu":
        return None, False, None
    index = int(device.split(":", 1)[1]) if device.startswith("cuda:") and device[5:].isdigit() else 0
    gpu = probe_quietly(index)
    if gpu is None and named and profile.kind == "jetson":
        note = "no CUDA device here: planned for the board's iGPU as documented; loading here computes on the CPU"
        return ORIN_DOCUMENTED, False, note
    return gpu, gpu is not None, None


def check_fixed_budget(budget: int, tier: str, checkpoint: CheckpointInfo, root: Path = Path("/")) -> None:
    """Refuse, with one line, a --memory-budget that the memory cgroup cannot hold next to the model's other parts:
    past the cgroup's limit the kernel OOM-kills without a word. Tiers that keep experts in GPU memory or leave
    them to the kernel (gpu, mmap) are not checked."""
    if tier == AUTO or tier_kind(tier).memory != "host":
        return
    from vismmoe_edge.hardware.cgroup import read_cgroup_memory
    from vismmoe_edge.planning.memory_plan import runtime_parts

    group = read_cgroup_memory(root)
    headroom = None if group is None else group.headroom_bytes
    if group is None or headroom is None:
        return
    others = runtime_parts(checkpoint, device="cuda" if tier_kind(tier).integrated_gpu else "cpu").total_bytes
    if budget + others > headroom:
        raise VismmoeError(
            f"--memory-budget {format_bytes(budget)} and the model's other parts "
            f"({format_bytes(others)}: weights, KV cache, activations) exceed what the memory cgroup leaves, "
            f"{format_bytes(headroom)} ({group.describe()}); lower --memory-budget, or leave it auto"
        )


def load_resolved(checkpoint: CheckpointInfo, options: LoadOptions, resolved: ResolvedOptions) -> Engine:
    """Load with options already resolved (a command that loads several fresh engines plans once)."""
    from vismmoe_edge.loader import load

    engine = load(
        checkpoint,
        memory_budget=resolved.memory_budget_bytes,
        pinned_layers=resolved.pinned_layers,
        device=resolved.device,
        dtype=options.dtype,
        tier=resolved.tier,
        predictor=options.predictor,
        policy=options.policy,
        prefetch_depth=resolved.prefetch_depth,
        host_tier=resolved.host_tier,
        embedding=resolved.embedding,
    )
    if options.compression is not None:
        engine.compression = options.compression
    if resolved.prefix_cache_bytes > 0:
        from vismmoe_edge.prefix_cache import PrefixCache

        salt = f"{engine.model_dir.resolve()}|{engine.dtype}|{engine.device}"
        engine.prefix_cache = PrefixCache(resolved.prefix_cache_bytes, salt=salt)
    return engine


def load_engine(
    model: str | Path | CheckpointInfo | None,
    options: LoadOptions,
    *,
    mem_available: int | None = None,
    gpu_free: int | None = None,
) -> tuple[Engine, ResolvedOptions]:
    """Inspect the checkpoint once, resolve the options against it, load, and set compression."""
    from vismmoe_edge.checkpoint_info import as_checkpoint_info

    checkpoint = as_checkpoint_info(model)
    resolved = resolve(options, checkpoint, mem_available=mem_available, gpu_free=gpu_free)
    return load_resolved(checkpoint, options, resolved), resolved
