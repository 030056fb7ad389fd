"""tools/device/quant_checks.py without CUDA: the CPU check passes, CUDA checks are skipped, a failure does not
stop it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "device" / "quant_checks.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_quant_checks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runs_and_writes_json(tmp_path: Path) -> None:
    script = load()
    rc = script.main(["--out", str(tmp_path / "quant.json"), "--quick"])
    summary = json.loads((tmp_path / "quant.json").read_text())
    by_name = {c["name"]: c for c in summary["checks"]}
    assert by_name["cpu int4 expert (30b) vs dequantized"]["status"] == "pass"
    assert sum(summary["counts"].values()) == len(summary["checks"]) > 10
    if not torch.cuda.is_available():
        assert rc == 0 and all(c["status"] == "skipped" for n, c in by_name.items() if n.startswith("cuda"))


def test_a_failing_check_is_recorded_and_the_run_goes_on() -> None:
    script = load()
    checks = script.Checks(quick=True)

    def broken() -> dict:
        raise RuntimeError("kernel missing")

    checks.run("broken", broken, needs_cuda=False)
    checks.run("fine", lambda: {"ok": True, "value": 1}, needs_cuda=False)
    checks.run("wrong", lambda: {"ok": False}, needs_cuda=False)
    assert [c["status"] for c in checks.results] == ["fail", "pass", "fail"]
    assert "kernel missing" in checks.results[0]["error"] and checks.results[1]["value"] == 1


def test_the_engine_checks_run_and_write_json(tmp_path: Path) -> None:
    """tools/device/quant_engine_checks.py: every check registered; without CUDA all are skipped, exit status 0."""
    spec = importlib.util.spec_from_file_location(
        "quant_engine_checks", SCRIPT.parent / "quant_engine_checks.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rc = module.main(["--out", str(tmp_path / "engine.json"), "--quick", "--work", str(tmp_path / "work")])
    summary = json.loads((tmp_path / "engine.json").read_text())
    names = [c["name"] for c in summary["checks"]]
    assert len(names) == len(set(names)) >= 11 and all(n.startswith("cuda") for n in names)
    if not torch.cuda.is_available():
        assert rc == 0 and summary["counts"] == {"pass": 0, "fail": 0, "skipped": len(names)}
