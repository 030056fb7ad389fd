#!/usr/bin/env python3
"""Run a command under a cgroup-v1 memory cap that includes its page cache; evict files from the page cache.

A memory cgroup created by root on cgroup v1 charges a process's anonymous memory *and* the page cache it brings
in (docs/platform-facts.md §1.7), so it emulates a device whose whole DRAM is `limit` (e.g. a Jetson's unified memory)
on a bigger machine. Here:

- `MemoryCgroup(name, limit)`: a context manager that creates `<parent>/vismmoe-bench-<name>` under the v1
  memory hierarchy, sets `memory.limit_in_bytes` (and `memory.memsw.limit_in_bytes` to the same value where it
  exists, so swap cannot stretch the cap), runs commands inside it (`run`), and on exit empties and removes it.
  `parent` defaults to the caller's own memory cgroup (read from /proc/self/cgroup), so the capped child stays
  inside whatever hierarchy already accounts for the caller; pass `parent="/"` for
  `/sys/fs/cgroup/memory/vismmoe-bench-<name>`.
- `run_capped(cmd, limit, evict=...)`: the one-call form; returns a `CappedRun` with the exit status, the peak
  charge (`memory.max_usage_in_bytes`), `memory.failcnt` (limit hits; 0 on some kernels even at the cap), the OOM kills
  (`memory.oom_control` `oom_kill`), `memory.stat` at exit, the child's own block reads (`read_bytes` from its
  rusage: `ru_inblock` x 512, i.e. its /proc/<pid>/io `read_bytes`, descendants it waited for included) and the
  block-device read delta over the run (`disk_read_bytes`, /sys/block/*/stat, all processes).
- `evict_page_cache(paths)`: fdatasync + posix_fadvise(POSIX_FADV_DONTNEED) on each file. Pages that some process
  has mapped or locked stay; `resident_bytes(paths)` (mincore) tells what is still cached.

CLI:  python tools/bench/memcgroup.py --limit 4GiB --evict FILE... -- CMD ARGS
      (`--limit 40%` means 40% of the total size of the --evict files; `--json` prints the result as JSON.)
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
PREFIX = "vismmoe-bench-"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}
_SKIP_DEVICES = re.compile(r"^(loop|ram|zram|sr|fd|nbd)\d*")


class CgroupUnavailable(RuntimeError):
    """No writable cgroup-v1 memory controller (not root, cgroup v2 only, or the controller is missing)."""


def parse_size(text: str | int, *, whole: int | None = None) -> int:
    """'4GiB', '512MiB', '6.14GB', '1234' (bytes) or '40%' (of `whole`) -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower().replace(" ", "")
    if s.endswith("%"):
        if whole is None:
            raise ValueError(f"{text!r}: a percentage needs a total (e.g. --evict files)")
        return int(float(s[:-1]) / 100 * whole)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", s)
    if not m or m[2] not in _UNITS:
        raise ValueError(f"bad size {text!r}")
    return int(float(m[1]) * _UNITS[m[2]])


def memory_cgroup_support() -> tuple[bool, str]:
    """(usable, why): can this process create capped v1 memory cgroups here?"""
    if os.geteuid() != 0:
        return False, "not root: creating cgroups needs root"
    if not (MEMORY_ROOT / "memory.limit_in_bytes").exists():
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists():
            return False, "only cgroup v2 here (memory.max); this tool drives the v1 memory controller"
        return False, f"no cgroup v1 memory controller mounted at {MEMORY_ROOT}"
    parent = own_memory_cgroup()
    if not os.access(parent, os.W_OK):
        return False, f"{parent} is not writable"
    return True, f"cgroup v1 memory controller at {MEMORY_ROOT}; parent {parent}"


def own_memory_cgroup(pid: int | str = "self") -> Path:
    """The v1 memory cgroup directory of `pid` (default: this process)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return MEMORY_ROOT / path.lstrip("/")
    return MEMORY_ROOT


def _read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def _read_kv(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        k, _, v = line.partition(" ")
        if v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


def block_devices() -> list[str]:
    """Whole disks under /sys/block that are not loop/ram/zram/optical devices."""
    return sorted(d for d in os.listdir("/sys/block") if not _SKIP_DEVICES.match(d))


def disk_read_bytes(devices: Iterable[str] | None = None) -> int:
    """Bytes read so far from `devices` (default: all real disks), from /sys/block/<dev>/stat sectors read."""
    total = 0
    for dev in devices if devices is not None else block_devices():
        fields = Path(f"/sys/block/{dev}/stat").read_text().split()
        total += int(fields[2]) * 512  # field 3: sectors read, always in 512-byte units
    return total


def proc_read_bytes(pid: int | str = "self") -> int:
    """`read_bytes` of /proc/<pid>/io: bytes this process caused to be read from storage."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/io has no read_bytes")


