"""Exact byte ranges of mmapped shards in the page cache: measure, prefetch, read, release, lock.

On Jetson (unified memory) and CPU hosts the expert "cache" is the page cache, so the runtime works on
(offset, length) ranges of the shard files. Each operation has a native (C) and a Python backend that give the
same answers (page_backends.py). Facts cited as "§N" are from docs/platform-facts.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vismmoe_edge.experts.page_backends import NativeBackend, PythonBackend, load_native
from vismmoe_edge.experts.page_ranges import MIB, PAGE_SIZE, Range, page_span, span_pages
from vismmoe_edge.hardware.system import has_cap_ipc_lock, madvise_features, madvise_value

# Hint chunk cap and the fallback when the device limits cannot be read (§1.3).
DEFAULT_HINT_CHUNK = 2 * MIB
# pread pool: throughput grows with the bytes in flight (threads x piece) until the device saturates; on the
# VM one thread gave ~0.8 GB/s and 8 x 2 MiB ~1.1-1.3 GB/s, level with chunked WILLNEED
# (docs/prefetch-measurements.md). 2 MiB pieces still let five threads share one 9 MiB expert.
DEFAULT_PREAD_CHUNK = 2 * MIB
DEFAULT_THREADS = 8


# Linux uapi values (asm-generic/mman-common.h, §1.2) and posix_fadvise advice (os module).
MADV_NORMAL, MADV_RANDOM, MADV_WILLNEED, MADV_DONTNEED = 0, 1, 3, 4
MADV_COLD, MADV_PAGEOUT, MADV_POPULATE_READ = 20, 21, 22



# --------------------------------------------------------------------------------------------------
# Range arithmetic (shared by both backends; the C code mirrors it)
# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# Device limits -> hint chunk (§1.3: one hint reads at most max(read_ahead_kb, max_sectors_kb))
# --------------------------------------------------------------------------------------------------


def device_queue_dir(path: str | os.PathLike[str], sys_root: Path = Path("/sys")) -> Path | None:
    """/sys/.../queue of the block device holding ``path`` (its parent disk for a partition), or None."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:  # tmpfs, overlayfs, btrfs subvolumes: no single block device
        return None
    dev = sys_root / "dev/block" / f"{major}:{minor}"
    for candidate in (dev / "queue", dev / ".." / "queue"):  # a partition has no queue/ of its own
        if (candidate / "read_ahead_kb").is_file():
            return candidate
    return None


def device_queue_limits(path: str | os.PathLike[str], sys_root: Path = Path("/sys")) -> tuple[int, int] | None:
    """(read_ahead bytes, max_sectors bytes) of the device holding ``path``, or None if unknown."""
    try:
        queue = device_queue_dir(path, sys_root)
        if queue is None:
            return None
        read_ahead = int((queue / "read_ahead_kb").read_text()) << 10
        max_sectors = int((queue / "max_sectors_kb").read_text()) << 10
    except (OSError, ValueError):
        return None
    return read_ahead, max_sectors


def hint_chunk_for_limits(limits: tuple[int, int] | None) -> int:
    """min(2 MiB, max(read_ahead, max_sectors)), at least a page; 2 MiB when the limits are unknown (§1.3)."""
    if limits is None:
        return DEFAULT_HINT_CHUNK
    return max(PAGE_SIZE, min(DEFAULT_HINT_CHUNK, max(limits)))


def hint_chunk_bytes(path: str | os.PathLike[str], sys_root: Path = Path("/sys")) -> int:
    """Chunk for WILLNEED hints on ``path``'s device."""
    return hint_chunk_for_limits(device_queue_limits(path, sys_root))


def readahead_clamp_bytes(path: str | os.PathLike[str], sys_root: Path = Path("/sys")) -> int | None:
    """The most one WILLNEED / readahead call reads on ``path``'s device, or None if unknown (§1.3)."""
    limits = device_queue_limits(path, sys_root)
    return None if limits is None else max(limits)


