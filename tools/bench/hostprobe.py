"""What the host was doing around one benchmark process: kernel memory counters, CPU time by kind, disk reads.

A benchmark process on a shared 2-core VM can be slowed by things outside it: a neighbour's CPU time, steal by
the hypervisor, reclaim or compaction left over from the previous process, a cold page cache. `snapshot()` reads
the counters that tell these apart, and `delta()` turns two snapshots into what happened between them:

- `/proc/vmstat` (proc(5)): major faults, pages read in, reclaim scans and steals (kswapd vs direct), compaction
  and THP collapse (khugepaged), workingset refaults;
- `/proc/stat`'s first `cpu` line: jiffies of user, nice, system, idle, iowait, irq, softirq, steal for all CPUs;
- `/sys/block/*/stat`: bytes read by all disks (memcgroup.disk_read_bytes);
- the load average and the CPUs' current MHz (gauges, kept as they were at the snapshot).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from bench import memcgroup

VMSTAT_KEYS = (
    "pgmajfault",
    "pgfault",
    "pgpgin",
    "workingset_refault_file",
    "pgscan_kswapd",
    "pgscan_direct",
    "pgsteal_kswapd",
    "pgsteal_direct",
    "allocstall_normal",
    "compact_stall",
    "compact_daemon_wake",
    "thp_collapse_alloc",
    "thp_fault_alloc",
    "nr_free_pages",  # a gauge; its delta is still meaningful (pages freed or taken)
    "nr_file_pages",
)
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
GAUGES = ("loadavg_1m", "cpu_mhz")


def read_vmstat(path: Path = Path("/proc/vmstat")) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        if key in VMSTAT_KEYS:
            out[key] = int(value)
    return out


def read_cpu_jiffies(path: Path = Path("/proc/stat")) -> dict[str, int]:
    """The aggregate `cpu` line of /proc/stat, in USER_HZ ticks (usually 1/100 s)."""
    first = path.read_text().splitlines()[0].split()
    return {name: int(v) for name, v in zip(CPU_FIELDS, first[1:], strict=False)}


def cpu_mhz(path: Path = Path("/proc/cpuinfo")) -> float | None:
    """Mean current MHz over the CPUs, as /proc/cpuinfo reports it (a VM may report a fixed nominal value)."""
    values = [float(line.split(":")[1]) for line in path.read_text().splitlines() if line.startswith("cpu MHz")]
    return sum(values) / len(values) if values else None


def snapshot() -> dict[str, float]:
    snap: dict[str, float] = {"t": time.monotonic(), "disk_read_bytes": memcgroup.disk_read_bytes()}
    snap.update({f"vm.{k}": v for k, v in read_vmstat().items()})
    snap.update({f"cpu.{k}": v for k, v in read_cpu_jiffies().items()})
    snap["loadavg_1m"] = os.getloadavg()[0]
    snap["cpu_mhz"] = cpu_mhz() or 0.0
    return snap


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Counters: after - before (keys in both). Gauges (load, MHz): the value at `before`. CPU jiffies are also
    turned into `cpu_share.<kind>`: that kind's share of all CPU time between the snapshots."""
    out: dict[str, float] = {}
    for key, value in before.items():
        if key not in after:
            continue
        out[key] = value if key in GAUGES else after[key] - value
    cpu = {k.removeprefix("cpu."): out[k] for k in out if k.startswith("cpu.")}
    total = sum(cpu.values())
    if total > 0:
        out.update({f"cpu_share.{k}": round(v / total, 4) for k, v in cpu.items()})
    out["seconds"] = out.pop("t", 0.0)
    return out