def readahead_settings() -> dict[str, dict[str, int]]:
    """read_ahead_kb and max_sectors_kb of each real disk (page-fault reads are sized by these)."""
    out = {}
    for dev in block_devices():
        q = Path(f"/sys/block/{dev}/queue")
        out[dev] = {k: _read_int(q / k) for k in ("read_ahead_kb", "max_sectors_kb") if (q / k).exists()}
    return out


def evict_page_cache(paths: Iterable[str | os.PathLike]) -> int:
    """Drop each file's clean pages from the page cache (fdatasync, then POSIX_FADV_DONTNEED). Returns bytes covered.

    Only pages nobody maps or locks can go; check with `resident_bytes`.
    """
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            try:
                os.fdatasync(fd)  # dirty pages cannot be dropped; a freshly written checkpoint has many
            except OSError:
                pass
            size = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += size
        finally:
            os.close(fd)
    return total


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mincore.restype = ctypes.c_int
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident_bytes(paths: Iterable[str | os.PathLike]) -> int:
    """Bytes of the files' pages now in the page cache (mincore over a fresh read-only mapping)."""
    page = mmap.PAGESIZE
    total = 0
    chunk = 1 << 30
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for off in range(0, size, chunk):
                length = min(chunk, size - off)
                addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap {p}")
                try:
                    n = (length + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if _libc.mincore(addr, length, vec) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore {p}")
                    total += bytes(vec).count(1) * page  # bit 0 = resident; the rest are reserved (0)
                finally:
                    _libc.munmap(addr, length)
        finally:
            os.close(fd)
    return total


@dataclass
class CappedRun:
    """What happened to one command run inside a capped memory cgroup."""

    cmd: list[str]
    returncode: int
    limit_bytes: int
    max_usage_bytes: int  # memory.max_usage_in_bytes: peak charge (anonymous + page cache + kernel)
    failcnt: int  # memory.failcnt: limit hits (stays 0 on kernel 6.18 here even at the cap)
    oom_kills: int  # memory.oom_control "oom_kill": processes the cgroup OOM killer killed
    read_bytes: int  # the child's own storage reads (rusage ru_inblock x 512)
    disk_read_bytes: int  # reads of all real disks during the run (any process)
    wall_s: float
    cgroup: str
    stat: dict[str, int] = field(default_factory=dict)  # memory.stat at exit (cache, rss, mapped_file, ...)
    evicted_bytes: int = 0
    resident_after_evict: int = 0
    stdout: str | None = None
    stderr: str | None = None

    @property
    def oom_killed(self) -> bool:
        return self.oom_kills > 0 or self.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)

    def summary(self) -> str:
        gib = 1 << 30
        return (
            f"rc={self.returncode} limit={self.limit_bytes / gib:.3f} GiB peak={self.max_usage_bytes / gib:.3f} GiB "
            f"failcnt={self.failcnt} oom_kills={self.oom_kills} read={self.read_bytes / 1e9:.3f} GB "
            f"disk_read={self.disk_read_bytes / 1e9:.3f} GB wall={self.wall_s:.2f}s"
        )

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["oom_killed"] = self.oom_killed
        return d


