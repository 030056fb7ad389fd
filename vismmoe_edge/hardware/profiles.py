"""Hardware profiles (vismmoe_edge/profiles/*.toml) and choosing one: by name, or ``auto``.

``auto`` keys a Jetson by (module, power-mode NAME) and checks the mode's parsed limits, never the numeric
mode id (docs/platform-facts.md §3.3). A mode our profiles lack falls back to the closest profile by limits,
with a warning. Off a Jetson: ``desktop-gpu`` when CUDA works, else ``cpu``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware import nvpmodel, system
from vismmoe_edge.hardware.nvpmodel import ModeLimits

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (JetPack 6's system Python): the tomli backport, a dependency there
    import tomli as tomllib

KINDS = ("jetson", "desktop-gpu", "cpu")
REQUIRED: dict[str, tuple[str, ...]] = {
    "profile": ("name", "kind", "description"),
    "planner": ("l_semantic", "c_safe_gib", "prefetch_depth", "unified_memory"),
}
REQUIRED_JETSON: dict[str, tuple[str, ...]] = {
    "board": ("module", "super_variant", "part_number", "conf", "memory_gb", "dram_bandwidth_gbs", "cpu_cores"),
    "mode": (
        "name",
        "id",
        "default",
        "cpu_online",
        "cpu_max_freq_mhz",
        "gpu_max_freq_mhz",
        "gpu_tpcs",
        "tpc_pg_mask",
        "emc_max_freq_mhz",
        "dram_bandwidth_gbs",
    ),
}
_MHZ_TOLERANCE = 0.5  # confs give kHz/Hz; profiles MHz with one decimal


@dataclass(frozen=True)
class PlannerInputs:
    l_semantic: int  # lowest pinned-prefix depth (MoE layers)
    c_safe_gib: float  # OS + runtime headroom kept out of the available memory
    prefetch_depth: int  # MoE layers fetched ahead of compute
    unified_memory: bool  # plan from MemAvailable (True) or from free GPU memory (False)


@dataclass(frozen=True)
class Profile:
    name: str
    kind: str  # "jetson", "desktop-gpu" or "cpu"
    description: str
    planner: PlannerInputs
    module: str | None = None  # "Orin NX 16GB": system.JetsonBoard.module
    super_variant: bool = False
    memory_gb: int | None = None
    dram_bandwidth_gbs: float | None = None  # the module's peak
    mode_name: str | None = None  # exactly as in nvpmodel.conf
    mode_default: bool = False
    limits: ModeLimits | None = None
    mode_bandwidth_gbs: float | None = None  # implied by the mode's EMC cap

    @property
    def tier(self) -> str:
        """The loader's tier: cache slots in GPU memory on a discrete GPU, the page cache elsewhere."""
        return "unified" if self.planner.unified_memory else "gpu"


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _uncapped(value: float) -> float | None:
    return None if value < 0 else float(value)  # -1 = no cap, as in the conf (docs/platform-facts.md §3.2)


def profile_from_dict(data: dict[str, Any], source: str) -> Profile:
    """Validate one parsed TOML document; VismmoeError naming ``source`` and the missing field."""
    required = dict(REQUIRED)
    if data.get("profile", {}).get("kind") == "jetson":
        required.update(REQUIRED_JETSON)
    for table, keys in required.items():
        missing = [k for k in keys if k not in data.get(table, {})]
        if missing:
            raise VismmoeError(f"profile {source}: [{table}] lacks {', '.join(missing)}")
    head, plan = data["profile"], data["planner"]
    if head["kind"] not in KINDS:
        raise VismmoeError(f"profile {source}: kind {head['kind']!r} is not one of {', '.join(KINDS)}")
    planner = PlannerInputs(
        l_semantic=int(plan["l_semantic"]),
        c_safe_gib=float(plan["c_safe_gib"]),
        prefetch_depth=int(plan["prefetch_depth"]),
        unified_memory=bool(plan["unified_memory"]),
    )
    if head["kind"] != "jetson":
        return Profile(head["name"], head["kind"], head["description"], planner)
    board, mode = data["board"], data["mode"]
    limits = ModeLimits(
        cpu_online=int(mode["cpu_online"]),
        cpu_max_freq_mhz=_uncapped(mode["cpu_max_freq_mhz"]),
        gpu_max_freq_mhz=_uncapped(mode["gpu_max_freq_mhz"]),
        gpu_tpcs=int(mode["gpu_tpcs"]),
        emc_max_freq_mhz=_uncapped(mode["emc_max_freq_mhz"]),
    )
    return Profile(
        name=head["name"],
        kind="jetson",
        description=head["description"],
        planner=planner,
        module=board["module"],
        super_variant=bool(board["super_variant"]),
        memory_gb=int(board["memory_gb"]),
        dram_bandwidth_gbs=float(board["dram_bandwidth_gbs"]),
        mode_name=mode["name"],
        mode_default=bool(mode["default"]),
        limits=limits,
        mode_bandwidth_gbs=float(mode["dram_bandwidth_gbs"]),
    )


