"""The memory cgroup this process runs in: its limit, its usage and how much of that is page cache.

A cgroup counts the page cache a process brings in as well as its anonymous memory (docs/platform-facts.md §1.7), and
past its limit the kernel OOM-kills (v1 `memory.limit_in_bytes`, v2 `memory.max`; systemd's `MemoryMax=` sets
the latter, `MemoryHigh=` throttles below it). So the planner plans within the smaller of MemAvailable and what
the cgroup leaves. Every reader takes `root`, so tests point it at a recorded tree. No torch here: the CLI asks
before it imports anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vismmoe_edge.units import format_bytes

UNLIMITED = 1 << 60  # v1 reports "no limit" as PAGE_COUNTER_MAX * page size (~2^63); v2 as "max"
# What Python, torch and transformers take before any weight loads: 332 MiB peak RSS measured on the 2-core x86
# VM (torch 2.13 CPU, transformers 5.24) when `run` reaches its first model code, plus slack. A limit below this
# cannot even start a command; CUDA builds need more (the CUDA context), which the plan's reserve covers.
STARTUP_BYTES = 400 << 20


@dataclass(frozen=True)
class CgroupMemory:
    version: int  # 1 or 2
    path: Path  # the cgroup's directory
    limit_bytes: int | None  # the tightest limit on the way to the root; None: unlimited
    limit_file: Path | None  # where that limit was read
    usage_bytes: int  # charged now: anonymous memory, page cache, kernel memory
    file_bytes: int  # page cache among the usage
    inactive_file_bytes: int  # page cache not touched lately: the first the kernel reclaims

    @property
    def headroom_bytes(self) -> int | None:
        """What the cgroup still lets this process take without an OOM kill; None when unlimited. Only inactive
        page cache is credited back: active file pages are mapped libraries in use, and mlocked experts are
        unevictable."""
        if self.limit_bytes is None:
            return None
        return max(0, self.limit_bytes - self.usage_bytes + self.inactive_file_bytes)

    def describe(self) -> str:
        if self.limit_bytes is None:
            return f"cgroup v{self.version} {self.path}: no memory limit"
        return (
            f"cgroup v{self.version} limit {format_bytes(self.limit_bytes)} ({self.limit_file}), "
            f"{format_bytes(self.usage_bytes)} charged now ({format_bytes(self.file_bytes)} of it page cache)"
        )


def _cgroup_paths(root: Path, pid: str) -> tuple[str | None, str | None]:
    """(v1 memory controller path, v2 unified path) from /proc/<pid>/cgroup."""
    v1 = v2 = None
    try:
        text = (root / f"proc/{pid}/cgroup").read_text()
    except OSError:
        return None, None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if "memory" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and controllers == "":
            v2 = path
    return v1, v2


def _int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def _stat(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _limited(value: int | None) -> int | None:
    return None if value is None or value >= UNLIMITED else value


def _read_v1(base: Path) -> CgroupMemory | None:
    limit_file = base / "memory.limit_in_bytes"
    usage = _int(base / "memory.usage_in_bytes")
    if usage is None or not limit_file.exists():
        return None
    stat = _stat(base / "memory.stat")
    own = _limited(_int(limit_file))
    # A parent's limit binds too: memory.stat reports the tightest one on the way up.
    hierarchical = _limited(stat.get("hierarchical_memory_limit"))
    if hierarchical is not None and (own is None or hierarchical < own):
        limit, where = hierarchical, base / "memory.stat (hierarchical_memory_limit)"
    else:
        limit, where = own, limit_file if own is not None else None
    file = stat.get("total_cache", stat.get("cache", 0))
    inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return CgroupMemory(1, base, limit, where, usage, file, inactive)


def _read_v2(mount: Path, path: str) -> CgroupMemory | None:
    base = mount / path.lstrip("/")
    usage = _int(base / "memory.current")
    if usage is None:
        return None
    limit, where = None, None
    node = base
    while True:  # memory.max of every ancestor binds; memory.high throttles before it (systemd MemoryHigh=)
        for name in ("memory.max", "memory.high"):
            value = _limited(_int(node / name))
            if value is not None and (limit is None or value < limit):
                limit, where = value, node / name
        if node == mount or mount not in node.parents:
            break
        node = node.parent
    stat = _stat(base / "memory.stat")
    return CgroupMemory(2, base, limit, where, usage, stat.get("file", 0), stat.get("inactive_file", 0))


def read_cgroup_memory(root: Path = Path("/"), pid: str = "self") -> CgroupMemory | None:
    """The memory cgroup of `pid` under `root`, or None where none is readable (not Linux, no controller)."""
    v1, v2 = _cgroup_paths(root, pid)
    mount = root / "sys/fs/cgroup"
    if v1 is not None:
        found = _read_v1(mount / "memory" / v1.lstrip("/"))
        if found is not None:
            return found
    if v2 is not None and (mount / "cgroup.controllers").exists():
        return _read_v2(mount, v2)
    return None


def startup_refusal(root: Path = Path("/"), need: int = STARTUP_BYTES) -> str | None:
    """The one-line reason a loading command cannot start under this cgroup's limit, or None. Asked before torch
    is imported: below this the import alone is OOM-killed and nothing is printed."""
    cg = read_cgroup_memory(root)
    if cg is None or cg.headroom_bytes is None or cg.headroom_bytes >= need:
        return None
    return (
        f"the memory cgroup leaves {format_bytes(cg.headroom_bytes)} ({cg.describe()}), less than the "
        f"{format_bytes(need)} Python, torch and transformers need before any weight loads; raise the limit "
        "(systemd MemoryMax=/MemoryHigh=, or memory.limit_in_bytes on cgroup v1)"
    )
