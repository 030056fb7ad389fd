"""vismmoe_edge.hardware.system against recorded board trees (tests/fixtures/boards/<board>/)."""

from __future__ import annotations

import mmap
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vismmoe_edge.hardware import system

BOARDS = Path(__file__).parent / "fixtures" / "boards"
GIB = 1 << 30


# --- kernel ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        ("5.15.148-tegra", (5, 15, 148)),  # JetPack 6
        ("5.10.120-tegra", (5, 10, 120)),  # JetPack 5
        ("6.8.12-tegra", (6, 8, 12)),  # JetPack 7
        ("6.18.44-fc-v669", (6, 18, 44)),
        ("6.1", (6, 1, 0)),
    ],
)
def test_kernel_version_parses_release_strings(release, expected):
    assert system.kernel_version(release) == expected


def test_kernel_version_defaults_to_this_kernel():
    import os

    assert system.kernel_version() == system.kernel_version(os.uname().release)


def test_kernel_version_rejects_garbage():
    with pytest.raises(ValueError, match="tegra"):
        system.kernel_version("tegra")


# --- madvise --------------------------------------------------------------------------------------


def test_jetpack5_kernel_lacks_populate_read_but_has_cold_and_pageout():
    features = system.madvise_features((5, 10, 120))
    assert features == {
        "MADV_WILLNEED": True,
        "MADV_COLD": True,
        "MADV_PAGEOUT": True,
        "MADV_POPULATE_READ": False,
    }


def test_jetpack6_kernel_has_every_advice():
    assert all(system.madvise_features((5, 15, 148)).values())


def test_feature_gates_sit_at_5_4_and_5_14():
    assert system.madvise_features((5, 3, 99))["MADV_COLD"] is False
    assert system.madvise_features((5, 4, 0))["MADV_PAGEOUT"] is True
    assert system.madvise_features((5, 13, 19))["MADV_POPULATE_READ"] is False
    assert system.madvise_features((5, 14, 0))["MADV_POPULATE_READ"] is True


def test_madvise_values_are_the_linux_uapi_numbers():
    assert {a.name: a.value for a in system.MADVISE_ADVICE} == {
        "MADV_WILLNEED": 3,
        "MADV_COLD": 20,
        "MADV_PAGEOUT": 21,
        "MADV_POPULATE_READ": 22,
    }
    assert system.madvise_value("MADV_WILLNEED") == mmap.MADV_WILLNEED == 3
    assert system.madvise_value("MADV_POPULATE_READ") == 22


def test_mmap_constant_report_matches_the_mmap_module():
    exposed = system.mmap_madvise_constants()
    assert exposed == {name: hasattr(mmap, name) for name in exposed}
    assert exposed["MADV_WILLNEED"] is True


def test_probe_accepts_willneed_and_refuses_an_unknown_advice():
    assert system.probe_madvise(3) is True
    assert system.probe_madvise(12345) is False


def test_raw_advice_ints_pass_through_mmap_madvise():
    # The reason no ctypes is needed for COLD/PAGEOUT/POPULATE_READ (linux-io.md §8).
    with mmap.mmap(-1, mmap.PAGESIZE) as mapping:
        mapping.madvise(system.madvise_value("MADV_COLD"), 0, mmap.PAGESIZE)


# --- Jetson boards --------------------------------------------------------------------------------


def test_agx_orin_64gb_on_jetpack_6():
    board = system.detect_jetson(BOARDS / "agx-orin-64gb-jp6")
    assert board is not None
    assert board.model == "NVIDIA Jetson AGX Orin Developer Kit"
    assert board.family == "AGX Orin"
    assert board.memory_gb == 64  # the devkit model string never says: MemTotal 61.4 GiB does
    assert board.module == "AGX Orin 64GB"
    assert board.l4t == (36, 4, 4)
    assert board.l4t_version == "36.4.4"
    assert board.jetpack_major == 6
    assert board.jetpack == "6.2.1"
    assert board.super_variant is False
    assert board.describe() == "AGX Orin 64GB, L4T 36.4.4, JetPack 6.2.1"


def test_orin_nano_8gb_super_on_jetpack_6_2():
    board = system.detect_jetson(BOARDS / "orin-nano-8gb-super-jp6")
    assert board is not None
    assert board.module == "Orin Nano 8GB"
    assert board.super_variant is True
    assert board.l4t == (36, 4, 3)
    assert (board.jetpack_major, board.jetpack) == (6, "6.2")
    assert board.describe() == "Orin Nano 8GB (Super), L4T 36.4.3, JetPack 6.2"


