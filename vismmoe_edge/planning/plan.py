"""The planner: pinned-prefix depth, expert-cache size and prefetch depth from a profile, a checkpoint's
catalogue and the memory actually available. `vismmoe-edge plan MODEL` prints the plan and why.

The rule (the seed paper's): L_semantic <= L <= floor((M_avail - C_safe) / S_layer). We also subtract every other
part the process holds (memory_plan.py: non-expert weights R, language and vision tower, the KV cache, prefill
activations, reads in flight) and keep room for one layer's top-k experts in the cache, so:

    M_avail = min(MemAvailable, what the memory cgroup leaves)   (unified memory; free GPU memory on a dGPU)
              (a Jetson profile planned on another machine: the module's memory less the OS and a camera
              pipeline, board_memory.py, instead of this machine's MemAvailable)
    M_e   = M_avail - C_safe - R - KV - A - IO - P     (memory left for expert weights; P: the prefix cache)
    L_max = n                                         if M_e >= n * S_layer (every expert fits)
          = floor((M_e - k * S_e) / S_layer)          otherwise
    L     = min(L_semantic, n, L_max)                 (warn when L_max < L_semantic)
    cache = min(M_e - L * S_layer, (n - L) * S_layer)
    depth = min(profile depth, cache // (k * S_e) - 1), 0 when nothing streams

L stays at its semantic minimum because the compressor cuts visual tokens after the pinned prefix
(README.md, How it works): a deeper prefix runs more layers on every visual token, and memory given to the
cache instead follows the routing's skew.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vismmoe_edge.checkpoint_info import CheckpointInfo, as_checkpoint_info
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware import system
from vismmoe_edge.hardware.cgroup import CgroupMemory, read_cgroup_memory
from vismmoe_edge.hardware.gpu_access import SLOTS_TIER, GpuAccess, igpu_tier
from vismmoe_edge.hardware.profiles import Profile
from vismmoe_edge.models.host_embedding import embedding_in_host
from vismmoe_edge.planning.board_memory import BoardMemory, board_memory, on_the_board
from vismmoe_edge.planning.memory_plan import DEFAULT_CONTEXT_TOKENS, runtime_parts
from vismmoe_edge.planning.weights import bf16_resident_bytes, weight_bytes
from vismmoe_edge.quant.packing import ROWMAJOR
from vismmoe_edge.units import format_bytes

GIB = 1 << 30
DETECT = "detect"  # make_plan(cgroup=DETECT): read this process's memory cgroup under `root`

# RAM kept out of the pinned host tier: the OS, this process, page cache for loading the non-expert weights.
HOST_TIER_RESERVE = 8 * GIB


def host_tier_decision(streamed_bytes: int, mem_available: int) -> tuple[bool, str]:
    """Whether every streamed expert fits in pinned host RAM beside a discrete GPU, and why."""
    room = mem_available - HOST_TIER_RESERVE
    if streamed_bytes <= room:
        return True, (
            f"host tier: the {format_bytes(streamed_bytes)} of streamed experts fit in pinned host RAM "
            f"({format_bytes(mem_available)} available, {format_bytes(HOST_TIER_RESERVE)} kept free): a GPU miss is "
            "one DMA"
        )
    return False, (
        f"no host tier: the {format_bytes(streamed_bytes)} of streamed experts do not fit in "
        f"{format_bytes(max(room, 0))} of host RAM; misses read the shards through pinned staging"
    )


@dataclass
class Plan:
    model_dir: str
    profile: str
    tier: str  # the loader's tier: "unified-slots" (Jetson iGPU), "unified" (CPU page cache), "gpu" (desktop-gpu)
    pinned_layers: int
    moe_layers: int
    memory_budget_bytes: int  # pinned prefix + expert cache: the loader's --memory-budget
    cache_bytes: int
    prefetch_depth: int
    m_avail_bytes: int
    m_avail_source: str
    c_safe_bytes: int
    resident_bytes: int  # non-expert weights, always in memory
    s_layer_bytes: int  # all routed experts of one MoE layer
    bytes_per_expert: int
    top_k: int
    l_semantic: int
    l_max: int
    device: str = "cpu"  # where experts are computed: "cuda" (a Jetson's iGPU, a desktop GPU) or "cpu"
    memory_parts: dict[str, int] = field(default_factory=dict)  # what M_avail is spent on, part by part
    cgroup: str | None = None  # the memory cgroup's limit, when one applies
    gpu: dict[str, Any] | None = None  # the CUDA device's host-memory access facts the tier rests on
    board: dict[str, Any] | None = None  # planned for a Jetson module off the board: its memory, part by part
    weights: dict[str, Any] = field(default_factory=dict)  # planning/weights.WeightBytes: each part's bytes
    resident_bf16_bytes: int = 0  # the non-expert weights at bf16, for comparison
    total_expert_bytes: int = 0
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    prefix_cache_bytes: int = 0  # vision features and prompt-prefix KV kept across requests (prefix_cache.py)
    embedding_in_host: bool = False  # the token embedding in pinned host memory, not GPU memory (host_embedding.py)
    why: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def cache_experts(self) -> int:
        return self.cache_bytes // self.bytes_per_expert if self.bytes_per_expert else 0

    @property
    def cache_fraction(self) -> float:
        """The expert cache (pinned prefix not counted) as a share of every expert's bytes."""
        return self.cache_bytes / self.total_expert_bytes if self.total_expert_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {
            "cache_experts": self.cache_experts,
            "cache_fraction": round(self.cache_fraction, 4),
            "resident_fraction_of_bf16": round(self.resident_bytes / self.resident_bf16_bytes, 4)
            if self.resident_bf16_bytes
            else None,
        }