# --------------------------------------------------------------------------------------------------
# The mapping
# --------------------------------------------------------------------------------------------------


class MappedFile:
    """A read-only ``MAP_SHARED`` mapping of a whole file, with its fd and base address.

    ``buffer`` is the ``mmap`` object: ``torch.frombuffer(mf.buffer, ...)`` works (with a "not writable"
    warning). torch does not hold a buffer export, so close() while such tensors live leaves them dangling:
    close only when no view is in use.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(self.fd).st_size
            if self.size == 0:
                raise ValueError(f"{self.path} is empty: nothing to map")
            # ACCESS_READ = MAP_SHARED + PROT_READ: no private COW copies, pages shared with the page cache.
            self._mm: mmap.mmap | None = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(self.fd)
            raise
        self.base_address = _buffer_address(self._mm)
        self.hint_chunk = hint_chunk_bytes(self.path)
        self.truthful_mincore = mincore_truthful(self)  # else mincore says "all resident" (§1.4)

    @property
    def buffer(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"{self.path} is closed")
        return self._mm

    @property
    def closed(self) -> bool:
        return self._mm is None

    def set_random(self) -> None:
        """No read-around: MADV_RANDOM makes a fault read one page, FADV_RANDOM stops pread readahead.

        Measured here: a 9 MiB pread read 23 MiB without FADV_RANDOM; one fault read 8 MiB without MADV_RANDOM.
        """
        self.buffer.madvise(MADV_RANDOM)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def set_normal(self) -> None:
        """Back to the kernel's default readahead for faults and reads."""
        self.buffer.madvise(MADV_NORMAL)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_NORMAL)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
            os.close(self.fd)

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def check_ranges(self, ranges: Sequence[Range]) -> list[Range]:
        """The ranges as int pairs; ValueError unless each lies inside the file."""
        out = []
        for offset, length in ranges:
            offset, length = int(offset), int(length)
            if offset < 0 or length < 0 or offset + length > self.size:
                raise ValueError(f"range ({offset}, {length}) is outside {self.path} ({self.size} bytes)")
            out.append((offset, length))
        return out


def _buffer_address(mm: mmap.mmap) -> int:
    """Base address of a read-only mmap: ctypes.from_buffer refuses read-only buffers (§1.8), numpy does not.

    The numpy view is dropped at once, so the mmap holds no export and can still be closed.
    """
    import numpy as np

    view = np.frombuffer(mm, dtype=np.uint8, count=1)
    address = int(view.ctypes.data)
    del view
    return address


def mincore_truthful(mf: MappedFile) -> bool:
    """Whether mincore tells this process the truth about ``mf``: owner, CAP_FOWNER, or write access.

    Otherwise the kernel reports every page resident (can_do_mincore, §1.4): use probe_nowait().
    """
    st = os.fstat(mf.fd)
    if os.geteuid() == st.st_uid:
        return True
    cap_fowner = _cap_effective_bit(3)
    return bool(cap_fowner) or os.access(mf.path, os.W_OK)


def _cap_effective_bit(bit: int) -> bool | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        return None
    return None


# --------------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------------


_PYTHON = PythonBackend()
_NATIVE, _NATIVE_ERROR = load_native()
_impl: NativeBackend | PythonBackend = _NATIVE or _PYTHON


def backend() -> str:
    """The backend in use: "native" or "python"."""
    return _impl.name


def native_error() -> str | None:
    """Why the native backend is not available (None when it is)."""
    return _NATIVE_ERROR


def available_backends() -> list[str]:
    return (["native"] if _NATIVE else []) + ["python"]


def set_backend(name: str) -> str:
    """Switch to "native" or "python" (tests compare them); returns the previous name."""
    global _impl
    previous = _impl.name
    if name == "native":
        if _NATIVE is None:
            raise RuntimeError(f"native backend unavailable: {_NATIVE_ERROR}")
        _impl = _NATIVE
    elif name == "python":
        _impl = _PYTHON
    else:
        raise ValueError(f"unknown backend {name!r}")
    return previous


