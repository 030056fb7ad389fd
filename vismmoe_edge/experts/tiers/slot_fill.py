"""Exact byte ranges of the shards read straight into slot memory, leaving nothing behind in the page cache.

Each range goes to its destination address in one of two ways:
- O_DIRECT, where the file system allows it (statx STATX_DIOALIGN, Linux 6.1+; else the device's logical block
  size) and the destination lines up with the file offset: the aligned interior of the range moves disk -> slot
  by DMA, with no copy by the CPU and no page cache (JetPack has no GPUDirect Storage: docs/platform-facts.md §3.1);
- buffered pread otherwise (and for the unaligned head and tail): the kernel copies each byte once from the page
  cache into the slot.
Either way the ranges' whole pages are then dropped (POSIX_FADV_DONTNEED on the page span: fadvise keeps partial
pages otherwise), because on a Jetson the page cache and the slots share one DRAM and holding an expert twice
halves what fits. Reads run on the native pread pool (GIL released). The reader is injectable so that a test can
count every host write.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.page_ranges import PAGE_SIZE, page_span
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.hardware.monitor import notice_once

Piece = tuple[int, int, int]  # (file offset, length, destination address)
Reader = Callable[[int, Sequence[tuple[int, int]], Sequence[int]], None]  # fd, ranges, destination addresses

STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100


@dataclass(frozen=True)
class DirectAlignment:
    offset: int  # file offsets and lengths of O_DIRECT reads must be multiples of this
    memory: int  # and their buffer addresses multiples of this
    source: str


@dataclass(frozen=True)
class Read:
    """One byte range of a shard and where its bytes go."""

    shard: Path
    offset: int
    nbytes: int
    dest: int


@dataclass
class FillStats:
    direct_bytes: int = 0  # disk -> slot by DMA: no CPU copy, no page cache
    buffered_bytes: int = 0  # page cache -> slot: one CPU copy per byte
    dropped_bytes: int = 0  # page-span bytes handed back to the kernel after the reads
    read_s: float = 0.0  # the reads and drops, summed over fills (I/O threads fill in parallel)
    wait_s: float = 0.0  # waiting, before a fill, for the GPU to finish reading the slot's previous expert

    def add(self, other: FillStats) -> None:
        self.direct_bytes += other.direct_bytes
        self.buffered_bytes += other.buffered_bytes
        self.dropped_bytes += other.dropped_bytes
        self.read_s += other.read_s
        self.wait_s += other.wait_s


@functools.cache
def _statx() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).statx
    except (OSError, AttributeError):  # not glibc 2.28+ / not Linux
        return None


def _statx_dio(path: Path) -> tuple[int, int] | None:
    """(memory, offset) alignment from statx, (0, 0) if the file cannot do O_DIRECT, None if statx cannot say."""
    statx = _statx()
    if statx is None:
        return None
    buf = ctypes.create_string_buffer(256)
    if statx(_AT_FDCWD, os.fsencode(path), 0, STATX_DIOALIGN, buf) != 0:
        return None
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    if not mask & STATX_DIOALIGN:  # kernels before 6.1 and file systems that do not report it
        return None
    memory, offset = struct.unpack_from("<II", buf.raw, 152)  # stx_dio_mem_align, stx_dio_offset_align
    return memory, offset


def direct_alignment(path: Path) -> DirectAlignment | None:
    """How O_DIRECT reads of `path` must be aligned, or None where they cannot be made."""
    dio = _statx_dio(path)
    if dio is not None:
        memory, offset = dio
        return None if offset == 0 else DirectAlignment(offset, max(memory, 1), "statx STATX_DIOALIGN")
    queue = pagecache.device_queue_dir(path)
    block = 0
    if queue is not None:
        try:
            block = int((queue / "logical_block_size").read_text())
        except (OSError, ValueError):
            block = 0
    # Before 6.0 iomap wanted buffers aligned to the logical block too; a page satisfies any block size we meet.
    block = block or PAGE_SIZE
    return DirectAlignment(block, block, f"logical block size of {queue.parent.name if queue else 'the device'}")


def split(read: Read, alignment: DirectAlignment | None) -> tuple[list[Piece], list[Piece]]:
    """(O_DIRECT pieces, buffered pieces) covering `read` exactly once."""
    off, n, dest = read.offset, read.nbytes, read.dest
    if alignment is None or n == 0:
        return [], [(off, n, dest)] if n else []
    a0 = off + (-off) % alignment.offset
    a1 = (off + n) - (off + n) % alignment.offset
    if a1 - a0 < alignment.offset or (dest + a0 - off) % alignment.memory:
        return [], [(off, n, dest)]
    buffered = []
    if a0 > off:
        buffered.append((off, a0 - off, dest))
    if off + n > a1:
        buffered.append((a1, off + n - a1, dest + a1 - off))
    return [(a0, a1 - a0, dest + a0 - off)], buffered


def drop_loaded_shards(files: ShardFiles, table: dict[str, TensorInfo]) -> None:
    """After loading, for tiers that read nothing through the page cache any more: close the loader's mappings
    (mapped pages cannot be dropped) and drop the shards' pages; registered pages (a registered prefix) stay."""
    files.close()
    drop_whole_files({t.shard for t in table.values()})


