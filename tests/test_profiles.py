"""Profiles (vismmoe_edge/profiles/*.toml), nvpmodel parsing and `--profile auto` on recorded board trees."""

from __future__ import annotations

import shutil
import sys
from importlib import resources
from pathlib import Path

import pytest

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware import nvpmodel
from vismmoe_edge.hardware.profiles import (
    REQUIRED,
    REQUIRED_JETSON,
    get_profile,
    limits_distance,
    load_profiles,
    select_profile,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

BOARDS = Path(__file__).parent / "fixtures" / "boards"
PROFILE_DIR = resources.files("vismmoe_edge") / "profiles"

# Every module x mode of jetson.md §2 (mode names exactly as in the confs).
EXPECTED_MODES = {
    "agx-orin-64gb": ["MAXN", "MODE_15W", "MODE_30W", "MODE_50W"],
    "agx-orin-32gb": ["MAXN", "MODE_15W", "MODE_30W", "MODE_40W"],
    "orin-nx-16gb": ["MAXN", "10W", "15W", "25W"],
    "orin-nx-16gb-super": ["MAXN_SUPER", "10W", "15W", "25W", "40W"],
    "orin-nx-8gb": ["MAXN", "10W", "15W", "20W"],
    "orin-nx-8gb-super": ["MAXN_SUPER", "10W", "15W", "20W", "40W"],
    "orin-nano-8gb": ["15W", "7W"],
    "orin-nano-8gb-super": ["15W", "25W", "MAXN_SUPER"],
    "orin-nano-4gb": ["10W", "7W_AI", "7W_CPU"],
    "orin-nano-4gb-super": ["10W", "25W", "MAXN_SUPER"],
}


def toml_files() -> list:
    return sorted((e for e in PROFILE_DIR.iterdir() if e.name.endswith(".toml")), key=lambda e: e.name)


# --- the TOML files -------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", toml_files(), ids=lambda e: e.name)
def test_every_toml_has_all_fields(entry):
    data = tomllib.loads(entry.read_text())
    required = dict(REQUIRED) | (REQUIRED_JETSON if data["profile"]["kind"] == "jetson" else {})
    for table, keys in required.items():
        assert set(keys) <= set(data[table]), (entry.name, table)
    assert data["profile"]["name"] == entry.name.removesuffix(".toml")
    planner = data["planner"]
    assert planner["l_semantic"] >= 0 and planner["c_safe_gib"] > 0 and planner["prefetch_depth"] >= 0
    if data["profile"]["kind"] == "jetson":
        board, mode = data["board"], data["mode"]
        assert mode["gpu_tpcs"] == 8 - bin(mode["tpc_pg_mask"]).count("1")  # jetson.md §1.1
        assert 0 < mode["cpu_online"] <= board["cpu_cores"]
        assert 0 < mode["dram_bandwidth_gbs"] <= board["dram_bandwidth_gbs"]
        assert planner["unified_memory"] is True


def test_profiles_cover_every_module_and_mode():
    profiles = load_profiles()
    assert {"desktop-gpu", "cpu"} <= set(profiles)
    for slug, modes in EXPECTED_MODES.items():
        ours = [p for p in profiles.values() if p.name.startswith(slug + "--")]
        assert sorted(p.mode_name for p in ours) == sorted(modes), slug
        assert sum(p.mode_default for p in ours) == 1, slug  # one PM_CONFIG DEFAULT per conf
    assert len(profiles) == sum(map(len, EXPECTED_MODES.values())) + 2
    assert get_profile("desktop-gpu").tier == "gpu" and get_profile("cpu").tier == "unified"
    assert get_profile("orin-nano-8gb-super--maxn-super").tier == "unified"


def test_profile_numbers_follow_the_notes():
    nx = get_profile("orin-nx-16gb--15w")
    nx_super = get_profile("orin-nx-16gb-super--15w")
    # Same name, different limits before and after Super (jetson.md §3.2).
    assert nx.limits.cpu_max_freq_mhz == pytest.approx(1651.2)
    assert nx_super.limits.cpu_max_freq_mhz == pytest.approx(1420.8)
    nano = get_profile("orin-nano-8gb-super--15w")
    assert nano.limits.emc_max_freq_mhz == 2133 and nano.mode_bandwidth_gbs == pytest.approx(68.3)
    agx = get_profile("agx-orin-64gb--maxn")
    assert agx.limits.gpu_max_freq_mhz is None and agx.limits.gpu_tpcs == 8 and agx.dram_bandwidth_gbs == 204.8


# --- nvpmodel parsing ----------------------------------------------------------------------------


def test_parse_conf_limits_and_default():
    conf = nvpmodel.read_conf(BOARDS / "agx-orin-64gb-jp6")
    assert conf.default_id == 2 and [m.name for m in conf.modes.values()] == EXPECTED_MODES["agx-orin-64gb"]
    limits = conf.by_name("MODE_15W").limits
    assert (limits.cpu_online, limits.gpu_tpcs) == (4, 3)
    assert limits.cpu_max_freq_mhz == pytest.approx(1113.6)  # kHz in the conf
    assert limits.gpu_max_freq_mhz == 408 and limits.emc_max_freq_mhz == 2133  # Hz in the conf
    maxn = conf.by_name("MAXN").limits
    assert (maxn.cpu_max_freq_mhz, maxn.gpu_max_freq_mhz, maxn.emc_max_freq_mhz) == (None, None, None)
    assert not conf.is_super and nvpmodel.read_conf(BOARDS / "orin-nano-8gb-super-jp6").is_super


def test_parse_status_and_query():
    assert nvpmodel.parse_status("pmode:0002 fmode:quiet\n") == 2
    assert nvpmodel.parse_status("garbage") is None
    assert nvpmodel.parse_query("NV Power Mode: MODE_30W\n2\n") == ("MODE_30W", 2)
    assert nvpmodel.parse_query("nvpmodel: command failed") == (None, None)
    assert nvpmodel.query_nvpmodel(BOARDS / "agx-orin-64gb-jp6") is None  # never runs the binary for a fixture


def test_mode_ids_are_only_indices_into_this_conf():
    # pmode 2 is MAXN_SUPER on the Nano Super but 15W on the NX (jetson.md §3.2).
    assert nvpmodel.running_mode(BOARDS / "orin-nano-8gb-super-jp6").name == "MAXN_SUPER"
    assert nvpmodel.running_mode(BOARDS / "orin-nx-16gb-jp5").name == "15W"


# --- --profile auto ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("board", "expected"),
    [
        ("agx-orin-64gb-jp6", "agx-orin-64gb--maxn"),
        ("orin-nx-16gb-jp5", "orin-nx-16gb--15w"),
        ("orin-nano-8gb-super-jp6", "orin-nano-8gb-super--maxn-super"),
    ],
)
def test_auto_matches_board_and_mode_name(board, expected):
    profile, reason, warnings = select_profile("auto", BOARDS / board, cuda_available=False)
    assert profile.name == expected
    assert "matched by module and mode name" in reason and "var/lib/nvpmodel/status" in reason
    assert warnings == []


