"""Telemetry samplers (jtop absent or down, psutil and /proc) and `profile` on the demo model."""

from __future__ import annotations

import csv
import json
import sys
import time
import types
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from vismmoe_edge.cli.profile import profile_command
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.evaluation.profiling import load_requests, write_plots
from vismmoe_edge.hardware import monitor

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# jtop 7.2.2's start() off-Jetson or with its service down (notes/jetson.md §4.4).
SERVICE_DOWN = "The jtop.service is not active. Please run:\nsudo jtop --install-service"


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(monitor, "_notices", set())


def fake_jtop_module(start_error: str | None = None, **attributes: object) -> types.ModuleType:
    """A stand-in for the jetson-stats client: `from jtop import jtop, JtopException`."""
    module = types.ModuleType("jtop")

    class JtopException(Exception):
        pass

    class jtop:  # noqa: N801 - the real class name
        def __init__(self, interval: float = 0.5) -> None:
            self.__dict__.update(attributes)

        def start(self) -> None:
            if start_error is not None:
                raise JtopException(start_error)

        def ok(self, spin: bool = False) -> bool:
            return True

        def close(self) -> None:
            pass

    module.jtop = jtop  # type: ignore[attr-defined]
    module.JtopException = JtopException  # type: ignore[attr-defined]
    return module


def test_jtop_service_down_says_so_once_and_falls_back(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(start_error=SERVICE_DOWN))
    for _ in range(3):
        samplers = monitor.open_samplers(0.1, jetson=True)
        assert [s.name for s in samplers] in (["psutil"], ["proc"])  # no jtop; psutil if installed
        assert samplers[0].sample()["rss_bytes"] > 0
    err = capsys.readouterr().err
    assert err.count("note:") == 1
    assert "The jtop.service is not active. Please run: sudo jtop --install-service" in err


def test_jtop_not_installed_says_so_once(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "jtop", None)  # makes `import jtop` raise ModuleNotFoundError
    with pytest.raises(monitor.SamplerUnavailable, match="not installed"):
        monitor.JtopSampler()
    monitor.open_samplers(0.1, jetson=False)
    monitor.open_samplers(0.1, jetson=False)
    assert capsys.readouterr().err.count("jtop is not installed") == 1


def test_jtop_sampler_reads_rails_temperatures_gpu_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    jetson = {
        "power": {
            "rail": {
                "VDD_GPU_SOC": {"online": True, "power": 4200, "avg": 4000},
                "VDD_CPU_CV": {"online": True, "power": 1300, "avg": 1200},
            },
            "tot": {"power": 9800, "avg": 9500},
        },
        "temperature": {"cpu": {"online": True, "temp": 51.5}, "cv0": {"online": False, "temp": -256}},
        "gpu": {"gpu": {"status": {"load": 87.0}, "freq": {"cur": 612000}}},
        "memory": {
            "RAM": {"tot": 7_600_000, "used": 5_000_000, "shared": 1_000_000},
            "SWAP": {"tot": 4_000_000, "used": 10_000},
            "EMC": {"online": True, "val": 63, "cur": 3_199_000},
        },
    }
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(**jetson))
    row = monitor.JtopSampler().sample()
    assert row["power_total_mw"] == 9800
    assert row["power_vdd_gpu_soc_mw"] == 4200 and row["power_vdd_cpu_cv_mw"] == 1300
    assert row["temp_cpu_c"] == 51.5 and "temp_cv0_c" not in row
    assert row["gpu_util_percent"] == 87.0 and row["gpu_clock_mhz"] == 612
    assert row["ram_used_bytes"] == 5_000_000 * 1024 and row["ram_gpu_shared_bytes"] == 1_000_000 * 1024
    assert row["emc_util_percent"] == 63 and row["emc_clock_mhz"] == 3199