@lru_cache(maxsize=1)
def load_profiles() -> dict[str, Profile]:
    """Every profile shipped in the package, by name (the file name without .toml)."""
    folder = resources.files("vismmoe_edge") / "profiles"
    profiles: dict[str, Profile] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml"):
            continue
        try:
            data = tomllib.loads(entry.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise VismmoeError(f"profile {entry.name}: {e}") from e
        profile = profile_from_dict(data, entry.name)
        if profile.name != entry.name[: -len(".toml")]:
            raise VismmoeError(f"profile {entry.name}: [profile] name is {profile.name!r}, not the file name")
        profiles[profile.name] = profile
    return profiles


def profile_names() -> list[str]:
    return sorted(load_profiles())


def _names_hint() -> str:
    return "auto or one of " + ", ".join(profile_names())


def get_profile(name: str) -> Profile:
    try:
        return load_profiles()[name]
    except KeyError:
        raise VismmoeError(f"unknown profile {name!r}: use {_names_hint()}") from None


# --------------------------------------------------------------------------------------------------
# Matching
# --------------------------------------------------------------------------------------------------

_LIMIT_FIELDS = tuple(f.name for f in fields(ModeLimits))


def limit_differences(running: ModeLimits, profile: ModeLimits) -> list[str]:
    """'field conf vs profile' for each limit that differs (None = no cap)."""
    diffs = []
    for name in _LIMIT_FIELDS:
        a, b = getattr(running, name), getattr(profile, name)
        if a is None and b is None:
            continue
        if a is None or b is None or abs(a - b) > _MHZ_TOLERANCE:
            diffs.append(f"{name} {'max' if a is None else f'{a:g}'} vs {'max' if b is None else f'{b:g}'}")
    return diffs


def limits_distance(a: ModeLimits, b: ModeLimits) -> float:
    """Sum over cores, CPU/GPU/EMC caps and TPCs of the relative difference; uncapped vs capped costs 0.5."""
    total = 0.0
    for name in _LIMIT_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if x is None and y is None:
            continue
        if x is None or y is None:
            total += 0.5  # the hardware maximum is not in our tables (docs/platform-facts.md §3.2: unverified)
        elif max(x, y) > 0:
            total += abs(x - y) / max(x, y)
    return total


def _non_jetson(cuda_available: bool | None) -> tuple[Profile, str, list[str]]:
    if cuda_available is None:
        info = system.cuda_info()
        cuda_available, detail = info["available"], info["error"] or ""
    else:
        detail = ""
    if cuda_available:
        return get_profile("desktop-gpu"), "not a Jetson; CUDA is available: desktop-gpu", []
    why = "not a Jetson; CUDA is not available" + (f" ({detail})" if detail else "") + ": cpu"
    return get_profile("cpu"), why, []


def select_profile(
    name_or_auto: str = "auto", root: Path = Path("/"), *, cuda_available: bool | None = None
) -> tuple[Profile, str, list[str]]:
    """(profile, one-line reason, warnings). ``cuda_available`` None = ask torch (lazily, off-Jetson only)."""
    if name_or_auto != "auto":
        return get_profile(name_or_auto), f"--profile {name_or_auto}", []
    board = system.detect_jetson(root)
    if board is None:
        return _non_jetson(cuda_available)
    try:
        mode = nvpmodel.running_mode(root)
        conf = mode.conf if mode is not None else nvpmodel.read_conf(root)
    except VismmoeError as e:
        raise VismmoeError(f"{e} ({_names_hint()})") from None
    warnings = list(mode.notes) if mode is not None else []
    is_super = board.super_variant or (conf is not None and conf.is_super)
    jetsons = [p for p in load_profiles().values() if p.kind == "jetson"]
    same_board = [p for p in jetsons if p.module == board.module and p.super_variant == is_super]
    board_text = f"{board.describe()}{' (Super conf)' if is_super and not board.super_variant else ''}"
    if not same_board:
        warnings.append(f"no profiles for {board_text}: choosing among all Jetson profiles by limits")

    if mode is None:
        defaults = [p for p in same_board if p.mode_default]
        if not defaults:
            raise VismmoeError(f"cannot read the power mode of {board_text}: pass --profile ({_names_hint()})")
        warnings.append(f"no power mode readable (no {root / nvpmodel.CONF_PATH}): assuming the default mode")
        return defaults[0], f"{board_text}; power mode unknown, module default {defaults[0].mode_name}", warnings

    mode_text = f"power mode {mode.name} (from {mode.source})"
    named = [p for p in same_board if p.mode_name == mode.name]
    if named:
        profile = named[0]
        if mode.limits is not None and profile.limits is not None:
            diffs = limit_differences(mode.limits, profile.limits)
            if diffs:  # same name, other limits: another L4T release (docs/platform-facts.md §3.3)
                warnings.append(
                    f"{mode.name}'s limits differ from {profile.name} (conf vs profile): {'; '.join(diffs)}"
                )
        return profile, f"{board_text}; {mode_text}: matched by module and mode name", warnings

    if mode.limits is None:
        raise VismmoeError(f"{mode_text} is not in our profiles and its limits are unreadable: use {_names_hint()}")
    candidates = same_board or jetsons
    ranked = sorted(candidates, key=lambda p: (limits_distance(mode.limits, p.limits), p.name))  # type: ignore[arg-type]
    profile = ranked[0]
    distance = limits_distance(mode.limits, profile.limits)  # type: ignore[arg-type]
    warnings.append(
        f"{mode_text} is not in our profiles; closest by limits ({mode.limits.describe()}) is {profile.name} "
        f"(distance {distance:.2f}); pass --profile NAME to choose another"
    )
    return profile, f"{board_text}; {mode_text}: fell back to the closest profile by limits", warnings