def _gpu_free_bytes() -> int:
    import torch

    if not torch.cuda.is_available():
        raise VismmoeError("profile desktop-gpu needs CUDA, which torch cannot use here: pass --profile cpu")
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def _m_avail(
    profile: Profile,
    mem_available: int | None,
    gpu_free: int | None,
    root: Path,
    cgroup: CgroupMemory | None,
    board: BoardMemory | None = None,
) -> tuple[int, str]:
    if profile.planner.unified_memory:
        if mem_available is not None:
            available, source = mem_available, "MemAvailable (given)"
        elif board is not None:
            available, source = board.available_bytes, board.describe()
        else:
            # Unified memory: plan from MemAvailable; cudaMemGetInfo counts page cache as used on Orin
            # (platform-facts.md §1.7).
            available = system.mem_available_bytes(root)
            source = f"MemAvailable in {root / 'proc/meminfo'} (unified memory)"
        headroom = None if cgroup is None else cgroup.headroom_bytes
        if cgroup is not None and headroom is not None and headroom < available:
            return headroom, f"what the memory cgroup leaves ({cgroup.describe()}), below {source}"
        return available, source
    if gpu_free is not None:
        return gpu_free, "free GPU memory (given)"
    return _gpu_free_bytes(), "free GPU memory from torch.cuda.mem_get_info (discrete GPU)"


def placement(profile: Profile, gpu: GpuAccess | None) -> tuple[str, str, str]:
    """(device, tier, why): a discrete GPU gets slots in its memory; unified memory with a CUDA device (a Jetson's
    iGPU) gets slots in pinned host memory that the GPU reads in place; without CUDA the CPU computes from the
    page cache."""
    if not profile.planner.unified_memory:
        return "cuda", "gpu", "tier gpu on cuda: the cache lives in slots in GPU memory"
    if gpu is None or profile.kind != "jetson":
        why = "no CUDA device" if gpu is None else f"profile {profile.name} is not a Jetson's"
        return "cpu", "unified", f"tier unified on cpu ({why}): the cache lives in the page cache of host memory"
    refusal = gpu.slot_refusal()
    if refusal is not None:
        return "cpu", "unified", f"tier unified on cpu: {refusal}"
    tier, note = igpu_tier(gpu)
    why = (
        f"tier {tier} on cuda ({gpu.name}, {gpu.source}): expert slots in pinned, GPU-mapped host memory, filled "
        "by exact-range reads and read in place by the GPU (no second copy in the shared DRAM)"
    )
    return "cuda", tier, why + (f"; {note}" if note else "")


