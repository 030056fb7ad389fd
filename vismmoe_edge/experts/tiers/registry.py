"""Every expert tier by its `--tier` name: what the planner, the options and the loader read of it, and the module
that builds it (imported only when a tier is built, so that `--help` and the planner stay light).

A tier is added by registering a TierKind whose module has `make(store, slots, *, pinned, mirror) -> Tier`
(experts/pipeline.py writes down what a Tier does); nothing else names it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vismmoe_edge.errors import VismmoeError

if TYPE_CHECKING:
    from vismmoe_edge.experts.store import ExpertStore
    from vismmoe_edge.experts.tier import Tier
    from vismmoe_edge.experts.tiers.host_mirror import HostMirror

AUTO = "auto"  # the plan's tier (options.resolve); a bare loader.load: gpu on CUDA, else host


@dataclass(frozen=True)
class TierKind:
    name: str
    summary: str  # what `--tier`'s help says of it
    module: str  # the module whose `make` builds it
    # Where its slots are: "device" (GPU memory: the host tier can mirror them, the memory cgroup does not count
    # them), "host" (RAM the memory cgroup counts), "kernel" (the page cache as the kernel runs it: no slot bound).
    memory: Literal["device", "host", "kernel"]
    # An integrated-GPU tier (CUDA kernels read host memory): its runtime parts are counted at device cuda, and a
    # plan that chose it loads `without_cuda` where torch has no CUDA.
    integrated_gpu: bool = False
    without_cuda: str | None = None

    def build(self, store: ExpertStore, slots: int, *, pinned: int = 0, mirror: HostMirror | None = None) -> Tier:
        return importlib.import_module(self.module).make(store, slots, pinned=pinned, mirror=mirror)


TIERS: dict[str, TierKind] = {}


def register(kind: TierKind) -> TierKind:
    TIERS[kind.name] = kind
    return kind


def tier_kind(name: str) -> TierKind:
    kind = TIERS.get(name)
    if kind is None:
        raise VismmoeError(f"--tier {name!r}: use one of {', '.join(tier_names())}")
    return kind


def tier_names() -> list[str]:
    return [AUTO, *TIERS]


def resolve_auto(name: str, device_type: str) -> str:
    """What "auto" builds when nothing planned it: slots in GPU memory on CUDA, in RAM otherwise."""
    return ("gpu" if device_type == "cuda" else "host") if name == AUTO else name


PACKAGE = "vismmoe_edge.experts.tiers"
register(TierKind("host", "RAM slots", f"{PACKAGE}.host", "host"))
register(TierKind("gpu", "CUDA memory slots", f"{PACKAGE}.gpu", "device"))
register(TierKind("unified", "CPU: the page cache; CUDA: pinned slots the GPU reads in place", f"{PACKAGE}.unified",
                  "host"))  # fmt: skip
register(TierKind("mmap", "the page cache, unmanaged (a baseline)", f"{PACKAGE}.mmap", "kernel"))
register(TierKind("unified-slots", "pinned host slots a CUDA iGPU reads in place", f"{PACKAGE}.igpu_slots", "host",
                  integrated_gpu=True, without_cuda="unified"))  # fmt: skip
register(TierKind("unified-registered", "CUDA: the shards' own pages, registered", f"{PACKAGE}.igpu_registered",
                  "host", integrated_gpu=True, without_cuda="unified"))  # fmt: skip


def tier_help() -> str:
    return "cache: auto (the plan's), " + ", ".join(f"{k.name} ({k.summary})" for k in TIERS.values())
