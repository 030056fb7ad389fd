"""Memory-cgroup limits as the planner reads them (recorded v1 and v2 trees), and the one-line refusals they lead
to: before torch is imported, when the plan cannot fit, and for a fixed budget too big for the cgroup."""

from __future__ import annotations

from pathlib import Path

import pytest

from vismmoe_edge.checkpoint_info import inspect_checkpoint
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware import cgroup
from vismmoe_edge.hardware.cgroup import read_cgroup_memory, startup_refusal
from vismmoe_edge.hardware.profiles import get_profile
from vismmoe_edge.options import check_fixed_budget
from vismmoe_edge.planning.plan import make_plan

MIB = 1 << 20
NANO = "orin-nano-8gb-super--maxn-super"


def v1_tree(root: Path, limit: int, usage: int, *, parent_limit: int | None = None, inactive: int = 0) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("5:devices:/\n4:memory:/system.slice/vismmoe.service\n0::/\n")
    group = root / "sys/fs/cgroup/memory/system.slice/vismmoe.service"
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (group / "memory.usage_in_bytes").write_text(f"{usage}\n")
    hierarchical = min(limit, parent_limit or limit)
    (group / "memory.stat").write_text(
        f"cache 0\nrss {usage}\nhierarchical_memory_limit {hierarchical}\ntotal_cache {inactive}\n"
        f"total_rss {usage}\ntotal_inactive_file {inactive}\n"
    )
    return root


def v2_tree(root: Path, *, service_max: str, parent_max: str, high: str = "max", current: int = 100 * MIB) -> Path:
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/system.slice/vismmoe.service\n")
    base = root / "sys/fs/cgroup"
    group = base / "system.slice/vismmoe.service"
    group.mkdir(parents=True)
    (base / "cgroup.controllers").write_text("cpu memory io\n")
    (group / "memory.max").write_text(service_max + "\n")
    (group / "memory.high").write_text(high + "\n")
    (group / "memory.current").write_text(f"{current}\n")
    (group / "memory.stat").write_text("anon 90000000\nfile 10485760\ninactive_file 4194304\n")
    (base / "system.slice/memory.max").write_text(parent_max + "\n")
    return root


def test_v1_limit_usage_and_the_tighter_parent(tmp_path):
    cg = read_cgroup_memory(v1_tree(tmp_path / "a", 2048 * MIB, 300 * MIB, inactive=50 * MIB))
    assert cg is not None and cg.version == 1
    assert cg.limit_bytes == 2048 * MIB and cg.headroom_bytes == (2048 - 300 + 50) * MIB
    cg = read_cgroup_memory(v1_tree(tmp_path / "b", 2048 * MIB, 300 * MIB, parent_limit=1024 * MIB))
    assert cg is not None and cg.limit_bytes == 1024 * MIB and "hierarchical_memory_limit" in str(cg.limit_file)


def test_v1_unlimited_is_no_limit(tmp_path):
    cg = read_cgroup_memory(v1_tree(tmp_path, 9223372036854771712, 300 * MIB))
    assert cg is not None and cg.limit_bytes is None and cg.headroom_bytes is None
    assert startup_refusal(tmp_path) is None


def test_v2_takes_the_tightest_of_max_high_and_ancestors(tmp_path):
    cg = read_cgroup_memory(v2_tree(tmp_path / "a", service_max="max", parent_max=str(3 * 1024 * MIB)))
    assert cg is not None and cg.version == 2 and cg.limit_bytes == 3 * 1024 * MIB
    assert cg.limit_file == tmp_path / "a/sys/fs/cgroup/system.slice/memory.max"
    assert cg.headroom_bytes == 3 * 1024 * MIB - 100 * MIB + 4 * MIB  # inactive page cache is credited back
    cg = read_cgroup_memory(v2_tree(tmp_path / "b", service_max=str(2048 * MIB), parent_max="max",
                                    high=str(1536 * MIB)))  # fmt: skip
    assert cg is not None and cg.limit_bytes == 1536 * MIB and cg.limit_file.name == "memory.high"


def test_no_cgroup_files_is_none(tmp_path):
    assert read_cgroup_memory(tmp_path) is None
    assert startup_refusal(tmp_path) is None


def test_this_process_cgroup_is_readable():
    if not Path("/proc/self/cgroup").exists():
        pytest.skip("not Linux")
    cg = read_cgroup_memory()
    if cg is None:
        pytest.skip("no memory controller here")
    assert cg.usage_bytes > 0 and cg.version in (1, 2)


def test_a_cgroup_too_small_to_start_is_refused_in_one_line(tmp_path):
    root = v1_tree(tmp_path, 250 * MIB, 20 * MIB)
    refusal = startup_refusal(root)
    assert refusal is not None and "\n" not in refusal and "250.00 MiB" in refusal and "MemoryMax=" in refusal
    assert startup_refusal(v1_tree(tmp_path / "big", 2048 * MIB, 20 * MIB)) is None
    assert cgroup.STARTUP_BYTES > 332 * MIB  # the measured RSS at a command's first model code


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("cg") / "tiny", num_layers=8)


def test_the_plan_fits_inside_what_the_cgroup_leaves(tiny, tmp_path):
    limit = (1024 + 300 + 100) * MIB  # the Nano's 1 GiB reserve, what is charged now, ~100 MiB for the model
    root = v1_tree(tmp_path, limit, 300 * MIB)
    group = read_cgroup_memory(root)
    plan = make_plan(tiny, get_profile(NANO), mem_available=8 << 30, cgroup=group)
    assert plan.m_avail_bytes == limit - 300 * MIB and "memory cgroup" in plan.m_avail_source
    assert plan.memory_parts["total_bytes"] <= plan.m_avail_bytes and plan.cgroup is not None
    assert plan.memory_budget_bytes == plan.memory_parts["pinned_prefix_bytes"] + plan.memory_parts["cache_bytes"]
    tight = read_cgroup_memory(v1_tree(tmp_path / "tight", (1024 + 300 + 20) * MIB, 300 * MIB))
    with pytest.raises(VismmoeError, match="raise the cgroup's limit") as e:
        make_plan(tiny, get_profile(NANO), mem_available=8 << 30, cgroup=tight)
    assert "\n" not in str(e.value)


def test_a_fixed_budget_beyond_the_cgroup_is_refused(tiny, tmp_path):
    root = v1_tree(tmp_path, 400 * MIB, 300 * MIB)
    info = inspect_checkpoint(tiny)
    with pytest.raises(VismmoeError, match="exceed what the memory cgroup leaves") as e:
        check_fixed_budget(2 << 30, "unified", info, root)
    assert "\n" not in str(e.value)
    check_fixed_budget(1 << 20, "unified", info, root)  # fits beside the model's ~70 MiB of other parts
    check_fixed_budget(2 << 30, "gpu", info, root)  # GPU memory is not the cgroup's