def test_orin_nx_16gb_on_jetpack_5():
    board = system.detect_jetson(BOARDS / "orin-nx-16gb-jp5")
    assert board is not None
    assert board.model == "NVIDIA Orin NX Developer Kit"  # trailing NUL stripped
    assert board.module == "Orin NX 16GB"
    assert board.l4t == (35, 4, 1)
    assert (board.jetpack_major, board.jetpack) == (5, "5.1.2")
    assert board.super_variant is False


def test_x86_desktop_is_not_a_jetson():
    assert system.detect_jetson(BOARDS / "x86-desktop") is None


def test_other_arm_boards_are_not_jetsons(tmp_path):
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_bytes(b"Raspberry Pi 4 Model B Rev 1.4\x00")
    assert system.detect_jetson(tmp_path) is None


def test_module_part_number_in_compatible_beats_the_memory_guess(tmp_path):
    shutil.copytree(BOARDS / "orin-nano-8gb-super-jp6", tmp_path, dirs_exist_ok=True)
    compatible = b"nvidia,p3768-0000+p3767-0004-super\x00nvidia,p3767-0004\x00nvidia,tegra234\x00"
    (tmp_path / "proc/device-tree/compatible").write_bytes(compatible)
    board = system.detect_jetson(tmp_path)
    assert board is not None
    assert board.part_number == "p3767-0004"
    assert board.module == "Orin Nano 4GB"
    assert board.super_variant is True


def test_container_without_nv_tegra_release_still_names_the_board(tmp_path):
    shutil.copytree(BOARDS / "agx-orin-64gb-jp6", tmp_path, dirs_exist_ok=True)
    (tmp_path / "etc/nv_tegra_release").unlink()
    board = system.detect_jetson(tmp_path)
    assert board is not None
    assert board.module == "AGX Orin 64GB"
    assert (board.l4t, board.jetpack_major, board.jetpack) == (None, None, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64", (36, 4, 3)),
        ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64", (35, 4, 1)),
        ("# R32 (release), REVISION: 7\n", (32, 7, 0)),
        ("not a release file", None),
        ("", None),
    ],
)
def test_parse_l4t_release(text, expected):
    assert system.parse_l4t_release(text) == expected


def test_unknown_point_release_still_gives_the_jetpack_major():
    assert system.jetpack_for_l4t((36, 9, 9)) == (6, None)
    assert system.jetpack_for_l4t((38, 2, 0))[0] == 7
    assert system.jetpack_for_l4t((99, 0, 0)) == (None, None)


@pytest.mark.parametrize(
    ("mem_total_gib", "nominal"),
    [(7.43, 8), (3.3, 4), (15.2, 16), (29.0, 32), (61.4, 64), (5.5, None), (200.0, None)],
)
def test_nominal_memory_from_mem_total(mem_total_gib, nominal):
    assert system.nominal_memory_gb(int(mem_total_gib * GIB)) == nominal


# --- memory and limits ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("board", "available_kib", "total_kib"),
    [
        ("agx-orin-64gb-jp6", 60412876, 64349016),
        ("orin-nano-8gb-super-jp6", 5243904, 7789952),
        ("orin-nx-16gb-jp5", 12582912, 15919220),
        ("x86-desktop", 58720256, 65762304),
    ],
)
def test_mem_available_from_fixture_meminfo(board, available_kib, total_kib):
    assert system.mem_available_bytes(BOARDS / board) == available_kib * 1024
    assert system.mem_total_bytes(BOARDS / board) == total_kib * 1024


def test_meminfo_without_mem_available_is_an_error(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:        8000000 kB\nMemFree:         1000 kB\n")
    with pytest.raises(ValueError, match="MemAvailable"):
        system.mem_available_bytes(tmp_path)


def test_this_host_meminfo_is_plausible():
    assert 0 < system.mem_available_bytes() <= system.mem_total_bytes()


def test_memlock_limit_is_the_rlimit():
    assert system.memlock_limit() == resource.getrlimit(resource.RLIMIT_MEMLOCK)


# --- CUDA -----------------------------------------------------------------------------------------


def test_cuda_info_answers_without_raising():
    info = system.cuda_info()
    assert set(info) == {"torch", "cuda_version", "available", "device_count", "devices", "error"}
    assert info["device_count"] == len(info["devices"])
    if not info["available"]:
        assert info["devices"] == []


def test_system_module_imports_nothing_optional():
    # Loaded on its own: the package __init__ is not this module's to keep light.
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('system_alone', {str(Path(system.__file__))!r})\n"
        "module = sys.modules['system_alone'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "heavy = {'torch', 'transformers', 'onnxruntime', 'jtop', 'pycuda', 'numpy'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