def make_plan(
    model: Path | CheckpointInfo,
    profile: Profile,
    *,
    mem_available: int | None = None,
    gpu_free: int | None = None,
    l_semantic: int | None = None,
    c_safe: int | None = None,
    root: Path = Path("/"),
    profile_reason: str = "",
    gpu: GpuAccess | None = None,
    cgroup: CgroupMemory | None | str = DETECT,
    bits: int | None = None,
    dense_bits: int | None = None,
    group_size: int | None = None,
    max_context: int | None = None,
    dtype: torch.dtype | None = None,
    takes_c_safe_option: bool = False,
    prefix_cache_bytes: int | None = None,
    embedding: str = "auto",
) -> Plan:
    """The plan for ``model_dir`` on ``profile``. mem_available / gpu_free / c_safe are bytes; None = measure
    (MemAvailable on unified memory, free GPU memory on discrete; a Jetson profile on another machine: the
    module's memory, board_memory.py) or take the profile's value. ``gpu``: the CUDA device experts may be
    computed on (None: none). ``cgroup``: the memory cgroup to plan within (DETECT: read this process's under
    ``root``; None: ignore cgroups). ``bits`` / ``dense_bits`` / ``group_size``: plan the checkpoint as
    `quantize` would convert it. ``max_context``: positions the KV cache holds (default 4,608). ``dtype``: the compute
    dtype float weights are held at (None: the checkpoint's; float16 on the CPU is float32), so that the plan
    counts what the loader's cache holds. ``embedding``: where GPU slots put the token embedding ("auto": in
    pinned host memory when they cannot hold every expert; "host", "device": as named). ``prefix_cache_bytes``:
    the prefix cache's bound (None: one prompt's worth, memory_plan.default_prefix_cache_bytes; 0: off).
    ``takes_c_safe_option``: the calling command has --c-safe-gib (`plan`; `run` and `serve` take C_safe from the
    profile), so a refusal may name it."""
    checkpoint = as_checkpoint_info(model)
    model_dir = checkpoint.model_dir
    n, k, e = len(checkpoint.catalogue.moe_layers), checkpoint.top_k, checkpoint.catalogue.num_experts
    device, tier, tier_why = placement(profile, gpu)
    context = DEFAULT_CONTEXT_TOKENS if max_context is None else max_context
    if context < 1:
        raise VismmoeError(f"--max-context {context}: must be at least 1")
    stored = checkpoint.stored_dtype
    itemsize = 4 if device == "cpu" and str(stored) == "torch.float16" else stored.itemsize
    if dtype is not None:
        itemsize = dtype.itemsize  # --dtype: the loader converts every float weight, experts included
    weights = weight_bytes(
        checkpoint, bits=bits, dense_bits=dense_bits, group_size=group_size, float_scale=itemsize / stored.itemsize
    )
    s_e = weights.bytes_per_expert
    s_layer = e * s_e
    expert_dtype = _expert_dtype(checkpoint, weights, group_size)
    if dtype is not None and weights.bits is None and checkpoint.catalogue.quant is None:
        expert_dtype = f"the compute dtype {str(dtype).removeprefix('torch.')}"
    if prefix_cache_bytes is not None and prefix_cache_bytes < 0:
        raise VismmoeError(f"--prefix-cache-bytes {prefix_cache_bytes}: must not be negative (0 turns it off)")
    parts = runtime_parts(
        checkpoint, device=device, context_tokens=context, weights=weights, prefix_cache_bytes=prefix_cache_bytes
    )
    resident = parts.language_weights_bytes + parts.vision_weights_bytes
    others = parts.total_bytes - resident
    board = None
    if profile.planner.unified_memory and mem_available is None and not on_the_board(profile, root):
        board = board_memory(profile)
    group = read_cgroup_memory(root) if cgroup == DETECT else cgroup
    assert group is None or isinstance(group, CgroupMemory)
    m_avail, source = _m_avail(profile, mem_available, gpu_free, root, group, board)
    l_sem_from = "--l-semantic" if l_semantic is not None else f"profile {profile.name}"
    c_safe_from = "--c-safe-gib" if c_safe is not None else f"profile {profile.name}"
    l_sem = profile.planner.l_semantic if l_semantic is None else l_semantic
    c_safe_b = int(profile.planner.c_safe_gib * GIB) if c_safe is None else c_safe
    if l_sem < 0 or c_safe_b < 0:
        raise VismmoeError("--l-semantic and --c-safe-gib must not be negative")

    why: list[str] = [f"profile {profile.name}: {profile_reason}"] if profile_reason else []
    warnings: list[str] = []
    if board is not None:
        warnings.append(f"planned for the {board.module} (profile {profile.name}), not for this machine")
    m_e = m_avail - c_safe_b - resident - others
    # the loader's rule (models/host_embedding.py): with GPU slots that cannot hold every expert, the token
    # embedding goes to mapped host memory (a token reads one row of it over the bus) and its GPU memory to slots
    in_host = (
        device == "cuda" and weights.embedding_bytes > 0 and not checkpoint.family.tied_head(checkpoint.config)
        and embedding_in_host(embedding, device=torch.device(device), slots_in_gpu=tier == "gpu",
                              experts_outside_gpu=n * e - max(m_e, 0) // s_e)
    )  # fmt: skip
    if in_host:
        m_e += weights.embedding_bytes
        resident -= weights.embedding_bytes
    one_layer_topk = k * s_e
    why += [
        f"M_avail = {format_bytes(m_avail)}: {source}",
        f"C_safe = {format_bytes(c_safe_b)} ({c_safe_from}): OS and runtime headroom",
        f"R = {format_bytes(resident)} of non-expert weights held once ({format_bytes(parts.vision_weights_bytes)} "
        "of them the vision tower; their page cache is dropped after loading): subtracted" + _weights_note(weights)
        + (
            f"; the {format_bytes(weights.embedding_bytes)} token embedding is not among them: it stays in pinned host"
            " memory, where the GPU reads a token's row in place, "
            + ("as asked (embedding host)" if embedding == "host" else "since GPU slots cannot hold every expert")
            if in_host
            else ""
        ),
        f"KV = {format_bytes(parts.kv_cache_bytes)} for {parts.context_tokens} positions, A = "
        f"{format_bytes(parts.activation_bytes)} of prefill activations for {parts.prompt_tokens} tokens (an "
        f"estimate; the vision tower's peak over as many image tokens is {format_bytes(parts.vision_peak_bytes)}, "
        f"freed before the prefill), IO = {format_bytes(parts.io_in_flight_bytes)} of reads in flight: subtracted",
        f"P = {format_bytes(parts.prefix_cache_bytes)} of prefix cache ("
        + (
            "off"
            if not parts.prefix_cache_bytes
            else "--prefix-cache-bytes"
            if prefix_cache_bytes is not None
            else f"default: one {parts.prompt_tokens}-token prompt's KV and vision features"
        )
        + "; an image's prefill reused by later questions): subtracted",
        f"M_e = M_avail - C_safe - R - KV - A - IO - P = {format_bytes(m_e)} for expert weights",
        f"S_layer = {e} experts x {format_bytes(s_e)} = {format_bytes(s_layer)} per MoE layer ({n} MoE layers, "
        f"top-{k}; sizes at {expert_dtype})",
    ]
    if m_e < one_layer_topk:
        raise VismmoeError(
            f"{model_dir}: {format_bytes(m_e)} left for experts (M_avail {format_bytes(m_avail)} - C_safe "
            f"{format_bytes(c_safe_b)} - resident weights {format_bytes(resident)} - KV, activations and reads "
            f"{format_bytes(others)}) cannot hold one layer's top-{k} experts ({format_bytes(one_layer_topk)}); "
            + _ways_out(weights, source, context, c_safe_option=takes_c_safe_option or c_safe is not None)
        )

    if m_e >= n * s_layer:
        l_max = n
        why.append(
            f"rule: L_semantic <= L <= L_max; every expert fits (n x S_layer = {format_bytes(n * s_layer)}), "
            f"so L_max = n = {n}; GPU slots load them all at start (no token waits for a miss), the compressor "
            "still cuts after the pinned prefix"
        )
    else:
        l_max = (m_e - one_layer_topk) // s_layer
        why.append(
            f"rule: L_semantic <= L <= L_max = floor((M_e - top-k x S_e) / S_layer) = floor(({format_bytes(m_e)} - "
            f"{format_bytes(one_layer_topk)}) / {format_bytes(s_layer)}) = {l_max} (the paper's "
            "floor((M_avail - C_safe) / S_layer), less R and room for one layer's top-k in the cache)"
        )
    target = min(l_sem, n)
    if l_max < target:
        pinned = l_max
        warnings.append(
            f"L_max = {l_max} < L_semantic = {target}: pinning only {l_max} layers; "
            f"the compressor's cut comes before the semantic layers are resident"
        )
        why.append(f"L = L_max = {l_max}: L_semantic = {l_sem} ({l_sem_from}) does not fit")
    else:
        pinned = target
        why.append(
            f"L = L_semantic = {pinned} ({l_sem_from}{', capped at n' if l_sem > n else ''}): the compressor cuts "
            "visual tokens after the prefix, so a deeper prefix costs prefill; spare memory goes to the cache"
        )

    streamed = n - pinned
    cache = min(m_e - pinned * s_layer, streamed * s_layer)
    budget = pinned * s_layer + cache
    slots = cache // s_e
    why.append(
        f"cache = min(M_e - L x S_layer, (n - L) x S_layer) = {format_bytes(cache)} = {slots} experts"
        + (f", {slots / (streamed * e):.0%} of the {streamed} streamed layers' experts" if streamed else "")
        + f" (at least one layer's top-{k} = {format_bytes(one_layer_topk)})"
    )
    why.append(f"memory budget = L x S_layer + cache = {format_bytes(budget)} (--memory-budget {budget})")

    depth_wanted = profile.planner.prefetch_depth
    if streamed == 0:
        depth = 0
        why.append("prefetch depth 0: every MoE layer is pinned, nothing streams")
    else:
        depth = min(depth_wanted, slots // k - 1)
        held = f"the cache holds the top-{k} of {slots // k} layer(s); prefetching d layers ahead needs d + 1"
        if depth < depth_wanted:
            warnings.append(f"prefetch depth lowered from {depth_wanted} to {depth}: the cache is too small")
            why.append(f"prefetch depth {depth}: profile asks {depth_wanted}, but {held}")
        else:
            why.append(f"prefetch depth {depth} (profile {profile.name}); {held}")
    why.append(tier_why)
    if (layout_note := _int4_layout_note(checkpoint, weights, tier)) is not None:
        why.append(layout_note)
    memory_parts = {
        **{n: v for n, v in parts.as_dict().items() if n.endswith("_bytes") and n not in _NOT_SUMMED},
        "pinned_prefix_bytes": pinned * s_layer,
        "cache_bytes": cache,
        "reserve_bytes": c_safe_b,
    }
    if in_host:
        memory_parts["language_weights_bytes"] -= weights.embedding_bytes  # held in host memory instead
    memory_parts["total_bytes"] = sum(memory_parts.values())  # <= M_avail: the budget is what M_e leaves
    return Plan(
        model_dir=str(model_dir),
        profile=profile.name,
        tier=tier,
        pinned_layers=pinned,
        moe_layers=n,
        memory_budget_bytes=budget,
        cache_bytes=cache,
        prefetch_depth=depth,
        m_avail_bytes=m_avail,
        m_avail_source=source,
        c_safe_bytes=c_safe_b,
        resident_bytes=resident,
        s_layer_bytes=s_layer,
        bytes_per_expert=s_e,
        top_k=k,
        l_semantic=l_sem,
        l_max=l_max,
        device=device,
        memory_parts=memory_parts,
        cgroup=None if group is None or group.limit_bytes is None else group.describe(),
        gpu=None if gpu is None else gpu.as_dict(),
        board=None if board is None else board.as_dict(),
        weights=weights.as_dict(),
        resident_bf16_bytes=bf16_resident_bytes(checkpoint),
        total_expert_bytes=weights.expert_bytes,
        context_tokens=context,
        prefix_cache_bytes=parts.prefix_cache_bytes,
        embedding_in_host=in_host,
        why=why,
        warnings=warnings,
    )


_NOT_SUMMED = ("total_bytes", "vision_peak_bytes")  # the vision peak is inside the activations (the larger one)


def _expert_dtype(checkpoint: CheckpointInfo, weights: Any, group_size: int | None) -> str:
    from vismmoe_edge.planning.describe import quant_name

    if checkpoint.catalogue.quant is not None:
        return quant_name(checkpoint.catalogue.quant)
    if weights.bits is None:
        return f"the checkpoint dtype {checkpoint.catalogue.dtype}"
    group = f"-g{group_size or 128}" if weights.bits == 4 else ""
    return f"int{weights.bits}{group} (planned)"


def _weights_note(weights: Any) -> str:
    parts = (
        f" (embedding {format_bytes(weights.embedding_bytes)}, lm_head {format_bytes(weights.lm_head_bytes)}, "
        f"attention {format_bytes(weights.attention_bytes)}, MLPs {format_bytes(weights.mlp_bytes)}, routers and norms "
        f"{format_bytes(weights.other_language_bytes)})"
    )
    if weights.embedding_on_disk_bytes:
        parts += f"; the {format_bytes(weights.embedding_on_disk_bytes)} token embedding is read by row from disk"
    if weights.planned:
        dense = f", dense weights int{weights.dense_bits}, vision tower int8" if weights.dense_bits else ""
        parts += f"; sizes as `quantize --bits {weights.bits}` would write them{dense}"
    return parts


def _int4_layout_note(checkpoint: CheckpointInfo, weights: Any, tier: str) -> str | None:
    """Which int4 layout the tier reads: unified-slots reads each record into the slot its GPU kernels read, so
    its codes must be row-major (experts/tiers/igpu_slots.py); `quantize --layout auto` writes the CPU's tiles."""
    if tier != SLOTS_TIER:
        return None
    quant = checkpoint.catalogue.quant
    if quant is not None and quant.quant.bits == 4 and quant.quant.layout != ROWMAJOR:
        return (
            f"int4 codes: this file's are in layout {quant.quant.layout}, which tier {tier} refuses (its GPU kernels "
            f"read rows as stored): convert with `quantize --bits 4 --layout {ROWMAJOR}`"
        )
    if weights.planned and weights.bits == 4:
        return f"int4 codes: tier {tier} reads row-major ones, so convert with `quantize --bits 4 --layout {ROWMAJOR}`"
    return None


def _ways_out(weights: Any, source: str, context: int, c_safe_option: bool) -> str:
    """What would make it fit, cheapest first."""
    ways = []
    if weights.bits is None:
        ways.append("quantize the experts (plan with --bits 4 to see)")
    if weights.dense_bits is None:
        ways.append("quantize the dense weights too (--dense-bits 4)")
    if context > 1024:
        ways.append(f"a shorter --max-context than {context}")
    ways.append("raise the cgroup's limit (MemoryMax=)" if "cgroup" in source else "free memory")
    ways.append("lower --c-safe-gib" if c_safe_option else "choose a --profile with a smaller c_safe_gib")
    return "; ".join(ways[:-1]) + f" or {ways[-1]}"


PART_NAMES = {
    "language_weights_bytes": "language weights",
    "vision_weights_bytes": "vision tower",
    "kv_cache_bytes": "KV cache",
    "activation_bytes": "activations",
    "io_in_flight_bytes": "reads in flight",
    "prefix_cache_bytes": "prefix cache",
    "pinned_prefix_bytes": "pinned prefix",
    "cache_bytes": "expert cache",
    "reserve_bytes": "reserve (C_safe)",
    "total_bytes": "total",
}


def format_plan(plan: Plan) -> str:
    lines = [
        f"plan for {plan.model_dir} (profile {plan.profile}, device {plan.device}, tier {plan.tier})",
        f"  pinned layers   {plan.pinned_layers} of {plan.moe_layers} MoE layers",
        f"  expert cache    {format_bytes(plan.cache_bytes)} ({plan.cache_experts} experts)",
        f"  memory budget   {format_bytes(plan.memory_budget_bytes)} "
        f"(--memory-budget {plan.memory_budget_bytes} --pinned-layers {plan.pinned_layers} --tier {plan.tier} "
        f"--device {plan.device})",
        f"  prefetch depth  {plan.prefetch_depth}",
        f"  prefix cache    {format_bytes(plan.prefix_cache_bytes)} (--prefix-cache-bytes {plan.prefix_cache_bytes})",
        f"  memory          {format_bytes(plan.m_avail_bytes)} available ({plan.m_avail_source}), spent on:",
    ]
    lines += [f"    {PART_NAMES[name]:<17} {format_bytes(value)}" for name, value in plan.memory_parts.items()]
    lines += [f"warning: {w}" for w in plan.warnings]
    lines.append("why:")
    lines += [f"  - {reason}" for reason in plan.why]
    return "\n".join(lines)