def drop_whole_files(paths: Iterable[Path]) -> None:
    """Drop every cached, unmapped, unpinned page of these files: whole files, because the large folios that
    sequential readers (the header read, mmap faults) leave behind straddle any range and survive range drops."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def default_reader(fd: int, ranges: Sequence[tuple[int, int]], dests: Sequence[int]) -> None:
    pagecache.read_fd_into(fd, ranges, dests)


class _Shard:
    def __init__(self, path: Path, direct: bool) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)  # a pread must not read around (pagecache.py)
        # What others cached of the file (the header read, at least) goes: its large folios straddle our ranges,
        # so range drops cannot free them, and its readahead marks would make our first pread read far ahead.
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.size = os.fstat(self.fd).st_size
        self.alignment = direct_alignment(path) if direct else None
        self.direct_fd: int | None = None
        if self.alignment is not None:
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
            except OSError:  # tmpfs and others refuse O_DIRECT at open
                self.alignment = None

    def disable_direct(self, why: str) -> None:
        notice_once(f"odirect:{self.path.parent}", f"O_DIRECT reads of {self.path.name} failed ({why}): "
                    "reading through the page cache and dropping it instead")  # fmt: skip
        if self.direct_fd is not None:
            os.close(self.direct_fd)
        self.direct_fd, self.alignment = None, None

    def close(self) -> None:
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
        self.direct_fd = None


class SlotFiller:
    """Reads `Read`s from any thread; one buffered and one O_DIRECT descriptor per shard."""

    def __init__(self, *, direct: bool = True, reader: Reader = default_reader) -> None:
        self.direct = direct
        self.reader = reader
        self._shards: dict[Path, _Shard] = {}
        self._lock = threading.Lock()

    def shard(self, path: Path) -> _Shard:
        with self._lock:
            shard = self._shards.get(path)
            if shard is None:
                shard = self._shards[path] = _Shard(path, self.direct)
            return shard

    def fill(self, reads: Sequence[Read]) -> FillStats:
        stats = FillStats()
        by_shard: dict[Path, list[Read]] = {}
        for read in reads:
            by_shard.setdefault(read.shard, []).append(read)
        for path, shard_reads in by_shard.items():
            stats.add(self._fill_shard(self.shard(path), shard_reads))
        return stats

    def _fill_shard(self, shard: _Shard, reads: list[Read]) -> FillStats:
        direct: list[Piece] = []
        buffered: list[Piece] = []
        for read in reads:
            if read.offset < 0 or read.offset + read.nbytes > shard.size:
                raise ValueError(f"range ({read.offset}, {read.nbytes}) is outside {shard.path} ({shard.size} bytes)")
            d, b = split(read, shard.alignment)
            direct += d
            buffered += b
        if direct and shard.direct_fd is not None:
            try:
                self.reader(shard.direct_fd, [(o, n) for o, n, _ in direct], [a for _, _, a in direct])
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                shard.disable_direct(os.strerror(e.errno))
                buffered, direct = buffered + direct, []
        if buffered:
            self.reader(shard.fd, [(o, n) for o, n, _ in buffered], [a for _, _, a in buffered])
        dropped = 0
        for read in reads:  # whole pages: a cached page also holds a neighbour's bytes, and we own that cache too
            start, end = page_span(read.offset, read.nbytes)
            end = min(end, shard.size + (-shard.size) % PAGE_SIZE)
            os.posix_fadvise(shard.fd, start, end - start, os.POSIX_FADV_DONTNEED)
            dropped += end - start
        return FillStats(sum(n for _, n, _ in direct), sum(n for _, n, _ in buffered), dropped)

    def close(self) -> None:
        with self._lock:
            for shard in self._shards.values():
                shard.close()
            self._shards.clear()