class MemoryCgroup:
    """A v1 memory cgroup with a hard cap, created on enter and removed (after emptying) on exit.

    >>> with MemoryCgroup("demo", "4GiB") as cg:
    ...     r = cg.run(["python", "bench.py"])
    """

    def __init__(
        self,
        name: str | None = None,
        limit: int | str | None = "4GiB",
        *,
        parent: str | os.PathLike | None = None,
        swap: bool = False,
        drop_cache_on_exit: bool = True,
    ) -> None:
        self.name = PREFIX + (name or uuid.uuid4().hex[:8])
        self.limit = parse_size(limit) if limit is not None else None  # None: no cap, only accounting
        if parent is None:
            self.parent = own_memory_cgroup()
        else:
            self.parent = MEMORY_ROOT / str(parent).lstrip("/") if not str(parent).startswith(str(MEMORY_ROOT)) \
                else Path(parent)
        self.path = self.parent / self.name
        self.swap = swap
        # On removal, v1 moves the group's remaining page-cache charges to the parent (pages stay cached);
        # force_empty reclaims them instead. Keep them (False) when the next run should find a warm cache.
        self.drop_cache_on_exit = drop_cache_on_exit
        self._created = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    def create(self) -> MemoryCgroup:
        ok, why = memory_cgroup_support()
        if not ok:
            raise CgroupUnavailable(why)
        if self.path.exists():
            self._remove_dir()  # a leftover from a crashed run of ours (same name)
        self.path.mkdir()
        self._created = True
        if self.limit is None:
            self.limit = _read_int(self.path / "memory.limit_in_bytes")
            return self
        self._write("memory.limit_in_bytes", self.limit)
        if (self.path / "memory.memsw.limit_in_bytes").exists() and not self.swap:
            self._write("memory.memsw.limit_in_bytes", self.limit)  # memory+swap = memory: no swapping out of it
        if (self.path / "memory.swappiness").exists() and not self.swap:
            try:
                self._write("memory.swappiness", 0)
            except OSError:
                pass
        got = _read_int(self.path / "memory.limit_in_bytes")
        if got > self.limit or got < self.limit - (1 << 20):
            raise RuntimeError(f"{self.path}: asked for limit {self.limit}, the kernel set {got}")
        self.limit = got  # rounded down to a page multiple by the kernel
        return self

    def remove(self) -> None:
        if self._created and self.path.exists():
            self._remove_dir()
        self._created = False

    def _remove_dir(self) -> None:
        procs = [p for p in (self.path / "cgroup.procs").read_text().split()]
        parent_procs = self.parent / "cgroup.procs"
        for pid in procs:  # processes still inside (e.g. a daemon the command left): move them out, not kill
            try:
                parent_procs.write_text(pid)
            except OSError:
                pass
        if self.drop_cache_on_exit:
            try:
                (self.path / "memory.force_empty").write_text("0")  # reclaim its page cache, not reparent it
            except OSError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)
        self.path.rmdir()

    def __enter__(self) -> MemoryCgroup:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # ---- readings -------------------------------------------------------------------------------------
    def _write(self, knob: str, value: int | str) -> None:
        (self.path / knob).write_text(str(value))

    def usage_bytes(self) -> int:
        return _read_int(self.path / "memory.usage_in_bytes")

    def max_usage_bytes(self) -> int:
        return _read_int(self.path / "memory.max_usage_in_bytes")

    def failcnt(self) -> int:
        return _read_int(self.path / "memory.failcnt")

    def oom_kills(self) -> int:
        return _read_kv(self.path / "memory.oom_control").get("oom_kill", 0)

    def stat(self) -> dict[str, int]:
        return _read_kv(self.path / "memory.stat")

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", 0)
        self._write("memory.failcnt", 0)

    # ---- running --------------------------------------------------------------------------------------
    def popen(self, cmd: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Start `cmd` inside the group: the child joins it between fork and exec, before anything is charged."""
        procs = str(self.path / "cgroup.procs")

        def join() -> None:
            fd = os.open(procs, os.O_WRONLY)
            try:
                os.write(fd, b"0")  # "0" = the writing process itself
            finally:
                os.close(fd)

        return subprocess.Popen(list(cmd), preexec_fn=join, **kwargs)  # type: ignore[call-overload]

    def run(
        self,
        cmd: Sequence[str],
        *,
        evict: Iterable[str | os.PathLike] = (),
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        timeout: float | None = None,
        capture_output: bool = False,
    ) -> CappedRun:
        """Evict `evict` from the page cache, reset the peak counters, run `cmd` inside the group, report."""
        evict = list(evict)
        evicted = evict_page_cache(evict) if evict else 0
        resident = resident_bytes(evict) if evict else 0
        self.reset_peak()
        oom_before = self.oom_kills()
        pipe = subprocess.PIPE if capture_output else None
        disk0 = disk_read_bytes()
        t0 = time.perf_counter()
        proc = self.popen(cmd, env=dict(env) if env is not None else None, cwd=cwd, stdout=pipe, stderr=pipe,
                          text=True if capture_output else None)
        out = err = None
        try:
            if capture_output:
                out, err = _communicate_then_wait(proc, timeout)
            rusage = wait_with_rusage(proc, timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rusage = wait_with_rusage(proc, None)
        wall = time.perf_counter() - t0
        disk1 = disk_read_bytes()
        return CappedRun(
            cmd=list(cmd),
            returncode=proc.returncode,
            limit_bytes=self.limit,
            max_usage_bytes=self.max_usage_bytes(),
            failcnt=self.failcnt(),
            oom_kills=self.oom_kills() - oom_before,
            read_bytes=rusage.ru_inblock * 512 if rusage is not None else -1,
            disk_read_bytes=disk1 - disk0,
            wall_s=wall,
            cgroup=str(self.path),
            stat=self.stat(),
            evicted_bytes=evicted,
            resident_after_evict=resident,
            stdout=out,
            stderr=err,
        )


def _communicate_then_wait(proc: subprocess.Popen, timeout: float | None) -> tuple[str, str]:
    # Popen.communicate() would reap the child itself and lose its rusage; pump the pipes here instead so that
    # wait_with_rusage() can reap it.
    import threading

    chunks: dict[str, list[str]] = {"out": [], "err": []}

    def pump(stream, key: str) -> None:
        for piece in iter(lambda: stream.read(65536), ""):
            chunks[key].append(piece)

    threads = [threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True)]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    for t in threads:
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise subprocess.TimeoutExpired(proc.args, timeout or 0)
    return "".join(chunks["out"]), "".join(chunks["err"])


def wait_with_rusage(proc: subprocess.Popen, timeout: float | None):
    """Reap `proc` with wait4 so its rusage (ru_inblock = read_bytes / 512) comes back; set proc.returncode."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        flags = 0 if deadline is None else os.WNOHANG
        pid, status, rusage = os.wait4(proc.pid, flags)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return rusage
        if deadline is not None and time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0)
        time.sleep(0.02)


