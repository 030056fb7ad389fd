"""Facts about the host: kernel, madvise support, Jetson board, memory, locked-memory limit, CUDA.

Every reader of a system file takes ``root`` so that tests can point it at a recorded fixture tree
(``tests/fixtures/boards/<board>/``). Optional packages (torch) are imported inside functions, so
importing this module costs nothing.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KernelVersion = tuple[int, int, int]
L4tVersion = tuple[int, int, int]

GIB = 1 << 30

# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

_KERNEL_RELEASE = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def kernel_version(release: str | None = None) -> KernelVersion:
    """(major, minor, patch) of a ``uname -r`` string such as "5.15.148-tegra"; default: this kernel."""
    if release is None:
        release = os.uname().release
    match = _KERNEL_RELEASE.match(release)
    if match is None:
        raise ValueError(f"not a kernel release string: {release!r}")
    return int(match[1]), int(match[2]), int(match[3] or 0)


def kernel_release(root: Path = Path("/")) -> str:
    """``uname -r`` of the system under ``root`` (its proc/sys/kernel/osrelease), else of this process."""
    try:
        return (root / "proc/sys/kernel/osrelease").read_text().strip()
    except OSError:
        return os.uname().release


# --------------------------------------------------------------------------------------------------
# madvise
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MadviseAdvice:
    name: str
    value: int  # Linux uapi value, include/uapi/asm-generic/mman-common.h (also used by arm64 and x86)
    since: KernelVersion | None  # first kernel that accepts it; None = older than any kernel we run on
    use: str


# The four pieces of advice the expert pager uses (docs/platform-facts.md §1.2).
MADVISE_ADVICE: tuple[MadviseAdvice, ...] = (
    MadviseAdvice("MADV_WILLNEED", 3, None, "asynchronous readahead of an expert range"),
    MadviseAdvice("MADV_COLD", 20, (5, 4, 0), "mark evicted experts as first to reclaim"),
    MadviseAdvice("MADV_PAGEOUT", 21, (5, 4, 0), "reclaim evicted experts now (file owner only)"),
    # JetPack 5 ships 5.10, so it lacks POPULATE_READ; JetPack 6 (5.15) has it.
    MadviseAdvice("MADV_POPULATE_READ", 22, (5, 14, 0), "synchronous prefault that reports errors"),
)
_ADVICE_BY_NAME = {advice.name: advice for advice in MADVISE_ADVICE}


def madvise_features(version: KernelVersion | None = None) -> dict[str, bool]:
    """Which of MADVISE_ADVICE the kernel ``version`` accepts (default: this kernel)."""
    if version is None:
        version = kernel_version()
    return {a.name: a.since is None or tuple(version) >= a.since for a in MADVISE_ADVICE}


def mmap_madvise_constants() -> dict[str, bool]:
    """Whether Python's ``mmap`` module names each advice (CPython 3.11 lacks COLD/PAGEOUT/POPULATE_READ)."""
    return {a.name: hasattr(mmap, a.name) for a in MADVISE_ADVICE}


def madvise_value(name: str) -> int:
    """The number to pass to ``mmap.madvise``: the module's constant, else the uapi value.

    Raw ints pass straight through ``mmap.madvise`` (docs/platform-facts.md §1.8), so no ctypes is needed.
    """
    return getattr(mmap, name, _ADVICE_BY_NAME[name].value)


def probe_madvise(value: int) -> bool | None:
    """Ask this kernel whether it knows ``value``: ``madvise(0, 0, value)`` is 0 iff it does (madvise(2)).

    None when libc cannot be reached (not Linux).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise(None, 0, value) == 0


# --------------------------------------------------------------------------------------------------
# Memory and limits
# --------------------------------------------------------------------------------------------------


def read_meminfo(root: Path = Path("/")) -> dict[str, int]:
    """/proc/meminfo as {field: bytes} ("kB" in that file means KiB)."""
    fields: dict[str, int] = {}
    for line in (root / "proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if not parts or not parts[0].isdigit():
            continue
        fields[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return fields


def _meminfo_field(root: Path, field: str) -> int:
    fields = read_meminfo(root)
    if field not in fields:
        raise ValueError(f"{root / 'proc/meminfo'} has no {field} line")
    return fields[field]


def mem_available_bytes(root: Path = Path("/")) -> int:
    """MemAvailable: what we plan from. cudaMemGetInfo counts page cache as used on Orin (platform-facts.md §1.7)."""
    return _meminfo_field(root, "MemAvailable")


def mem_total_bytes(root: Path = Path("/")) -> int:
    return _meminfo_field(root, "MemTotal")


def memlock_limit() -> tuple[int, int]:
    """(soft, hard) RLIMIT_MEMLOCK in bytes; ``resource.RLIM_INFINITY`` means unlimited.

    The 5.10 and 5.15 kernels default to 64 KiB, systemd units to 8 MiB (docs/platform-facts.md §1.6).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return soft, hard