# --------------------------------------------------------------------------------------------------
# Residency
# --------------------------------------------------------------------------------------------------


def resident_pages(mf: MappedFile, ranges: Sequence[Range]) -> list[int]:
    """Resident pages of each range's page span (mincore: page-cache residency).

    Only true for the file's owner (or a writer, or CAP_FOWNER); others get "all resident" (§1.4): check
    ``mf.truthful_mincore`` and use probe_nowait() when it is False.
    """
    return _impl.residency(mf.base_address, mf.check_ranges(ranges))


def resident_fraction(mf: MappedFile, ranges: Sequence[Range]) -> float:
    """Resident share of all the ranges' pages together (1.0 for no pages)."""
    total = sum(span_pages(mf.check_ranges(ranges)))
    return 1.0 if total == 0 else sum(resident_pages(mf, ranges)) / total


def residency_map(mf: MappedFile, offset: int = 0, length: int | None = None) -> bytes:
    """One byte (0 or 1) per page of a range's page span; the whole file by default."""
    ((offset, length),) = mf.check_ranges([(offset, mf.size - offset if length is None else length)])
    return _impl.residency_map(mf.base_address, offset, length)


def wait_resident(
    mf: MappedFile, ranges: Sequence[Range], timeout: float = 2.0, poll: float = 0.001, stall: float | None = None
) -> bool:
    """Poll mincore until every page of the ranges is resident (WILLNEED is asynchronous, §1.2).

    False on ``timeout``, or once residency has not grown for ``stall`` seconds: WILLNEED is a hint, and here
    1 run in 40 of 32 chunked 9 MiB hints left a page or two out for good (page cache full, free memory low).
    Follow with ensure_resident() to fill such holes.
    """
    want = span_pages(mf.check_ranges(ranges))
    start = last_change = time.monotonic()
    last = -1
    while True:
        now = resident_pages(mf, ranges)
        if now == want:
            return True
        clock = time.monotonic()
        if sum(now) != last:
            last, last_change = sum(now), clock
        if clock - start >= timeout or (stall is not None and clock - last_change >= stall):
            return False
        time.sleep(poll)


def missing_ranges(mf: MappedFile, ranges: Sequence[Range]) -> list[Range]:
    """Runs of non-resident pages within the ranges' page spans, as (offset, length) clamped to the file."""
    out = []
    for offset, length in mf.check_ranges(ranges):
        start, _ = page_span(offset, length)
        vec = residency_map(mf, offset, length)
        i = vec.find(0)
        while i >= 0:
            j = vec.find(1, i)
            j = len(vec) if j < 0 else j
            begin = start + i * PAGE_SIZE
            out.append((begin, min(start + j * PAGE_SIZE, mf.size) - begin))
            i = vec.find(0, j)
    return out


def ensure_resident(
    mf: MappedFile, ranges: Sequence[Range], threads: int = DEFAULT_THREADS, chunk_bytes: int = DEFAULT_PREAD_CHUNK
) -> int:
    """pread whatever pages of the ranges are not resident (after a hint, the holes); returns bytes read.

    Where mincore would lie (not the file's owner, §1.4) it reads every range: cached pages cost a copy.
    """
    if mf.truthful_mincore:
        holes = missing_ranges(mf, ranges)
    else:
        holes = [(s, min(e, mf.size) - s) for s, e in (page_span(o, n) for o, n in mf.check_ranges(ranges))]
    if holes:
        _impl.pread(mf.fd, holes, None, max(1, threads), chunk_bytes)
    return sum(n for _, n in holes)