def run_capped(
    cmd: Sequence[str],
    limit: int | str | None,
    *,
    evict: Iterable[str | os.PathLike] = (),
    name: str | None = None,
    parent: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    capture_output: bool = False,
) -> CappedRun:
    """Create a group capped at `limit` ('40%' = of the evict files' total size), run `cmd` in it, remove it."""
    evict = [Path(p) for p in evict]
    whole = sum(p.stat().st_size for p in evict) if evict else None
    cap = parse_size(limit, whole=whole) if limit is not None else None
    with MemoryCgroup(name, cap, parent=parent) as cg:
        return cg.run(cmd, evict=evict, env=env, cwd=cwd, timeout=timeout, capture_output=capture_output)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: memcgroup.py --limit SIZE [--evict FILE...] [--name N] [--parent P] [--json] -- CMD ARGS",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    opts, cmd = argv[:split], argv[split + 1 :]
    p = argparse.ArgumentParser(prog="memcgroup.py", description="run CMD under a v1 memory cgroup cap")
    p.add_argument("--limit", required=True,
                   help="4GiB, 512MiB, 6.14GB, bytes, N%% of the --evict files, or 'none' (account only)")
    p.add_argument("--evict", nargs="+", default=[], metavar="FILE", help="drop these from the page cache first")
    p.add_argument("--name", default=None)
    p.add_argument("--parent", default=None, help="parent memory cgroup (default: this process's own; '/' = root)")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stderr")
    a = p.parse_args(opts)
    if not cmd:
        p.error("no command after --")
    ok, why = memory_cgroup_support()
    if not ok:
        print(f"memcgroup: {why}", file=sys.stderr)
        return 3
    if a.evict:
        missing = [f for f in a.evict if not os.path.isfile(f)]
        if missing:
            p.error(f"--evict: not a file: {missing[0]}")
    if shutil.which(cmd[0]) is None and not os.path.exists(cmd[0]):
        p.error(f"command not found: {cmd[0]}")
    limit = None if a.limit.lower() in ("none", "max") else a.limit
    res = run_capped(cmd, limit, evict=a.evict, name=a.name, parent=a.parent, timeout=a.timeout)
    if a.json:
        print(json.dumps(res.as_dict(), indent=2), file=sys.stderr)
    else:
        print(f"[memcgroup] {res.summary()}", file=sys.stderr)
    rc = res.returncode
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    raise SystemExit(main())
