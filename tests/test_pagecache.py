"""vismmoe_edge.experts.pagecache on a real file and the real page cache, with both backends.

What this machine's page cache was found to honour (2-core VM, kernel 6.18, ext4 on virtio): fadvise
DONTNEED evicts unmapped clean pages; mincore is truthful for the owner (root here); chunked WILLNEED
and a pread pool make exactly the requested pages resident once MADV_RANDOM + FADV_RANDOM are set; one
unchunked WILLNEED stops at max(read_ahead_kb, max_sectors_kb).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from vismmoe_edge.experts import page_ranges as pr
from vismmoe_edge.experts import pagecache as pc

MIB = 1 << 20
PAGE = pc.PAGE_SIZE
FILE_SIZE = 64 * MIB
# Expert-like ranges, deliberately not page-aligned, spread over the file with gaps between them.
RANGES = [(3 * MIB + 123, 9 * MIB), (20 * MIB + 4095, 5 * MIB + 17), (40 * MIB, 9 * MIB + 1)]
# Pages a prefetch may bring in beyond the requested spans: none were seen; 256 KiB of slack, against the
# megabytes that readahead would add.
SLACK_PAGES = 64
REPO = Path(__file__).resolve().parents[1]

BACKENDS = [
    pytest.param(
        "native",
        marks=pytest.mark.skipif("native" not in pc.available_backends(), reason=f"{pc.native_error()}"),
    ),
    "python",
]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pagecache") / "shard.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        f.write(rng.integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest):
    previous = pc.set_backend(request.param)
    yield request.param
    pc.set_backend(previous)


@pytest.fixture
def mf(data_file: Path, backend: str):
    """A cold mapping with no read-around."""
    with pc.MappedFile(data_file) as mapped:
        mapped.set_random()
        _evict(mapped)
        yield mapped
        pc.release(mapped, [(0, mapped.size)])


def _evict(mf: pc.MappedFile) -> None:
    # Retried: a missed RWF_NOWAIT probe starts an async read that can land after one release.
    for _ in range(50):
        pc.release(mf, [(0, mf.size)])
        if pc.resident_pages(mf, [(0, mf.size)]) == [0]:
            return
        time.sleep(0.02)
    raise AssertionError("MADV_DONTNEED + FADV_DONTNEED did not evict this file")


def _evict_path(path: Path) -> int:
    for _ in range(50):
        left = pc.evict_file(path)
        if left == 0:
            return 0
        time.sleep(0.02)
    return left


def _total_resident(mf: pc.MappedFile) -> int:
    return pc.resident_pages(mf, [(0, mf.size)])[0]


def _expected_pages(ranges: list[tuple[int, int]]) -> int:
    """Pages of the union of the ranges' page spans."""
    pages = set()
    for offset, length in ranges:
        start, end = pc.page_span(offset, length)
        pages.update(range(start // PAGE, end // PAGE))
    return len(pages)


# --------------------------------------------------------------------------------------------------
# Arithmetic
# --------------------------------------------------------------------------------------------------


def test_page_span_rounds_out() -> None:
    assert pc.page_span(0, 1) == (0, PAGE)
    assert pc.page_span(PAGE - 1, 2) == (0, 2 * PAGE)
    assert pc.page_span(PAGE, PAGE) == (PAGE, 2 * PAGE)
    assert pc.page_span(5000, 0) == (PAGE, PAGE)
    assert pc.span_pages([(100, 9 * MIB)]) == [9 * MIB // PAGE + 1]


def test_chunk_spans_cover_the_page_span_in_chunks() -> None:
    chunks = pr.chunk_spans(123, 5 * MIB, 2 * MIB)
    assert chunks == [(0, 2 * MIB), (2 * MIB, 2 * MIB), (4 * MIB, MIB + PAGE)]
    # A chunk that is not a page multiple is rounded up; 0 means one call.
    assert pr.chunk_spans(PAGE, 3 * PAGE, PAGE + 1) == [(PAGE, 2 * PAGE), (3 * PAGE, PAGE)]
    assert pr.chunk_spans(10, 3 * MIB, 0) == [(0, 3 * MIB + PAGE)]
    assert pr.chunk_spans(10, 0, MIB) == []
    for offset, length in RANGES:
        chunks = pr.chunk_spans(offset, length, 2 * MIB)
        start, end = pc.page_span(offset, length)
        assert chunks[0][0] == start and sum(n for _, n in chunks) == end - start
        assert all(s % PAGE == 0 and n <= 2 * MIB for s, n in chunks)


def test_split_range_is_byte_exact() -> None:
    assert pr.split_range(100, 2 * MIB + 5, MIB) == [(100, MIB), (100 + MIB, MIB), (100 + 2 * MIB, 5)]
    assert pr.split_range(7, 10, 0) == [(7, 10)]
    assert pr.split_range(7, 0, MIB) == []


def test_hint_chunk_follows_the_device_clamp(tmp_path: Path, data_file: Path) -> None:
    assert pc.hint_chunk_for_limits(None) == 2 * MIB
    assert pc.hint_chunk_for_limits((8192 << 10, 4096 << 10)) == 2 * MIB  # the VM: min(2 MiB, 8 MiB)
    assert pc.hint_chunk_for_limits((128 << 10, 1280 << 10)) == 1280 << 10  # NVMe with default readahead
    assert pc.hint_chunk_for_limits((128 << 10, 128 << 10)) == 128 << 10
    assert pc.hint_chunk_for_limits((0, 0)) == PAGE
    # A fake /sys for the device holding data_file, as a partition of a disk.
    st = os.stat(data_file)
    disk = tmp_path / "devices/disk"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue/read_ahead_kb").write_text("128\n")
    (disk / "queue/max_sectors_kb").write_text("512\n")
    (disk / "part1").mkdir()
    (tmp_path / "dev/block").mkdir(parents=True)
    (tmp_path / "dev/block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}").symlink_to(disk / "part1")
    assert pc.device_queue_limits(data_file, sys_root=tmp_path) == (128 << 10, 512 << 10)
    assert pc.hint_chunk_bytes(data_file, sys_root=tmp_path) == 512 << 10
    assert pc.hint_chunk_bytes(data_file, sys_root=tmp_path / "missing") == 2 * MIB


# --------------------------------------------------------------------------------------------------
# The mapping and residency
# --------------------------------------------------------------------------------------------------


def test_mapped_file_exposes_fd_size_address_and_buffer(data_file: Path) -> None:
    with pc.MappedFile(data_file) as mf:
        assert mf.size == FILE_SIZE and mf.base_address % PAGE == 0
        assert os.fstat(mf.fd).st_size == FILE_SIZE
        with open(data_file, "rb") as f:
            f.seek(5 * MIB)
            expected = f.read(4096)
        assert mf.buffer[5 * MIB : 5 * MIB + 4096] == expected
        with warnings.catch_warnings():  # torch warns once per process that the buffer is read-only
            warnings.simplefilter("ignore", UserWarning)
            view = torch.frombuffer(mf.buffer, dtype=torch.uint8, count=4096, offset=5 * MIB)
        assert bytes(view.numpy()) == expected
        del view
        with pytest.raises(ValueError, match="outside"):
            mf.check_ranges([(FILE_SIZE - 1, 2)])
        assert pc.mincore_truthful(mf) and mf.truthful_mincore  # we wrote the file, so we own it
    assert mf.closed
    mf.close()  # idempotent


def test_evicted_file_is_not_resident(data_file: Path, backend: str) -> None:
    assert _evict_path(data_file) == 0
    with pc.MappedFile(data_file) as mf:
        assert pc.resident_pages(mf, RANGES) == [0, 0, 0]
        assert pc.resident_fraction(mf, RANGES) == 0.0
        assert pc.residency_map(mf).count(1) == 0


# --------------------------------------------------------------------------------------------------
# Prefetch: exactly the requested ranges, checked by residency
# --------------------------------------------------------------------------------------------------


def _assert_exactly_resident(mf: pc.MappedFile, ranges: list[tuple[int, int]]) -> None:
    assert pc.resident_pages(mf, ranges) == pc.span_pages(ranges)
    assert pc.resident_fraction(mf, ranges) == 1.0
    total, wanted = _total_resident(mf), _expected_pages(ranges)
    assert wanted <= total <= wanted + SLACK_PAGES, f"{total - wanted} pages beyond the requested ranges"


def test_prefetch_pread_makes_exactly_the_ranges_resident(mf: pc.MappedFile) -> None:
    pc.prefetch_pread(mf, RANGES, threads=4, chunk_bytes=MIB)
    _assert_exactly_resident(mf, RANGES)
    assert pc.probe_nowait(mf, RANGES) == [True, True, True]


def _assert_hint_then_fill(mf: pc.MappedFile) -> None:
    """A hint reads (nearly) all the pages, none beyond; ensure_resident() fills what it left out."""
    pc.wait_resident(mf, RANGES, timeout=10.0, stall=0.5)  # asynchronous: poll
    wanted = _expected_pages(RANGES)
    assert sum(pc.resident_pages(mf, RANGES)) >= 0.99 * wanted  # a hint may drop a page (seen 1 run in 40)
    assert _total_resident(mf) <= wanted + SLACK_PAGES
    filled = pc.ensure_resident(mf, RANGES)
    assert filled <= 0.01 * wanted * PAGE
    _assert_exactly_resident(mf, RANGES)


def test_prefetch_madvise_makes_exactly_the_ranges_resident(mf: pc.MappedFile) -> None:
    pc.prefetch_madvise(mf, RANGES)
    _assert_hint_then_fill(mf)


def test_prefetch_fadvise_makes_exactly_the_ranges_resident(mf: pc.MappedFile) -> None:
    pc.prefetch_fadvise(mf, RANGES)
    _assert_hint_then_fill(mf)


def test_missing_ranges_and_ensure_resident_fill_the_holes(mf: pc.MappedFile) -> None:
    offset, length = 10 * MIB + 100, 2 * MIB
    pc.prefetch_pread(mf, [(10 * MIB + 5 * PAGE, 3 * PAGE), (11 * MIB, MIB)])
    holes = pc.missing_ranges(mf, [(offset, length)])
    assert holes == [(10 * MIB, 5 * PAGE), (10 * MIB + 8 * PAGE, MIB - 8 * PAGE), (12 * MIB, PAGE)]
    assert pc.ensure_resident(mf, [(offset, length)]) == sum(n for _, n in holes)
    assert pc.missing_ranges(mf, [(offset, length)]) == []
    assert pc.ensure_resident(mf, [(offset, length)]) == 0
    assert pc.missing_ranges(mf, [(FILE_SIZE - 10, 10)]) == [(FILE_SIZE - PAGE, PAGE)]


def test_one_unchunked_willneed_is_clamped(mf: pc.MappedFile) -> None:
    clamp = pc.readahead_clamp_bytes(mf.path)
    if clamp is None or clamp >= 32 * MIB:
        pytest.skip(f"no readahead clamp below 32 MiB to show (clamp: {clamp})")
    pc.prefetch_madvise(mf, [(0, 32 * MIB)], chunk_bytes=0)
    pc.wait_resident(mf, [(0, 32 * MIB)], timeout=0.5)  # never completes: wait for the read to settle
    resident = _total_resident(mf) * PAGE
    assert 0 < resident <= clamp + SLACK_PAGES * PAGE, f"{resident} bytes resident, clamp {clamp}"


def test_faults_with_madv_random_read_single_pages(mf: pc.MappedFile) -> None:
    offset = 30 * MIB + 5
    assert mf.buffer[offset] is not None
    assert _total_resident(mf) <= 4  # one page (fault-around maps only what is cached)


def test_populate_read_makes_the_ranges_resident(mf: pc.MappedFile) -> None:
    if not pc.madvise_features()["MADV_POPULATE_READ"]:
        pytest.skip("MADV_POPULATE_READ needs Linux 5.14")
    pc.prefetch_populate(mf, RANGES)  # blocking: no wait needed
    _assert_exactly_resident(mf, RANGES)


# --------------------------------------------------------------------------------------------------
# Release
# --------------------------------------------------------------------------------------------------


def test_release_drops_the_ranges_and_only_them(mf: pc.MappedFile) -> None:
    pc.prefetch_pread(mf, RANGES)
    bytes(mf.buffer[RANGES[0][0] : RANGES[0][0] + RANGES[0][1]])  # also map the first range's pages
    assert pc.release(mf, RANGES[:2]) == "dontneed"
    assert pc.resident_pages(mf, RANGES) == [0, 0, pc.span_pages(RANGES[2:])[0]]


def test_release_pageout_drops_pages_mapped_by_us(mf: pc.MappedFile) -> None:
    if not pc.madvise_features()["MADV_PAGEOUT"]:
        pytest.skip("MADV_PAGEOUT needs Linux 5.4")
    offset, length = RANGES[1]
    pc.prefetch_pread(mf, [(offset, length)])
    bytes(mf.buffer[offset : offset + length])  # fault every page into our page tables
    assert pc.release(mf, [(offset, length)], method="pageout") == "pageout"
    # Best effort: pages still in another CPU's LRU-add batch cannot be isolated (seen: 24 of 1282 left).
    assert pc.resident_pages(mf, [(offset, length)])[0] <= pc.span_pages([(offset, length)])[0] // 10


def test_release_cold_keeps_the_pages(mf: pc.MappedFile) -> None:
    if not pc.madvise_features()["MADV_COLD"]:
        pytest.skip("MADV_COLD needs Linux 5.4")
    pc.prefetch_pread(mf, RANGES[:1])
    assert pc.release(mf, RANGES[:1], method="cold") == "cold"
    # A hint, not a drop: the pages stay (a drop leaves none). Cold pages are what reclaim takes first, so when
    # the machine reclaims meanwhile (the suite fills the page cache) a few may go: 13 of 2,305 once in the suite.
    resident, span = pc.resident_pages(mf, RANGES[:1])[0], pc.span_pages(RANGES[:1])[0]
    assert resident >= span * 0.95
    with pytest.raises(ValueError, match="method"):
        pc.release(mf, RANGES, method="free")


# --------------------------------------------------------------------------------------------------
# read_into and backend parity
# --------------------------------------------------------------------------------------------------


def _plain_read(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_read_into_gives_the_file_bytes(mf: pc.MappedFile, data_file: Path) -> None:
    ranges = RANGES + [(FILE_SIZE - 777, 777), (5, 0)]
    dests = [
        bytearray(RANGES[0][1]),
        torch.empty(RANGES[1][1], dtype=torch.uint8),
        np.zeros(RANGES[2][1] + 10, dtype=np.uint8),  # larger than the range is fine
        bytearray(777),
        bytearray(0),
    ]
    pc.read_into(mf, ranges, dests, threads=3, chunk_bytes=MIB + 1)  # unaligned pieces across threads
    got = [bytes(dests[0]), dests[1].numpy().tobytes(), dests[2][: RANGES[2][1]].tobytes(), bytes(dests[3]), b""]
    assert got == [_plain_read(data_file, o, n) for o, n in ranges]
    assert not dests[2][RANGES[2][1] :].any()
    # An int address, as for a pinned host tensor's data_ptr().
    target = torch.zeros(4096, dtype=torch.uint8)
    pc.read_into(mf, [(123, 4096)], [target.data_ptr()], threads=1)
    assert target.numpy().tobytes() == _plain_read(data_file, 123, 4096)


def test_read_into_rejects_bad_destinations(mf: pc.MappedFile) -> None:
    with pytest.raises(ValueError, match="holds"):
        pc.read_into(mf, [(0, 100)], [bytearray(99)])
    with pytest.raises(ValueError, match="writable"):
        pc.read_into(mf, [(0, 100)], [bytes(100)])
    with pytest.raises(ValueError, match="destinations"):
        pc.read_into(mf, [(0, 100)], [])


def test_backends_agree_on_residency_and_bytes(data_file: Path) -> None:
    if "native" not in pc.available_backends():
        pytest.skip(f"native backend unavailable: {pc.native_error()}")
    with pc.MappedFile(data_file) as mf:
        mf.set_random()
        _evict(mf)
        pc.prefetch_pread(mf, RANGES[:2])
        bytes(mf.buffer[50 * MIB + 10 : 50 * MIB + 3 * PAGE])  # a few single-page faults
        probe_ranges = RANGES + [(0, FILE_SIZE), (50 * MIB, MIB), (7, 1), (FILE_SIZE - 1, 1)]
        answers = {}
        for name in ("native", "python"):
            previous = pc.set_backend(name)
            try:
                vectors = pc.resident_pages(mf, probe_ranges), pc.residency_map(mf)
                data = [bytearray(n) for _, n in probe_ranges]
                pc.read_into(mf, probe_ranges, data, threads=2)
                answers[name] = (vectors, [bytes(d) for d in data])
            finally:
                pc.set_backend(previous)
            if name == "native":  # read_into made more pages resident: start the python pass from the same state
                # Not one release(): the pages read_into's pool threads just read on the other CPU sit in that
                # CPU's LRU batch, which FADV_DONTNEED skips until it drains, so on a loaded machine a few stayed
                # (2305 vs 2299 pages). _evict retries until none is resident.
                _evict(mf)
                pc.prefetch_pread(mf, RANGES[:2])
                bytes(mf.buffer[50 * MIB + 10 : 50 * MIB + 3 * PAGE])
        assert answers["native"] == answers["python"]
        assert answers["python"][0][0][:3] == pc.span_pages(RANGES[:2]) + [0]
        _evict(mf)


def test_probe_nowait_agrees_with_mincore(tmp_path: Path, backend: str) -> None:
    """On a file of its own: a missed probe starts a read of the page (§4.3), which would leak into other tests.

    Under I/O load, that read can even finish inside the probe (seen here with another process reading
    heavily), so a miss may come back as a hit; a hit is then true, which is what is checked.
    """
    path = tmp_path / "probe.bin"
    path.write_bytes(os.urandom(4 * MIB))
    ranges = [(0, MIB), (2 * MIB + 5, MIB)]
    assert _evict_path(path) == 0
    with pc.MappedFile(path) as mf:
        mf.set_random()
        pc.prefetch_pread(mf, ranges[:1])
        answers = pc.probe_nowait(mf, ranges)
        assert answers[0] is True
        if answers[1]:  # served by the read the probe started: its sample pages are resident now
            samples = [(o, 1) for o in pc.probe_offsets(*ranges[1], samples=3)]
            assert all(pc.resident_pages(mf, samples))
        assert pc.probe_nowait(mf.fd, [(ranges[0][0] + 7, 1)], samples=1) == [True]


# --------------------------------------------------------------------------------------------------
# Locking
# --------------------------------------------------------------------------------------------------


def test_lock_reports_and_unlocks(mf: pc.MappedFile) -> None:
    before = pc.locked_bytes()
    report = pc.lock(mf, [(PAGE + 10, 2 * PAGE)])
    assert report.locked_bytes + report.failed_bytes == 3 * PAGE
    if report.failed_bytes:
        assert report.reason and "RLIMIT_MEMLOCK" in report.reason
    else:
        assert report.reason is None and pc.locked_bytes() == before + 3 * PAGE
        assert pc.resident_pages(mf, [(PAGE, 3 * PAGE)]) == [3]  # mlock faults the pages in
    pc.unlock(mf, [(PAGE + 10, 2 * PAGE)])
    assert pc.locked_bytes() == before


_LOCK_SCRIPT = """
import ctypes, os, resource, sys, tempfile
resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))

# Drop CAP_IPC_LOCK (bit 14), which lifts the limit: capget/capset with _LINUX_CAPABILITY_VERSION_3.
class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]
libc = ctypes.CDLL(None, use_errno=True)
header, data = Header(0x20080522, 0), (Data * 2)()
assert libc.capget(ctypes.byref(header), data) == 0, ctypes.get_errno()
for field in ("effective", "permitted", "inheritable"):
    setattr(data[0], field, getattr(data[0], field) & ~(1 << 14))
assert libc.capset(ctypes.byref(header), data) == 0, ctypes.get_errno()

from vismmoe_edge.experts import pagecache as pc
assert not pc.has_cap_ipc_lock()
pc.set_backend(sys.argv[1])
path = os.path.join(sys.argv[2], "f.bin")
with open(path, "wb") as f:
    f.write(os.urandom(4 << 20))
with pc.MappedFile(path) as mf:
    small = pc.lock(mf, [(0, 512 << 10)])
    big = pc.lock(mf, [(1 << 20, 1 << 20), (3 << 20, 4096)])
    print(small.locked_bytes, small.failed_bytes, big.locked_bytes, big.failed_bytes)
    print(big.reason)
    pc.unlock(mf, [(0, 512 << 10), (3 << 20, 4096)])
    print(pc.locked_bytes())
"""


def test_lock_stays_within_rlimit_memlock(backend: str, tmp_path: Path) -> None:
    """In a child with a 1 MiB RLIMIT_MEMLOCK and no CAP_IPC_LOCK: what fits is locked, the rest reported."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", _LOCK_SCRIPT, backend, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    counts, reason, after = result.stdout.strip().splitlines()
    # 512 KiB fits; then 1 MiB more would pass the limit (ENOMEM) while one more page still fits.
    assert counts.split() == [str(512 << 10), "0", str(4096), str(1 << 20)]
    assert "RLIMIT_MEMLOCK" in reason and "ENOMEM" in reason and "not held" in reason
    assert after == "0"


# --------------------------------------------------------------------------------------------------
# Backend selection
# --------------------------------------------------------------------------------------------------


def test_env_var_forces_the_python_backend() -> None:
    code = "from vismmoe_edge.experts import pagecache as pc; print(pc.backend(), pc.native_error())"
    env = dict(os.environ, VISMMOE_NATIVE="0", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.startswith("python disabled by VISMMOE_NATIVE=0")
