"""vismmoe_edge.hardware.doctor on this host (CPU only, no jtop) and on recorded Jetson board trees."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vismmoe_edge.hardware import doctor, system
from vismmoe_edge.hardware.doctor import Check, format_checks, healthy, run_checks

BOARDS = Path(__file__).parent / "fixtures" / "boards"

EXPECTED_NAMES = [
    "python",
    "torch",
    "transformers",
    "safetensors",
    "cuda",
    "gpu access",
    "jetson",
    "jtop",
    "onnxruntime",
    "kernel",
    "madvise MADV_WILLNEED",
    "madvise MADV_COLD",
    "madvise MADV_PAGEOUT",
    "madvise MADV_POPULATE_READ",
    "RLIMIT_MEMLOCK",
    "MemAvailable",
]


@pytest.fixture(scope="module")
def host_checks() -> list[Check]:
    return run_checks()


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {check.name: check for check in checks}


# --- this host ------------------------------------------------------------------------------------


def test_host_run_includes_every_named_check_in_order(host_checks):
    assert [check.name for check in host_checks] == EXPECTED_NAMES


def test_host_run_has_no_crashed_checks_and_every_failure_has_a_fix(host_checks):
    for check in host_checks:
        assert isinstance(check, Check)
        assert "crashed" not in check.detail, check
        assert check.detail and "\n" not in check.detail
        if not check.ok:
            assert check.fix, check


def test_host_has_the_runtime_dependencies(host_checks):
    checks = by_name(host_checks)
    for name in ("python", "torch", "transformers", "safetensors", "onnxruntime"):
        assert checks[name].ok and checks[name].required, checks[name]
    assert "Qwen3VLMoeForConditionalGeneration" in checks["transformers"].detail
    assert "CPUExecutionProvider" in checks["onnxruntime"].detail


def test_jtop_is_reported_missing_with_a_fix(host_checks):
    jtop = by_name(host_checks)["jtop"]
    assert not jtop.ok
    assert not jtop.required
    assert jtop.status == "missing"
    assert "jetson-stats" in jtop.fix


def test_a_cpu_only_desktop_is_healthy(host_checks):
    checks = by_name(host_checks)
    if system.cuda_info()["device_count"]:
        pytest.skip("this host has a GPU")
    assert checks["cuda"].ok and checks["cuda"].status == "info"
    assert "CPU only" in checks["cuda"].detail
    assert checks["jetson"].status == "info"
    assert healthy(host_checks)


def test_host_madvise_lines_match_the_kernel(host_checks):
    checks = by_name(host_checks)
    supported = system.madvise_features(system.kernel_version())
    for name, ok in supported.items():
        assert checks[f"madvise {name}"].ok is ok


def test_format_prints_one_aligned_line_per_check(host_checks):
    lines = format_checks(host_checks).splitlines()
    assert len(lines) == len(host_checks)
    for line, check in zip(lines, host_checks, strict=True):
        assert line.startswith(f"{check.status:<8}{check.name}")
    jtop_line = lines[EXPECTED_NAMES.index("jtop")]
    assert jtop_line.startswith("missing jtop: not installed")
    assert " -> fix: " in jtop_line


# --- Check and format_checks ----------------------------------------------------------------------


def test_format_of_passing_and_failing_lines():
    checks = [
        Check("torch", True, "2.13.0+cpu"),
        Check("jtop", False, "not installed", fix="pip install jetson-stats", required=False, status="missing"),
        Check("python", False, "3.9.18 is older than 3.10\nreally", fix="use 3.10"),
    ]
    assert format_checks(checks).splitlines() == [
        "ok      torch 2.13.0+cpu",
        "missing jtop: not installed -> fix: pip install jetson-stats",
        "FAIL    python: 3.9.18 is older than 3.10 really -> fix: use 3.10",
    ]


def test_status_follows_ok_and_required():
    assert Check("a", True, "x").status == "ok"
    assert Check("a", False, "x").status == "FAIL"
    assert Check("a", False, "x", required=False).status == "warn"
    assert not healthy([Check("a", True, "x"), Check("b", False, "x")])
    assert healthy([Check("a", True, "x"), Check("b", False, "x", required=False)])


# --- recorded Jetson boards -----------------------------------------------------------------------


def test_agx_orin_board_tree():
    checks = by_name(run_checks(BOARDS / "agx-orin-64gb-jp6"))
    assert list(checks) == EXPECTED_NAMES
    assert checks["jetson"].ok
    assert checks["jetson"].detail == "AGX Orin 64GB, L4T 36.4.4, JetPack 6.2.1"
    assert checks["MemAvailable"].detail == "57.6 GiB of 61.4 GiB"
    # This venv's onnxruntime is the CPU build: on JetPack 6 the GPU wheel comes from Jetson AI Lab.
    assert doctor.JETSON_AI_LAB_JP6_INDEX in checks["onnxruntime"].detail
    if not system.cuda_info()["device_count"]:
        assert not checks["cuda"].ok and not checks["cuda"].required
        assert doctor.JETSON_AI_LAB_JP6_INDEX in checks["cuda"].fix
    assert "jtop.service" in checks["jtop"].fix or "jetson-stats" in checks["jtop"].fix


def test_jetpack5_board_points_onnxruntime_at_the_jetson_zoo():
    checks = by_name(run_checks(BOARDS / "orin-nx-16gb-jp5"))
    assert checks["jetson"].detail == "Orin NX 16GB, L4T 35.4.1, JetPack 5.1.2"
    assert "elinux.org/Jetson_Zoo" in checks["onnxruntime"].detail


def test_madvise_on_a_fixture_root_follows_its_kernel_not_this_one(tmp_path):
    (tmp_path / "proc/sys/kernel").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/osrelease").write_text("5.10.120-tegra\n")
    checks = by_name(doctor.check_madvise(tmp_path))
    assert checks["madvise MADV_COLD"].ok
    populate = checks["madvise MADV_POPULATE_READ"]
    assert not populate.ok and not populate.required
    assert "5.14" in populate.detail and "JetPack 6" in populate.fix
    assert doctor.check_kernel(tmp_path).detail == "5.10.120-tegra"


# --- jtop: optional, and never allowed to crash the doctor ----------------------------------------


def fake_jtop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    package = tmp_path / "site" / "jtop"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    # Recorded as "absent", so teardown removes whatever fake jtop the test imports.
    monkeypatch.setitem(sys.modules, "jtop", None)
    del sys.modules["jtop"]


@pytest.mark.parametrize(
    "body",
    [
        "raise OSError('no i2c bus')\n",
        "raise SystemExit(1)\n",
        "import smbus2_that_is_not_there\n",
        "print('Skip for setup.py')\nraise RuntimeError('boom')\n",
    ],
)
def test_a_jtop_import_that_raises_becomes_a_failed_line(tmp_path, monkeypatch, capsys, body):
    fake_jtop(tmp_path, monkeypatch, body)
    check = doctor.check_jtop(Path("/"), None)
    assert not check.ok and not check.required and check.fix
    assert check.status == "warn"
    assert "import failed" in check.detail
    assert capsys.readouterr().out == ""  # what jtop prints on import stays out of the report


def test_jtop_installed_but_service_down(tmp_path, monkeypatch):
    fake_jtop(tmp_path, monkeypatch, "__version__ = '4.3.2'\n")
    board = system.detect_jetson(BOARDS / "agx-orin-64gb-jp6")
    check = doctor.check_jtop(BOARDS / "agx-orin-64gb-jp6", board)
    assert not check.ok
    assert "4.3.2" in check.detail
    assert check.fix.startswith("sudo systemctl start jtop.service")


def test_jtop_installed_and_service_socket_reachable(tmp_path, monkeypatch):
    fake_jtop(tmp_path, monkeypatch, "__version__ = '4.3.2'\n")
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "run/jtop.sock").touch()
    check = doctor.check_jtop(root, None)
    assert check.ok and check.status == "ok"


def test_a_crashing_check_becomes_a_failed_line(monkeypatch):
    def broken(root):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(doctor, "check_mem_available", broken)
    checks = by_name(run_checks(BOARDS / "x86-desktop"))
    assert list(checks) == EXPECTED_NAMES
    crashed = checks["MemAvailable"]
    assert not crashed.ok and crashed.fix
    assert "kaboom" in crashed.detail


def test_board_detection_crash_is_reported_not_raised(monkeypatch):
    def broken(root):
        raise UnicodeError("bad model")

    monkeypatch.setattr(system, "detect_jetson", broken)
    checks = by_name(run_checks(BOARDS / "x86-desktop"))
    assert not checks["jetson"].ok
    assert "bad model" in checks["jetson"].detail