def probe_nowait(file: MappedFile | int, ranges: Sequence[Range], samples: int = 3) -> list[bool]:
    """Whether each range looks cached, from RWF_NOWAIT reads of its first / middle / last page.

    Truthful for any reader, unlike mincore for non-owners (§1.4). Side effect: a miss starts an async read
    of the probed page (measured: it was resident 0.5 s later), so a probe is not read-only for the cache.
    Unreliable on 5.9/5.10 (JetPack 5), where a miss may read as 0 bytes; that is reported as not cached.
    """
    fd = file.fd if isinstance(file, MappedFile) else file
    if isinstance(file, MappedFile):
        ranges = file.check_ranges(ranges)
    offsets_per_range = [probe_offsets(o, n, samples) for o, n in ranges]
    flat = _impl.probe(fd, [o for offsets in offsets_per_range for o in offsets])
    out, i = [], 0
    for offsets in offsets_per_range:
        out.append(all(flat[i : i + len(offsets)]))
        i += len(offsets)
    return out


def probe_offsets(offset: int, length: int, samples: int = 3) -> list[int]:
    """Page-aligned offsets probe_nowait() reads for a range: first, evenly spaced, last page (deduplicated)."""
    if length == 0:
        return []
    last = offset + length - 1
    if samples <= 1:
        return [offset]
    picks = {offset + (last - offset) * k // (samples - 1) for k in range(samples)}
    return sorted({p - p % PAGE_SIZE for p in picks})


# --------------------------------------------------------------------------------------------------
# Prefetch and read
# --------------------------------------------------------------------------------------------------


def advise(mf: MappedFile, ranges: Sequence[Range], advice: int, chunk_bytes: int = 0) -> None:
    """madvise each range's page span, one call per ``chunk_bytes`` (0 = one call per range)."""
    _impl.advise(mf, mf.check_ranges(ranges), advice, chunk_bytes)


def prefetch_madvise(mf: MappedFile, ranges: Sequence[Range], chunk_bytes: int | None = None) -> None:
    """Asynchronous readahead of the ranges: chunked MADV_WILLNEED, returns before the data is read.

    One hint reads at most max(read_ahead_kb, max_sectors_kb) (§1.3), so the default chunk is the device's
    hint chunk. Page tables are not populated (§1.2); pair with wait_resident() to block and ensure_resident()
    to fill the pages a hint may leave out.
    """
    advise(mf, ranges, MADV_WILLNEED, mf.hint_chunk if chunk_bytes is None else chunk_bytes)


def prefetch_fadvise(mf: MappedFile, ranges: Sequence[Range], chunk_bytes: int | None = None) -> None:
    """Same as prefetch_madvise() through the fd (POSIX_FADV_WILLNEED), no mapping needed."""
    chunk = mf.hint_chunk if chunk_bytes is None else chunk_bytes
    _impl.fadvise(mf.fd, mf.check_ranges(ranges), os.POSIX_FADV_WILLNEED, chunk)


def prefetch_populate(mf: MappedFile, ranges: Sequence[Range], chunk_bytes: int | None = None) -> None:
    """Blocking prefetch that also maps the pages: chunked WILLNEED, then MADV_POPULATE_READ (5.14+).

    POPULATE_READ alone faults page by page under MADV_RANDOM (measured here: 3 ms a page, 1 MiB in 0.8 s)
    and reads around each fault otherwise (8 MiB for 1 MiB); the WILLNEED first issues the exact reads in
    large pieces and POPULATE_READ then waits for them. Not on JetPack 5 (5.10).
    """
    if not madvise_features()["MADV_POPULATE_READ"]:
        raise OSError(errno.EINVAL, "MADV_POPULATE_READ needs Linux 5.14")
    chunk = mf.hint_chunk if chunk_bytes is None else chunk_bytes
    ranges = mf.check_ranges(ranges)
    _impl.advise(mf, ranges, MADV_WILLNEED, chunk)
    _impl.advise(mf, ranges, madvise_value("MADV_POPULATE_READ"), chunk)


def prefetch_pread(
    mf: MappedFile, ranges: Sequence[Range], threads: int = DEFAULT_THREADS, chunk_bytes: int = DEFAULT_PREAD_CHUNK
) -> None:
    """Read the ranges' pages into the page cache with a pread pool; returns once they are read.

    Reads whole pages into per-thread scratch buffers. Call mf.set_random() first, or the fd's readahead
    reads well past each range (measured: 23 MiB for a 9 MiB range).
    """
    spans = [page_span(o, n) for o, n in mf.check_ranges(ranges)]
    spans = [(s, min(e, mf.size) - s) for s, e in spans]  # the last page stops at the end of the file
    _impl.pread(mf.fd, spans, None, max(1, threads), chunk_bytes)


def read_into(
    mf: MappedFile,
    ranges: Sequence[Range],
    dests: Sequence[Any],
    threads: int = DEFAULT_THREADS,
    chunk_bytes: int = DEFAULT_PREAD_CHUNK,
) -> None:
    """pread each range's exact bytes into its destination, in parallel.

    A destination is a contiguous CPU torch tensor (pinned host tensors included), any writable buffer
    (bytearray, numpy array, memoryview) of at least the range's length, or an int address the caller vouches
    for. Bytes come through the page cache, which keeps them (release() drops them).
    """
    ranges = mf.check_ranges(ranges)
    if len(dests) != len(ranges):
        raise ValueError(f"{len(ranges)} ranges but {len(dests)} destinations")
    keep: list[Any] = []
    addresses = [_dest_address(dest, length, keep) for dest, (_, length) in zip(dests, ranges, strict=True)]
    _impl.pread(mf.fd, ranges, addresses, max(1, threads), chunk_bytes)
    del keep  # the exports pinning the buffers end here


def read_fd_into(
    fd: int,
    ranges: Sequence[Range],
    addresses: Sequence[int],
    threads: int = DEFAULT_THREADS,
    chunk_bytes: int = DEFAULT_PREAD_CHUNK,
) -> None:
    """pread exact ranges of an open fd into raw addresses the caller vouches for (an O_DIRECT fd included: then
    ranges, addresses and chunk_bytes must be aligned as the file system wants)."""
    if len(addresses) != len(ranges):
        raise ValueError(f"{len(ranges)} ranges but {len(addresses)} destinations")
    _impl.pread(fd, [(int(o), int(n)) for o, n in ranges], list(addresses), max(1, threads), chunk_bytes)


def _dest_address(dest: Any, length: int, keep: list[Any]) -> int:
    """Address of a destination with room for ``length`` bytes; ``keep`` holds what must outlive the read."""
    if isinstance(dest, int):
        return dest
    if hasattr(dest, "data_ptr"):  # torch.Tensor, without importing torch
        if dest.device.type != "cpu" or not dest.is_contiguous():
            raise ValueError("a tensor destination must be a contiguous CPU tensor")
        nbytes = dest.numel() * dest.element_size()
        address = dest.data_ptr()
    else:
        view = memoryview(dest)
        if view.readonly or not view.c_contiguous:
            raise ValueError("a buffer destination must be writable and contiguous")
        nbytes = view.nbytes
        holder = (ctypes.c_char * nbytes).from_buffer(view.cast("B")) if nbytes else None
        keep.append(holder)
        address = ctypes.addressof(holder) if holder is not None else 0
    if nbytes < length:
        raise ValueError(f"destination holds {nbytes} bytes, the range has {length}")
    keep.append(dest)
    return address


# --------------------------------------------------------------------------------------------------
# Release
# --------------------------------------------------------------------------------------------------

RELEASE_METHODS = ("auto", "dontneed", "pageout", "cold")


def release(mf: MappedFile, ranges: Sequence[Range], method: str = "auto") -> str:
    """Drop the ranges' pages; returns the method used. Whole page spans go, edge pages of neighbours too.

    - "dontneed" (and "auto"): MADV_DONTNEED zaps our page-table entries (the page cache stays, §1.5), then
      POSIX_FADV_DONTNEED frees the now unmapped clean pages. Any kernel, any user with the fd. Pages that
      another process maps stay.
    - "pageout" (5.4+): MADV_PAGEOUT reclaims now, but only pages mapped in *our* page tables, and only for
      the file's owner (a silent no-op otherwise, §1.2). Measured here as root: pages brought in by WILLNEED or
      pread, never faulted through the mapping, stayed resident; and it is best effort (pages still in
      another CPU's LRU-add batch are skipped: 24 of 1282 stayed once). Hence not the "auto" choice.
    - "cold" (5.4+): MADV_COLD, a nondestructive hint: first to go under memory pressure.

    On kernels older than 5.4, "pageout" and "cold" fall back to "dontneed". mlocked ranges raise EINVAL
    (unlock() them first).
    """
    if method not in RELEASE_METHODS:
        raise ValueError(f"method must be one of {RELEASE_METHODS}, not {method!r}")
    ranges = mf.check_ranges(ranges)
    features = madvise_features()
    if method == "auto" or (method in ("pageout", "cold") and not features[f"MADV_{method.upper()}"]):
        method = "dontneed"
    if method == "dontneed":
        _impl.advise(mf, ranges, MADV_DONTNEED, 0)
        _impl.fadvise(mf.fd, ranges, os.POSIX_FADV_DONTNEED, 0)
    else:
        _impl.advise(mf, ranges, MADV_PAGEOUT if method == "pageout" else MADV_COLD, 0)
    return method


def evict_file(path: str | os.PathLike[str], attempts: int = 1) -> int:
    """Drop a whole file from the page cache (benchmarks, tests); returns the bytes still resident.

    Writes dirty pages back first (FADV_DONTNEED skips dirty pages, §1.5). Pages mapped by a live mapping stay:
    release() those mappings first (MappedFile.close() alone does not unmap views others hold). A drop is best
    effort (a page still in flight or in another CPU's LRU batch can stay), so tests ask for several attempts.
    """
    left = 0
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.02)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if os.stat(path).st_size == 0:
            return 0
        with MappedFile(path) as mf:
            left = residency_map(mf).count(1) * PAGE_SIZE
        if left == 0:
            return 0
    return left