def test_unknown_mode_falls_back_by_limits_with_a_warning():
    profile, reason, warnings = select_profile("auto", BOARDS / "orin-nano-8gb-super-7w-jp62", cuda_available=False)
    assert profile.name == "orin-nano-8gb-super--15w"  # the Super 15W: 2133 MHz EMC cap, 612 MHz GPU
    assert "closest profile by limits" in reason
    assert len(warnings) == 1 and "7W" in warnings[0] and "not in our profiles" in warnings[0]


def test_limits_distance_ranks_the_nearest_mode():
    running = nvpmodel.running_mode(BOARDS / "orin-nano-8gb-super-7w-jp62").limits
    names = ["orin-nano-8gb-super--15w", "orin-nano-8gb-super--25w", "orin-nano-8gb-super--maxn-super"]
    distances = [limits_distance(running, get_profile(n).limits) for n in names]
    assert distances == sorted(distances) and distances[0] < distances[1]


def test_no_status_file_means_the_conf_default(tmp_path):
    shutil.copytree(BOARDS / "orin-nano-8gb-super-jp6", tmp_path, dirs_exist_ok=True)
    (tmp_path / nvpmodel.STATUS_PATH).unlink()
    profile, reason, _ = select_profile("auto", tmp_path, cuda_available=False)
    assert profile.name == "orin-nano-8gb-super--25w" and "PM_CONFIG DEFAULT" in reason


def test_same_name_other_limits_warns(tmp_path):
    shutil.copytree(BOARDS / "orin-nx-16gb-jp5", tmp_path, dirs_exist_ok=True)
    conf = tmp_path / nvpmodel.CONF_PATH
    conf.write_text(conf.read_text().replace("MAX_FREQ 1651200", "MAX_FREQ 1420800"))  # another release's 15W
    profile, _, warnings = select_profile("auto", tmp_path, cuda_available=False)
    assert profile.name == "orin-nx-16gb--15w"
    assert len(warnings) == 1 and "cpu_max_freq_mhz 1420.8 vs 1651.2" in warnings[0]


def test_jetson_without_nvpmodel_files_assumes_the_default_mode(tmp_path):
    shutil.copytree(BOARDS / "agx-orin-64gb-jp6", tmp_path, dirs_exist_ok=True)
    (tmp_path / nvpmodel.CONF_PATH).unlink()
    (tmp_path / nvpmodel.STATUS_PATH).unlink()
    profile, _, warnings = select_profile("auto", tmp_path, cuda_available=False)
    assert profile.name == "agx-orin-64gb--mode-30w" and "default mode" in warnings[0]


@pytest.mark.parametrize(("cuda", "expected"), [(True, "desktop-gpu"), (False, "cpu")])
def test_not_a_jetson(cuda, expected):
    profile, reason, warnings = select_profile("auto", BOARDS / "x86-desktop", cuda_available=cuda)
    assert profile.name == expected and reason.startswith("not a Jetson") and warnings == []


def test_named_profile_and_errors(tmp_path):
    assert select_profile("cpu")[0].name == "cpu"
    with pytest.raises(VismmoeError) as err:
        select_profile("orin-nano-9gb--15w")
    message = str(err.value)
    assert "\n" not in message and "orin-nano-8gb--15w" in message and "desktop-gpu" in message
    shutil.copytree(BOARDS / "agx-orin-64gb-jp6", tmp_path, dirs_exist_ok=True)
    conf = tmp_path / nvpmodel.CONF_PATH
    conf.unlink()
    conf.mkdir()  # unreadable as a file, even for root
    with pytest.raises(VismmoeError) as err:
        select_profile("auto", tmp_path, cuda_available=False)
    assert "\n" not in str(err.value) and "cannot read" in str(err.value) and "cpu" in str(err.value)