def has_cap_ipc_lock(root: Path = Path("/")) -> bool | None:
    """Whether this process holds CAP_IPC_LOCK (bit 14), which lifts RLIMIT_MEMLOCK; None if unknown."""
    try:
        status = (root / "proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", status, re.MULTILINE)
    return None if match is None else bool(int(match[1], 16) >> 14 & 1)


# --------------------------------------------------------------------------------------------------
# Jetson board
# --------------------------------------------------------------------------------------------------

# "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: ..."
_L4T_RELEASE = re.compile(r"^#\s*R(\d+)\s*\(release\)\s*,\s*REVISION:\s*(\d+)(?:\.(\d+))?", re.MULTILINE)

# L4T major -> JetPack major: r35 = JetPack 5, r36 = 6, r38 = 7 (docs/platform-facts.md §1.1); r34 was the 5.0
# previews and r32 JetPack 4 (jetson-stats' table); r39 is JetPack 7.2, which brings AGX Orin to
# JetPack 7 [R: vendor docs quoting "JetPack 7.2.1 / L4T r39.2.1"].
_JETPACK_MAJOR_FOR_L4T_MAJOR = {32: 4, 34: 5, 35: 5, 36: 6, 38: 7, 39: 7}

# Point releases that ship for Orin, from NVIDIA's JetPack archive as tabulated by jetson-stats
# (jtop/core/jetson_variables.py). Anything else reports only the JetPack major.
_JETPACK_FOR_L4T: dict[L4tVersion, str] = {
    (35, 1, 0): "5.0.2",
    (35, 2, 1): "5.1",
    (35, 3, 1): "5.1.1",
    (35, 4, 1): "5.1.2",
    (35, 5, 0): "5.1.3",
    (35, 6, 0): "5.1.4",
    (35, 6, 1): "5.1.5",
    (36, 2, 0): "6.0 DP",
    (36, 3, 0): "6.0",
    (36, 4, 0): "6.1",
    (36, 4, 3): "6.2",  # the first with the "Super" power modes
    (36, 4, 4): "6.2.1",
    (36, 4, 7): "6.2.1",
}

# Module part numbers (P-numbers) -> (family, nominal GB). They are more trustworthy than the model
# string, which is free text set by the BSP; carrier boards (p3737, p3768) are not listed.
_MODULES: dict[str, tuple[str, int | None]] = {
    "p3701-0000": ("AGX Orin", None),  # devkit module: 32 or 64 GB by devkit revision (docs/platform-facts.md §3.2)
    "p3701-0004": ("AGX Orin", 32),
    "p3701-0005": ("AGX Orin", 64),
    "p3767-0000": ("Orin NX", 16),
    "p3767-0001": ("Orin NX", 8),
    "p3767-0003": ("Orin Nano", 8),
    "p3767-0004": ("Orin Nano", 4),
    "p3767-0005": ("Orin Nano", 8),  # the Orin Nano devkit's module [I]
}

# Devkit model strings name the family but never the memory size: "NVIDIA Jetson AGX Orin Developer
# Kit", "NVIDIA Orin NX Developer Kit" (r35), "NVIDIA Jetson Orin Nano Engineering Reference Developer
# Kit Super" (r36.4.3+). AGX before bare names, so "AGX Orin" never reads as another family.
_FAMILY_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (family, re.compile(pattern, re.IGNORECASE))
    for family, pattern in (
        ("AGX Thor", r"\bAGX\s+Thor\b"),
        ("AGX Orin", r"\bAGX\s+Orin\b"),
        ("Orin NX", r"\bOrin\s+NX\b"),
        ("Orin Nano", r"\bOrin\s+Nano\b"),
        ("AGX Xavier", r"\bAGX\s+Xavier\b"),
        ("Xavier NX", r"\bXavier\s+NX\b"),
    )
)

# Firmware carve-outs hide a few percent of DRAM: an 8 GB Orin Nano shows MemTotal 7.4 GiB, a 64 GB
# AGX Orin 61.4 GiB, a 32 GB AGX Orin 29 GiB.
_NOMINAL_MEMORY_GB = (4, 8, 16, 32, 64, 128)
_SMALLEST_VISIBLE_FRACTION = 0.75


@dataclass(frozen=True)
class JetsonBoard:
    model: str  # /proc/device-tree/model without its trailing NUL; "" when absent (some containers)
    family: str | None  # "AGX Orin", "Orin NX", "Orin Nano", ...
    memory_gb: int | None  # nominal module memory
    super_variant: bool  # a JetPack 6.2 "Super" device tree
    part_number: str | None  # module P-number from /proc/device-tree/compatible, when present
    l4t: L4tVersion | None  # from /etc/nv_tegra_release
    jetpack_major: int | None
    jetpack: str | None  # "6.2.1" when the L4T point release is known

    @property
    def module(self) -> str | None:
        """Normalised module name, e.g. "AGX Orin 64GB"; just the family when the size is unknown."""
        if self.family is None:
            return None
        return self.family if self.memory_gb is None else f"{self.family} {self.memory_gb}GB"

    @property
    def l4t_version(self) -> str | None:
        return None if self.l4t is None else ".".join(map(str, self.l4t))

    def describe(self) -> str:
        name = self.module or self.model or "unknown Jetson"
        if self.super_variant and self.module:
            name += " (Super)"
        release = "L4T unknown" if self.l4t is None else f"L4T {self.l4t_version}"
        jetpack = self.jetpack or self.jetpack_major
        return f"{name}, {release}" + (f", JetPack {jetpack}" if jetpack else "")


