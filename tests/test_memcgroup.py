"""tools/bench/memcgroup.py, for real: a v1 memory cgroup caps page cache and anonymous memory of the child it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench import memcgroup  # noqa: E402

MiB = 1 << 20
_OK, _WHY = memcgroup.memory_cgroup_support()
needs_cgroup = pytest.mark.skipif(not _OK, reason=f"no usable cgroup v1 memory controller: {_WHY}")


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memcg") / "f256"
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for i in range(256):
            f.write(block[i:] + block[:i])  # 256 MiB of distinct pages
    return path


def test_parse_size() -> None:
    assert memcgroup.parse_size("4GiB") == 4 << 30
    assert memcgroup.parse_size("512MiB") == 512 * MiB
    assert memcgroup.parse_size("6.14GB") == 6_140_000_000
    assert memcgroup.parse_size("40%", whole=1000) == 400
    with pytest.raises(ValueError):
        memcgroup.parse_size("40%")
    with pytest.raises(ValueError):
        memcgroup.parse_size("4 parsecs")


def test_disk_counters_are_readable() -> None:
    assert memcgroup.disk_read_bytes() >= 0
    assert memcgroup.proc_read_bytes() >= 0
    assert all("read_ahead_kb" in v for v in memcgroup.readahead_settings().values())


def test_evict_and_resident(big_file: Path) -> None:
    with open(big_file, "rb") as f:
        while f.read(8 * MiB):
            pass
    assert memcgroup.resident_bytes([big_file]) > 200 * MiB
    assert memcgroup.evict_page_cache([big_file]) == 256 * MiB
    assert memcgroup.resident_bytes([big_file]) < 8 * MiB


@needs_cgroup
def test_page_cache_of_a_read_stays_under_the_cap(big_file: Path) -> None:
    limit = 64 * MiB
    reader = "import sys\nf = open(sys.argv[1], 'rb')\nwhile f.read(1 << 20): pass\n"
    res = memcgroup.run_capped([sys.executable, "-c", reader, str(big_file)], limit, evict=[big_file], name="t-cache")
    assert res.returncode == 0, res.summary()
    assert res.resident_after_evict < 8 * MiB
    assert res.max_usage_bytes <= limit, res.summary()
    assert res.stat["cache"] <= limit
    assert res.read_bytes >= 250 * MiB  # the whole file came from disk, through a 64 MiB cache
    assert not res.oom_killed
    assert not Path(res.cgroup).exists()  # removed afterwards
    assert memcgroup.resident_bytes([big_file]) <= limit  # force_empty on removal dropped (at least) the rest


@needs_cgroup
def test_anonymous_memory_over_the_cap_is_oom_killed() -> None:
    hog = "b = bytearray(256 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('survived')"
    with memcgroup.MemoryCgroup("t-anon", "64MiB") as cg:
        res = cg.run([sys.executable, "-c", hog], capture_output=True)
        assert Path(cg.path).is_dir()
        assert (cg.path / "memory.limit_in_bytes").read_text().strip() == str(64 * MiB)
    assert not cg.path.exists()
    assert res.oom_killed and res.returncode == -9, res.summary()
    assert res.oom_kills >= 1
    assert "survived" not in (res.stdout or "")
    assert res.max_usage_bytes <= 64 * MiB


@needs_cgroup
def test_cli(big_file: Path) -> None:
    tool = Path(memcgroup.__file__)
    out = subprocess.run(
        [sys.executable, str(tool), "--limit", "25%", "--evict", str(big_file), "--json", "--", "cat", str(big_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False,
    )
    assert out.returncode == 0, out.stderr
    import json

    res = json.loads(out.stderr)
    assert res["limit_bytes"] == 64 * MiB and res["max_usage_bytes"] <= 64 * MiB
    assert res["read_bytes"] >= 250 * MiB