# --------------------------------------------------------------------------------------------------
# Locking
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LockReport:
    locked_bytes: int  # page-span bytes now locked by this call
    failed_bytes: int  # page-span bytes that could not be locked
    reason: str | None  # why the first failure happened; None if all were locked


def lock(mf: MappedFile, ranges: Sequence[Range]) -> LockReport:
    """mlock each range's page span, within RLIMIT_MEMLOCK; reports failures and never raises.

    mlock faults the pages in (reading the file). The limit is 64 KiB on 5.10/5.15 kernels by default and
    8 MiB for systemd units; CAP_IPC_LOCK lifts it (§1.6). Locked pages cannot be released (MADV_DONTNEED
    gives EINVAL) until unlock().
    """
    locked = failed = 0
    reason = None
    for offset, length in mf.check_ranges(ranges):
        start, end = page_span(offset, length)
        err = _impl.mlock(mf.base_address + start, end - start)
        if err == 0:
            locked += end - start
            continue
        failed += end - start
        reason = reason or _lock_failure_reason(err)
    return LockReport(locked, failed, reason)


def unlock(mf: MappedFile, ranges: Sequence[Range]) -> None:
    for offset, length in mf.check_ranges(ranges):
        start, end = page_span(offset, length)
        err = _impl.munlock(mf.base_address + start, end - start)
        if err:
            raise OSError(err, f"munlock: {os.strerror(err)}")


def locked_bytes() -> int:
    """VmLck of this process: bytes mlocked now (cudaHostRegister pins are not counted, §1.6)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) << 10
    return 0


def _lock_failure_reason(err: int) -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    if err in (errno.ENOMEM, errno.EPERM):
        cap = has_cap_ipc_lock()
        return (
            f"{errno.errorcode[err]}: over RLIMIT_MEMLOCK (soft limit {limit}, {locked_bytes()} bytes locked,"
            f" CAP_IPC_LOCK {'held' if cap else 'not held'}); raise LimitMEMLOCK= or grant CAP_IPC_LOCK"
        )
    return f"{errno.errorcode.get(err, err)}: {os.strerror(err)}"
