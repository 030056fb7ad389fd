"""The unified benchmark's steady-state rule (issue 25) and the host probe that found why it is needed."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench import hostprobe  # noqa: E402
from bench.unified import median_of, trial_order  # noqa: E402


def test_every_measured_trial_follows_its_own_warmups_interleaved() -> None:
    order = trial_order(["ours", "llama"], [1000, 2000], interleave=True, warmups=1)
    assert order == [
        ("ours", 1000, False), ("ours", 1000, True),
        ("llama", 1000, False), ("llama", 1000, True),
        ("ours", 2000, False), ("ours", 2000, True),
        ("llama", 2000, False), ("llama", 2000, True),
    ]
    # the rule: the trial right before a measured one is the same strategy and start, never another engine's
    for prev, cur in zip(order, order[1:], strict=False):
        if cur[2]:
            assert prev[:2] == cur[:2] and not prev[2]


def test_trial_order_grouped_and_without_warmups() -> None:
    grouped = trial_order(["a", "b"], [1, 2], interleave=False, warmups=2)
    assert [t for t in grouped if t[2]] == [("a", 1, True), ("a", 2, True), ("b", 1, True), ("b", 2, True)]
    assert len(grouped) == 4 * 3
    assert grouped[:3] == [("a", 1, False), ("a", 1, False), ("a", 1, True)]
    assert trial_order(["a", "b"], [1], interleave=True, warmups=0) == [("a", 1, True), ("b", 1, True)]


def test_median_of_uses_measured_trials_only_and_records_warmups() -> None:
    measured = [{"strategy": "x", "decode_s_per_token": s, "decode_tokens_per_s": 1 / s} for s in (0.04, 0.05, 0.1)]
    warm = [{"strategy": "x", "decode_s_per_token": 0.25, "decode_tokens_per_s": 4.0}, {"error": "rc=-9"}]
    row = median_of(measured, warm)
    assert row["decode_tokens_per_s"] == 1 / 0.05
    assert row["trials"] == 3
    assert row["warmup_tokens_per_s"] == [4.0, None]
    assert "warmup_tokens_per_s" not in median_of(measured)


def test_host_probe_delta(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 100\npgmajfault 7\npgfault 50\nunrelated 3\n")
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 40 0 10 0 0 0\ncpu0 1 2 3 4 5 6 7 8\n")
    assert hostprobe.read_vmstat(vmstat) == {"nr_free_pages": 100, "pgmajfault": 7, "pgfault": 50}
    before = {"t": 1.0, "loadavg_1m": 2.5, "cpu_mhz": 2000.0, **{f"cpu.{k}": v for k, v in
              hostprobe.read_cpu_jiffies(stat).items()}, "vm.pgmajfault": 7}
    after = {"t": 3.5, "loadavg_1m": 0.1, "cpu_mhz": 2100.0, "cpu.user": 160, "cpu.nice": 0, "cpu.system": 60,
             "cpu.idle": 820, "cpu.iowait": 40, "cpu.irq": 0, "cpu.softirq": 10, "cpu.steal": 10, "vm.pgmajfault": 19}
    d = hostprobe.delta(before, after)
    assert d["seconds"] == 2.5 and d["vm.pgmajfault"] == 12
    assert d["loadavg_1m"] == 2.5 and d["cpu_mhz"] == 2000.0  # gauges: the value before
    assert d["cpu.user"] == 60 and d["cpu.steal"] == 10
    assert d["cpu_share.user"] == 0.6 and d["cpu_share.idle"] == 0.2 and d["cpu_share.steal"] == 0.1


def test_host_probe_snapshot_reads_this_host() -> None:
    snap = hostprobe.snapshot()
    assert snap["cpu.idle"] > 0 and snap["vm.pgfault"] > 0 and snap["disk_read_bytes"] >= 0


def test_report_lists_resident_rows_and_warmups() -> None:
    from bench.report_unified import table

    rows = [
        {"strategy": "q:popularity", "cap": 0.4, "decode_tokens_per_s": 10.0, "decode_tokens_per_s_all": [10.0, 9.0],
         "warmup_tokens_per_s": [3.0, None]},
        {"strategy": "llama.cpp Q4_K_M", "cap": 0.4, "decode_tokens_per_s": 20.0},
        {"strategy": "q:resident", "cap": None, "decode_tokens_per_s": 14.0},
        {"strategy": "llama.cpp Q4_K_M", "cap": None, "decode_tokens_per_s": 35.0},
    ]
    lines = table({"results": rows}).splitlines()
    assert lines[2].startswith("| 40% | q:popularity | 10.00 (10.00, 9.00; warm-ups 3.00, -) |")
    assert "| 0.50x |" in lines[2]
    assert lines[4].startswith("| none | q:resident | 14.00 (-) |") and "| 0.40x |" in lines[4]