@pytest.mark.parametrize("use_psutil", [False, True], ids=["proc", "psutil"])
def test_process_sampler_numbers_are_sane(use_psutil: bool) -> None:
    if use_psutil:
        pytest.importorskip("psutil")
    sampler = monitor.PsutilSampler(use_psutil=use_psutil)
    assert sampler.backend == ("psutil" if use_psutil else "proc")
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # burn some CPU so the process share is measurable
        sum(range(1000))
    row = sampler.sample()
    assert 1 << 20 < row["rss_bytes"] < row["mem_total_bytes"]
    assert 0 < row["mem_available_bytes"] <= row["mem_total_bytes"]
    assert row["mem_used_bytes"] == pytest.approx(row["mem_total_bytes"] - row["mem_available_bytes"])
    assert row["swap_used_bytes"] >= 0
    assert 0 <= row["cpu_percent"] <= 100 * 512 and 0 <= row["sys_cpu_percent"] <= 100.0001


def test_monitor_samples_in_background_and_drops_a_broken_sampler(capsys: pytest.CaptureFixture[str]) -> None:
    class Broken(monitor.Sampler):
        name = "broken"

        def sample(self) -> monitor.Row:
            raise OSError("sensor vanished")

    with monitor.Monitor([monitor.PsutilSampler(use_psutil=False), Broken()], interval=0.05) as mon:
        time.sleep(0.3)
    assert len(mon.rows) >= 3
    assert all(b["time"] > a["time"] for a, b in zip(mon.rows, mon.rows[1:], strict=False))
    assert all("rss_bytes" in row for row in mon.rows)
    assert mon.sampler_names == ["proc", "broken"]
    assert capsys.readouterr().err.count("broken sampling stopped: sensor vanished") == 1


def test_no_matplotlib_means_one_notice_and_no_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    rows = [{"time": 1.0, "elapsed_s": 0.0, "rss_bytes": 1.0}]
    assert write_plots(tmp_path, rows, [], {}, "t") == []
    assert write_plots(tmp_path, rows, [], {}, "t") == []
    assert capsys.readouterr().err.count("pip install matplotlib") == 1


def test_prompts_file_errors_name_the_line(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "look", "images": ["missing.png"]}\n')
    with pytest.raises(VismmoeError, match=r"p.jsonl:2: image .*missing.png does not exist"):
        load_requests(prompts)


def test_profile_on_the_demo_model_writes_csvs_summary_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from vismmoe_edge.evaluation.sample import ensure_sample_image

    image = ensure_sample_image()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "Describe the image.", "images": [str(image)]})
        + "\n"
        + json.dumps({"prompt": "Which colours do you see?", "images": [str(image)]})
        + "\n"
    )
    out = tmp_path / "out"
    app = typer.Typer()
    app.command("profile")(profile_command)
    app.command("noop")(lambda: None)
    args = ["profile", "--prompts", str(prompts), "--max-new-tokens", "4", "--ignore-eos"]
    args += ["--memory-budget", "50%", "--interval", "0.1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.output

    with open(out / "tokens.csv") as f:
        tokens = list(csv.DictReader(f))
    assert len(tokens) == 2 * 4
    assert {t["request"] for t in tokens} == {"0", "1"}
    assert all(float(t["latency_ms"]) > 0 and 0 <= float(t["hit_rate"]) <= 1 for t in tokens)
    with open(out / "samples.csv") as f:
        samples = list(csv.DictReader(f))
    assert len(samples) >= 2 and float(samples[-1]["rss_bytes"]) > 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["tokens"] == 8 and summary["requests"] == 2
    assert summary["tokens_per_s"] > 0 and summary["peak_rss_bytes"] > 0
    assert {"psutil", "proc"} & set(summary["samplers"])
    assert 0 <= summary["hit_rate"] <= 1 and len(summary["per_request"]) == 2
    assert summary["tokens_per_joule"] is None or summary["tokens_per_joule"] > 0
    for name in ("profile.png", "power.png", "memory.png", "latency.png", "hit_rate.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE, name
