"""tools/device/igpu_checks.py without CUDA: CUDA checks are recorded as skipped, the CPU dry run of the
equivalence matrix gives transformers' tokens (fp32) with the bytes per token filled in, a failing check is
recorded and the run goes on."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "device" / "igpu_checks.py"


def load():
    spec = importlib.util.spec_from_file_location("igpu_checks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_every_check_is_skipped(tmp_path: Path) -> None:
    rc = load().main(["--out", str(tmp_path / "igpu.json")])
    summary = json.loads((tmp_path / "igpu.json").read_text())
    assert rc == 0 and summary["failed"] == [] and summary["default_igpu_tier"] == "unified-slots"
    assert summary["checks"] and all(c["status"] == "skipped" for c in summary["checks"])


def test_the_cpu_dry_run_of_the_matrix_matches_transformers_in_fp32(tmp_path: Path) -> None:
    load().main(["--cpu-dry-run", "--out", str(tmp_path / "igpu.json")])
    checks = {c["name"]: c for c in json.loads((tmp_path / "igpu.json").read_text())["checks"]}
    fp32 = {n: c for n, c in checks.items() if "float32" in n and "=" in n}
    assert len(fp32) == 4 and all(c["status"] == "pass" for c in fp32.values()), fp32
    at_10 = checks["unified-slots 10% torch.float32 v5 = transformers"]
    assert at_10["misses"] > 0 and at_10["read_bytes_per_token"] > 0 and at_10["host_to_device_bytes"] == 0


def test_a_failing_check_is_recorded_and_the_run_goes_on() -> None:
    checks = load().Checks(needs_cuda=False)

    def broken() -> dict:
        raise RuntimeError("no libcudart")

    checks.run("broken", broken)
    checks.run("fine", lambda: {"value": 1})
    assert [c["status"] for c in checks.results] == ["fail", "pass"]
    assert "no libcudart" in checks.results[0]["error"]
