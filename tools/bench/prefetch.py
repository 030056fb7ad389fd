#!/usr/bin/env python3
"""How fast can N random 9 MiB "experts" of a shard file be made resident, cold, by each prefetch method?

Each trial picks N distinct expert slots at random; each method starts from an evicted page cache
(MADV_DONTNEED + POSIX_FADV_DONTNEED, checked with mincore) and runs until every page of the experts is
resident. Prints a markdown table of median MB/s (requested bytes / time, MB = 10^6 B) and the bytes really
read (this process's /proc/self/io read_bytes, and the block device's sectors read), or JSON with --json.

    python tools/bench/prefetch.py --size 2GiB --experts 32 --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from vismmoe_edge.experts import pagecache as pc
from vismmoe_edge.hardware.system import kernel_release

MIB = 1 << 20
Ranges = list[tuple[int, int]]


@dataclass
class Sample:
    method: str
    trial: int
    seconds: float
    requested_bytes: int  # page spans of the experts
    read_bytes: int  # /proc/self/io read_bytes delta
    device_read_bytes: int | None  # block device sectors read delta (whole device: includes other readers)
    resident_fraction: float  # of the experts' pages, at the end
    filled_bytes: int = 0  # pages a hint left out, then pread

    @property
    def mb_per_s(self) -> float:
        return self.requested_bytes / self.seconds / 1e6


# --------------------------------------------------------------------------------------------------
# Methods: each makes the ranges resident (or tries to) and returns when done
# --------------------------------------------------------------------------------------------------


def copy_through_mapping(mf: pc.MappedFile, ranges: Ranges) -> None:
    """Copy each expert out of the mapping, as the store does: page faults do the reading."""
    dest = bytearray(max(n for _, n in ranges))
    view = memoryview(mf.buffer)
    try:
        for offset, length in ranges:
            dest[:length] = view[offset : offset + length]
    finally:
        view.release()


def fault_default(mf: pc.MappedFile, ranges: Ranges) -> None:
    mf.set_normal()  # the kernel's read-around on faults
    copy_through_mapping(mf, ranges)


def fault_random(mf: pc.MappedFile, ranges: Ranges) -> None:
    copy_through_mapping(mf, ranges)  # MADV_RANDOM: one page per fault


def willneed_chunked(mf: pc.MappedFile, ranges: Ranges) -> dict:
    """Chunked hints, a mincore wait until residency stops growing, then pread of any page a hint left out."""
    pc.prefetch_madvise(mf, ranges)  # chunks of the device's hint chunk
    pc.wait_resident(mf, ranges, timeout=60.0, poll=0.0005, stall=0.2)
    return {"filled_bytes": pc.ensure_resident(mf, ranges)}


def populate(mf: pc.MappedFile, ranges: Ranges) -> None:
    pc.prefetch_populate(mf, ranges)


def pread_pool(threads: int, chunk: int) -> Callable[[pc.MappedFile, Ranges], None]:
    def run(mf: pc.MappedFile, ranges: Ranges) -> None:
        pc.prefetch_pread(mf, ranges, threads=threads, chunk_bytes=chunk)

    return run


def read_into_buffers(threads: int, count: int, expert_bytes: int) -> Callable[[pc.MappedFile, Ranges], None]:
    """pread into caller buffers (the runtime's path into pinned host tensors), allocated and touched beforehand."""
    buffers = [np.ones(expert_bytes, dtype=np.uint8) for _ in range(count)]

    def run(mf: pc.MappedFile, ranges: Ranges) -> None:
        pc.read_into(mf, ranges, buffers[: len(ranges)], threads=threads, chunk_bytes=2 * MIB)

    return run


def willneed_single(mf: pc.MappedFile, ranges: Ranges) -> dict:
    """One WILLNEED per expert, clamped at max(read_ahead_kb, max_sectors_kb): it never completes.

    Returns the time until residency stopped growing (it is then watched for 50 ms more).
    """
    start = time.perf_counter()
    pc.prefetch_madvise(mf, ranges, chunk_bytes=0)
    last, changed = -1, time.perf_counter()
    while time.perf_counter() - changed < 0.05:
        now = sum(pc.resident_pages(mf, ranges))
        if now != last:
            last, changed = now, time.perf_counter()
        time.sleep(0.0005)
    return {"seconds": changed - start}


# A method may return {"seconds": time to count instead of all, "filled_bytes": holes pread after a hint}.
Method = Callable[[pc.MappedFile, Ranges], "dict | None"]


def methods(mf: pc.MappedFile, count: int, expert_bytes: int) -> dict[str, Method]:
    chunk_kib = mf.hint_chunk >> 10
    table: dict[str, Method] = {
        "(a) faults, default readahead": fault_default,
        "(b) faults, MADV_RANDOM": fault_random,
        f"(c) WILLNEED in {chunk_kib} KiB chunks + mincore wait": willneed_chunked,
    }
    for threads in (1, 2, 4, 8, 16):
        plural = "s" if threads > 1 else ""
        table[f"(d) pread pool, {threads} thread{plural}, 2 MiB pieces"] = pread_pool(threads, 2 * MIB)
    table["(d) pread pool, 8 threads, 1 MiB pieces"] = pread_pool(8, MIB)
    table["(d) pread pool, 8 threads, whole experts"] = pread_pool(8, 0)
    table["(d) read_into buffers, 8 threads, 2 MiB pieces"] = read_into_buffers(8, count, expert_bytes)
    table["(e) one WILLNEED per expert (clamped)"] = willneed_single
    if pc.madvise_features()["MADV_POPULATE_READ"]:
        table[f"(f) WILLNEED + POPULATE_READ, {chunk_kib} KiB chunks"] = populate
    return table


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


def proc_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def device_stat_path(path: Path) -> Path | None:
    """/sys/.../stat of the device (or partition) holding ``path``."""
    st = os.stat(path)
    stat = Path("/sys/dev/block") / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" / "stat"
    return stat if os.major(st.st_dev) and stat.is_file() else None


def device_read_bytes(stat: Path | None) -> int | None:
    return None if stat is None else int(stat.read_text().split()[2]) * 512  # field 3: sectors read


def make_file(path: Path, size: int) -> None:
    """Random bytes (incompressible), written once and reused while the size matches."""
    if path.exists() and path.stat().st_size == size:
        return
    rng = np.random.default_rng(0)
    block = 64 * MIB
    with open(path, "wb") as f:
        for done in tqdm(range(0, size, block), desc=f"writing {path}", unit="block", leave=False):
            f.write(rng.integers(0, 256, min(block, size - done), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())


def evict(mf: pc.MappedFile) -> None:
    mf.set_random()
    for _ in range(100):
        pc.release(mf, [(0, mf.size)])
        if pc.resident_pages(mf, [(0, mf.size)]) == [0]:
            return
        time.sleep(0.01)
    raise RuntimeError(f"could not evict {mf.path} from the page cache")


def pick_experts(rng: random.Random, size: int, count: int, expert_bytes: int) -> Ranges:
    slots = size // expert_bytes
    if count > slots:
        raise SystemExit(f"{count} experts of {expert_bytes} bytes do not fit in {size} bytes")
    return sorted((slot * expert_bytes, expert_bytes) for slot in rng.sample(range(slots), count))


def run_one(mf: pc.MappedFile, name: str, method: Method, ranges: Ranges, trial: int, stat: Path | None) -> Sample:
    evict(mf)
    read0, dev0 = proc_read_bytes(), device_read_bytes(stat)
    start = time.perf_counter()
    extra = method(mf, ranges) or {}
    seconds = extra.get("seconds", time.perf_counter() - start)
    read1, dev1 = proc_read_bytes(), device_read_bytes(stat)
    return Sample(
        method=name,
        trial=trial,
        seconds=seconds,
        requested_bytes=sum(pc.span_pages(ranges)) * pc.PAGE_SIZE,
        read_bytes=read1 - read0,
        device_read_bytes=None if dev0 is None or dev1 is None else dev1 - dev0,
        resident_fraction=pc.resident_fraction(mf, ranges),
        filled_bytes=extra.get("filled_bytes", 0),
    )


def summarise(samples: list[Sample], names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        mine = [s for s in samples if s.method == name]
        speeds = [s.mb_per_s for s in mine]
        dev = [s.device_read_bytes for s in mine if s.device_read_bytes is not None]
        requested = statistics.median(s.requested_bytes for s in mine)
        rows.append(
            {
                "method": name,
                "median_mb_per_s": statistics.median(speeds),
                "min_mb_per_s": min(speeds),
                "max_mb_per_s": max(speeds),
                "median_ms": statistics.median(s.seconds for s in mine) * 1e3,
                "requested_mib": requested / MIB,
                "read_mib": statistics.median(s.read_bytes for s in mine) / MIB,
                "device_read_mib": statistics.median(dev) / MIB if dev else None,
                "resident_fraction": statistics.median(s.resident_fraction for s in mine),
                "filled_kib": sum(s.filled_bytes for s in mine) / 1024,
                "runs_with_holes": sum(s.filled_bytes > 0 for s in mine),
            }
        )
    return rows


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line), platform.processor())
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem = next(line.split()[1] for line in meminfo if line.startswith("MemTotal"))
    return {
        "host": platform.node(),
        "kernel": kernel_release(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_gib": round(int(mem) / (1 << 20), 1),
        "python": platform.python_version(),
    }


def markdown(result: dict) -> str:
    m, cfg = result["machine"], result["config"]
    limits = cfg["device_limits"]
    lines = [
        f"Command: `{result['command']}`",
        "",
        f"- date: {result['date']}",
        f"- machine: {m['cpu']}, {m['cpus']} CPUs, {m['mem_gib']} GiB, kernel {m['kernel']}, Python {m['python']}",
        f"- file: {cfg['path']} ({cfg['size'] / (1 << 30):.2f} GiB, filesystem device "
        + (f"read_ahead_kb {limits[0] >> 10}, max_sectors_kb {limits[1] >> 10})" if limits else "limits unknown)"),
        f"- {cfg['experts']} random experts of {cfg['expert_bytes'] / MIB:g} MiB per trial, {cfg['trials']} trials, "
        f"page cache evicted before each method; backend `{cfg['backend']}`; hint chunk {cfg['hint_chunk'] >> 10} KiB",
        "",
        "| method | median MB/s | range MB/s | median ms | requested MiB | read MiB (/proc/self/io) "
        "| device read MiB | resident after | hint holes filled |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        dev = "-" if r["device_read_mib"] is None else f"{r['device_read_mib']:.0f}"
        holes = f"{r['runs_with_holes']} runs, {r['filled_kib']:.0f} KiB" if r["runs_with_holes"] else "-"
        lines.append(
            f"| {r['method']} | {r['median_mb_per_s']:.0f} | {r['min_mb_per_s']:.0f}–{r['max_mb_per_s']:.0f} "
            f"| {r['median_ms']:.0f} | {r['requested_mib']:.0f} | {r['read_mib']:.0f} | {dev} "
            f"| {100 * r['resident_fraction']:.0f}% | {holes} |"
        )
    return "\n".join(lines)


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, default=Path("/tmp/vismmoe-bench-prefetch.bin"))
    parser.add_argument("--size", type=parse_size, default=parse_size("2GiB"))
    parser.add_argument("--experts", type=int, default=32, help="experts made resident per trial")
    parser.add_argument("--expert-mib", type=float, default=9.0)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=pc.available_backends(), default=pc.backend())
    parser.add_argument("--only", action="append", default=[], help="run methods whose name contains this")
    parser.add_argument("--json", type=Path, help="also write the samples and summary here")
    parser.add_argument("--keep", action="store_true", help="keep the data file")
    args = parser.parse_args(argv)

    pc.set_backend(args.backend)
    make_file(args.path, args.size)
    rng = random.Random(args.seed)
    expert_bytes = int(args.expert_mib * MIB)
    samples: list[Sample] = []
    try:
        with pc.MappedFile(args.path) as mf:
            table = methods(mf, args.experts, expert_bytes)
            names = [n for n in table if not args.only or any(o in n for o in args.only)]
            stat = device_stat_path(args.path)
            with tqdm(total=args.trials * len(names), desc="trials", unit="run") as bar:
                for trial in range(args.trials):
                    ranges = pick_experts(rng, mf.size, args.experts, expert_bytes)
                    for name in rng.sample(names, len(names)):  # a new order each trial
                        bar.set_postfix_str(name[:40])
                        samples.append(run_one(mf, name, table[name], ranges, trial, stat))
                        bar.update()
            evict(mf)
            hint_chunk = mf.hint_chunk
    finally:
        if not args.keep:
            args.path.unlink(missing_ok=True)
    result = {
        "command": shlex.join(["python", "tools/bench/prefetch.py", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "config": {
            "path": str(args.path),
            "size": args.size,
            "experts": args.experts,
            "expert_bytes": expert_bytes,
            "trials": args.trials,
            "backend": args.backend,
            "hint_chunk": hint_chunk,
            "device_limits": pc.device_queue_limits(args.path.parent),
        },
        "rows": summarise(samples, names),
        "samples": [asdict(s) | {"mb_per_s": s.mb_per_s} for s in samples],
    }
    print(markdown(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
