"""The two implementations of the page-cache operations, which give the same answers:

- ``native``: ``native/vismmoe_native.c`` built as ``vismmoe_edge/_vmnative*.so`` at install time and called
  through ctypes (which releases the GIL for the call); its pread pool runs on pthreads;
- ``python``: ctypes libc (mincore, mlock), ``mmap.madvise``, ``os.posix_fadvise`` and ``os.preadv`` in a
  ``ThreadPoolExecutor`` (these release the GIL too).

``VISMMOE_NATIVE=0`` forces the Python backend; ``VISMMOE_NATIVE_LIB`` names a library file to load instead.
Facts cited as "§N" are from docs/platform-facts.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import importlib.machinery
import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

from vismmoe_edge.experts.page_ranges import MIB, PAGE_SIZE, Range, chunk_spans, page_span, split_range


class MappedFile(Protocol):
    """What the backends need of pagecache.MappedFile: the mapping and its address."""

    buffer: mmap.mmap
    base_address: int

NATIVE_ABI = 1


_u64p = ctypes.POINTER(ctypes.c_uint64)


_LSB = bytes(i & 1 for i in range(256))  # translate table: mincore byte -> resident bit


def _u64_array(values: Sequence[int]) -> ctypes.Array[ctypes.c_uint64]:
    return (ctypes.c_uint64 * max(len(values), 1))(*values)


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


class NativeBackend:
    name = "native"

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        vp, u64, i32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
        for fn, args in {
            "vm_residency_ranges": (vp, _u64p, _u64p, i32, ctypes.POINTER(ctypes.c_int64)),
            "vm_residency_map": (vp, u64, u64, ctypes.c_char_p),
            "vm_advise_ranges": (vp, _u64p, _u64p, i32, i32, u64),
            "vm_fadvise_ranges": (i32, _u64p, _u64p, i32, i32, u64),
            "vm_pread_ranges": (i32, _u64p, _u64p, i32, ctypes.POINTER(vp), i32, u64),
            "vm_probe_nowait": (i32, _u64p, i32, ctypes.c_char_p),
            "vm_mlock": (vp, ctypes.c_size_t),
            "vm_munlock": (vp, ctypes.c_size_t),
        }.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = i32

    def residency(self, base: int, ranges: Sequence[Range]) -> list[int]:
        out = (ctypes.c_int64 * max(len(ranges), 1))()
        offs, lens = _u64_array([o for o, _ in ranges]), _u64_array([n for _, n in ranges])
        _check(self.lib.vm_residency_ranges(base, offs, lens, len(ranges), out), "mincore")
        return list(out[: len(ranges)])

    def residency_map(self, base: int, offset: int, length: int) -> bytes:
        start, end = page_span(offset, length)
        vec = ctypes.create_string_buffer(max((end - start) // PAGE_SIZE, 1))
        _check(self.lib.vm_residency_map(base, offset, length, vec), "mincore")
        return vec.raw[: (end - start) // PAGE_SIZE]

    def advise(self, mf: MappedFile, ranges: Sequence[Range], advice: int, chunk: int) -> None:
        offs, lens = _u64_array([o for o, _ in ranges]), _u64_array([n for _, n in ranges])
        _check(self.lib.vm_advise_ranges(mf.base_address, offs, lens, len(ranges), advice, chunk), "madvise")

    def fadvise(self, fd: int, ranges: Sequence[Range], advice: int, chunk: int) -> None:
        offs, lens = _u64_array([o for o, _ in ranges]), _u64_array([n for _, n in ranges])
        _check(self.lib.vm_fadvise_ranges(fd, offs, lens, len(ranges), advice, chunk), "posix_fadvise")

    def pread(self, fd: int, ranges: Sequence[Range], dests: Sequence[int] | None, threads: int, chunk: int) -> None:
        offs, lens = _u64_array([o for o, _ in ranges]), _u64_array([n for _, n in ranges])
        ptrs = None if dests is None else (ctypes.c_void_p * max(len(dests), 1))(*dests)
        _check(self.lib.vm_pread_ranges(fd, offs, lens, len(ranges), ptrs, threads, chunk), "pread")

    def probe(self, fd: int, offsets: Sequence[int]) -> list[bool]:
        out = ctypes.create_string_buffer(max(len(offsets), 1))
        _check(self.lib.vm_probe_nowait(fd, _u64_array(offsets), len(offsets), out), "preadv2(RWF_NOWAIT)")
        return [b == 1 for b in out.raw[: len(offsets)]]

    def mlock(self, address: int, length: int) -> int:
        return -self.lib.vm_mlock(address, length)

    def munlock(self, address: int, length: int) -> int:
        return -self.lib.vm_munlock(address, length)


class PythonBackend:
    name = "python"

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        for fn, args in {
            "mincore": (vp, size, ctypes.c_char_p),
            "madvise": (vp, size, ctypes.c_int),
            "mlock": (vp, size),
            "munlock": (vp, size),
        }.items():
            getattr(self.libc, fn).argtypes = args
            getattr(self.libc, fn).restype = ctypes.c_int
        self._scratch = threading.local()

    def residency_map(self, base: int, offset: int, length: int) -> bytes:
        start, end = page_span(offset, length)
        pages = (end - start) // PAGE_SIZE
        if pages == 0:
            return b""
        vec = ctypes.create_string_buffer(pages)
        if self.libc.mincore(base + start, end - start, vec) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore: {os.strerror(err)}")
        return vec.raw[:pages].translate(_LSB)  # only the LSB is defined (§1.4)

    def residency(self, base: int, ranges: Sequence[Range]) -> list[int]:
        return [self.residency_map(base, o, n).count(1) for o, n in ranges]

    def advise(self, mf: MappedFile, ranges: Sequence[Range], advice: int, chunk: int) -> None:
        # mmap.madvise takes raw uapi ints, even those CPython has no constant for (§1.8).
        for offset, length in ranges:
            for start, size in chunk_spans(offset, length, chunk):
                mf.buffer.madvise(advice, start, size)

    def fadvise(self, fd: int, ranges: Sequence[Range], advice: int, chunk: int) -> None:
        for offset, length in ranges:
            for start, size in chunk_spans(offset, length, chunk):
                os.posix_fadvise(fd, start, size, advice)

    def pread(self, fd: int, ranges: Sequence[Range], dests: Sequence[int] | None, threads: int, chunk: int) -> None:
        tasks = []
        for i, (offset, length) in enumerate(ranges):
            for piece_offset, piece_length in split_range(offset, length, chunk):
                dest = None if dests is None or dests[i] is None else dests[i] + piece_offset - offset
                tasks.append((piece_offset, piece_length, dest))
        if not tasks:
            return
        scratch_size = min(chunk + (-chunk) % PAGE_SIZE, 8 * MIB) if chunk > 0 else 8 * MIB
        workers = max(1, min(threads, len(tasks)))
        if workers == 1:
            for task in tasks:
                self._read_task(fd, task, scratch_size)
            return
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for future in [pool.submit(self._read_task, fd, task, scratch_size) for task in tasks]:
                future.result()

    def _read_task(self, fd: int, task: tuple[int, int, int | None], scratch_size: int) -> None:
        offset, length, dest = task
        if dest is not None:
            _read_full(fd, memoryview((ctypes.c_char * length).from_address(dest)).cast("B"), offset)
            return
        scratch = getattr(self._scratch, "buf", None)
        if scratch is None or len(scratch) < scratch_size:
            scratch = self._scratch.buf = memoryview(mmap.mmap(-1, scratch_size))  # page-aligned
        for done in range(0, length, scratch_size):
            _read_full(fd, scratch[: min(scratch_size, length - done)], offset + done)

    def probe(self, fd: int, offsets: Sequence[int]) -> list[bool]:
        size = os.fstat(fd).st_size
        buf = bytearray(PAGE_SIZE)
        out = []
        for offset in offsets:
            start = offset - offset % PAGE_SIZE
            want = min(PAGE_SIZE, max(size - start, 0))
            try:
                got = os.preadv(fd, [buf], start, os.RWF_NOWAIT)
            except BlockingIOError:
                got = 0
            out.append(got > 0 and got >= want)  # a 0 from the 5.9/5.10 bug counts as a miss (§1.4)
        return out

    def mlock(self, address: int, length: int) -> int:
        start, end = page_span(address, length)
        return 0 if length == 0 or self.libc.mlock(start, end - start) == 0 else ctypes.get_errno()

    def munlock(self, address: int, length: int) -> int:
        start, end = page_span(address, length)
        return 0 if length == 0 or self.libc.munlock(start, end - start) == 0 else ctypes.get_errno()


def _read_full(fd: int, view: memoryview, offset: int) -> None:
    """preadv until ``view`` is full; an early EOF is EIO (as in the C pool)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(errno.EIO, f"pread: unexpected end of file at {offset + done}")
        done += got


def _native_library_paths() -> Iterator[Path]:
    override = os.environ.get("VISMMOE_NATIVE_LIB")
    if override:
        yield Path(override)
        return
    here = Path(__file__).resolve().parents[1]  # the package root, where setup.py puts the library
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        yield here / f"_vmnative{suffix}"
    yield here.parent / "native" / "libvismmoe_native.so"  # a manual build (native/README.md)


def load_native() -> tuple[NativeBackend | None, str | None]:
    """The native backend, or (None, why not)."""
    if os.environ.get("VISMMOE_NATIVE", "1") == "0":
        return None, "disabled by VISMMOE_NATIVE=0"
    tried = []
    for path in _native_library_paths():
        if not path.is_file():
            tried.append(str(path))
            continue
        try:
            lib = ctypes.CDLL(str(path), use_errno=True)
            if lib.vm_abi_version() != NATIVE_ABI:
                return None, f"{path} has ABI {lib.vm_abi_version()}, expected {NATIVE_ABI}: reinstall"
            return NativeBackend(lib), None
        except (OSError, AttributeError) as exc:
            return None, f"{path}: {exc}"
    return None, "native library not built (looked for " + ", ".join(tried) + ")"