def parse_l4t_release(text: str) -> L4tVersion | None:
    """The L4T version in /etc/nv_tegra_release text, e.g. (36, 4, 3); None if there is none."""
    match = _L4T_RELEASE.search(text)
    if match is None:
        return None
    return int(match[1]), int(match[2]), int(match[3] or 0)


def jetpack_for_l4t(l4t: L4tVersion) -> tuple[int | None, str | None]:
    """(JetPack major, JetPack point release or None) for an L4T version."""
    return _JETPACK_MAJOR_FOR_L4T_MAJOR.get(l4t[0]), _JETPACK_FOR_L4T.get(tuple(l4t))


def nominal_memory_gb(mem_total: int) -> int | None:
    """The module size (GB) that a MemTotal in bytes comes from, or None if it fits none."""
    for size in _NOMINAL_MEMORY_GB:
        if mem_total <= size * GIB:
            return size if mem_total >= _SMALLEST_VISIBLE_FRACTION * size * GIB else None
    return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError:
        return None


def _module_part_number(compatible: str) -> str | None:
    # NUL-separated, e.g. "nvidia,p3768-0000+p3767-0005\0nvidia,p3767-0005\0nvidia,tegra234\0".
    for part in re.findall(r"p\d{4}-\d{4}", compatible):
        if part in _MODULES:
            return part
    return None


def _family_from_model(model: str) -> str | None:
    for family, pattern in _FAMILY_PATTERNS:
        if pattern.search(model):
            return family
    return None


def detect_jetson(root: Path = Path("/")) -> JetsonBoard | None:
    """The Jetson under ``root``, or None on anything else (x86 desktops, other ARM boards)."""
    model_text = _read_text(root / "proc/device-tree/model")
    release_text = _read_text(root / "etc/nv_tegra_release")
    model = (model_text or "").replace("\x00", "").strip()
    l4t = parse_l4t_release(release_text) if release_text else None
    looks_like_jetson = re.search(r"\b(jetson|nvidia)\b", model, re.IGNORECASE) is not None
    if l4t is None and not looks_like_jetson:
        return None

    compatible = _read_text(root / "proc/device-tree/compatible") or ""
    part_number = _module_part_number(compatible)
    family, memory_gb = _MODULES.get(part_number, (None, None)) if part_number else (None, None)
    family = family or _family_from_model(model)
    if memory_gb is None and family is not None:
        try:
            memory_gb = nominal_memory_gb(mem_total_bytes(root))
        except (OSError, ValueError):
            memory_gb = None
    super_variant = bool(re.search(r"\bSuper\b", model)) or any(
        entry.endswith("-super") for entry in compatible.split("\x00")
    )
    jetpack_major, jetpack = jetpack_for_l4t(l4t) if l4t else (None, None)
    return JetsonBoard(
        model=model,
        family=family,
        memory_gb=memory_gb,
        super_variant=super_variant,
        part_number=part_number,
        l4t=l4t,
        jetpack_major=jetpack_major,
        jetpack=jetpack,
    )


# --------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------


def cuda_info() -> dict[str, Any]:
    """What torch sees: {"torch", "cuda_version", "available", "device_count", "devices", "error"}.

    Never raises; "error" says why the answer is empty (torch missing, a broken driver).
    """
    info: dict[str, Any] = {
        "torch": None,
        "cuda_version": None,
        "available": False,
        "device_count": 0,
        "devices": [],
        "error": None,
    }
    try:
        import torch
    except Exception as exc:  # an ImportError, or a broken install raising anything else
        info["error"] = f"torch is not importable: {type(exc).__name__}: {exc}"
        return info
    try:
        info["torch"] = str(torch.__version__)
        info["cuda_version"] = torch.version.cuda
        if torch.cuda.is_available():
            info["available"] = True
            info["device_count"] = torch.cuda.device_count()
            for index in range(info["device_count"]):
                props = torch.cuda.get_device_properties(index)
                info["devices"].append(
                    {
                        "index": index,
                        "name": props.name,
                        "total_memory": props.total_memory,
                        "capability": (props.major, props.minor),
                        "integrated": bool(getattr(props, "is_integrated", False)),
                    }
                )
    except Exception as exc:  # cuInit failures and driver mismatches surface here
        info["error"] = f"{type(exc).__name__}: {exc}"
    return info
