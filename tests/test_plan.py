"""The planner's rule on hand-computed cases, with a real tiny checkpoint and fake available memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from vismmoe_edge.checkpoint_info import inspect_checkpoint
from vismmoe_edge.cli.plan import plan_command
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.hardware.profiles import get_profile
from vismmoe_edge.planning.describe import describe_checkpoint
from vismmoe_edge.planning.memory_plan import runtime_parts
from vismmoe_edge.planning.plan import format_plan, make_plan

BOARDS = Path(__file__).parent / "fixtures" / "boards"
NANO = "orin-nano-8gb-super--maxn-super"  # l_semantic 3, c_safe 1 GiB, prefetch 2, unified


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp("plan") / "tiny", num_layers=8)
    d = describe_checkpoint(path)
    d["runtime_bytes"] = runtime_parts(inspect_checkpoint(path), device="cpu").total_bytes
    return path, d


def avail(d: dict, m_e: int, c_safe: int = 0) -> int:
    """The M_avail that leaves exactly ``m_e`` bytes for experts: weights, KV cache, activations and reads in
    flight (memory_plan.py) come first."""
    return m_e + d["runtime_bytes"] + c_safe


def test_tiny_checkpoint_shape(ckpt):
    _, d = ckpt  # the numbers the cases below are built from
    assert (d["moe_layers"], d["experts_per_layer"], d["top_k"]) == (8, 16, 4)
    assert d["expert_bytes_per_layer"] == 16 * d["bytes_per_expert"]


def test_room_to_spare_pins_l_semantic_and_caches_the_rest(ckpt):
    path, d = ckpt
    s_e, s_layer = d["bytes_per_expert"], d["expert_bytes_per_layer"]
    m_e = 5 * s_layer + 10 * s_e
    plan = make_plan(path, get_profile(NANO), mem_available=avail(d, m_e), c_safe=0)
    assert plan.l_max == (m_e - 4 * s_e) // s_layer == 5
    assert plan.pinned_layers == 3
    assert plan.cache_bytes == m_e - 3 * s_layer == 2 * s_layer + 10 * s_e
    assert plan.memory_budget_bytes == m_e
    assert plan.prefetch_depth == 2 and plan.tier == "unified" and plan.warnings == []


def test_everything_fits(ckpt):
    path, d = ckpt
    plan = make_plan(path, get_profile(NANO), mem_available=avail(d, 100 * d["total_expert_bytes"]), c_safe=0)
    assert plan.l_max == 8 and plan.pinned_layers == 3
    assert plan.cache_bytes == 5 * d["expert_bytes_per_layer"]  # never more than the streamed layers hold
    assert plan.memory_budget_bytes == d["total_expert_bytes"]


def test_l_max_below_l_semantic_pins_l_max_and_warns(ckpt):
    path, d = ckpt
    s_e, s_layer = d["bytes_per_expert"], d["expert_bytes_per_layer"]
    m_e = 2 * s_layer + 5 * s_e  # floor((2 S_layer + 5 S_e - 4 S_e) / S_layer) = 2 < 3
    plan = make_plan(path, get_profile(NANO), mem_available=avail(d, m_e), c_safe=0)
    assert (plan.l_max, plan.pinned_layers) == (2, 2)
    assert plan.cache_bytes == 5 * s_e  # at least one layer's top-4
    assert plan.prefetch_depth == 0  # 5 experts hold one layer's top-4 only: no room to prefetch
    assert any("L_max = 2 < L_semantic = 3" in w for w in plan.warnings)
    assert any("prefetch depth lowered from 2 to 0" in w for w in plan.warnings)


def test_c_safe_and_resident_bytes_are_subtracted(ckpt):
    path, d = ckpt
    s_layer = d["expert_bytes_per_layer"]
    profile = get_profile(NANO)
    c_safe = int(profile.planner.c_safe_gib * (1 << 30))
    plan = make_plan(path, profile, mem_available=avail(d, 4 * s_layer, c_safe))  # C_safe from the profile
    assert plan.c_safe_bytes == c_safe
    assert plan.memory_budget_bytes == 4 * s_layer and plan.pinned_layers == 3


def test_overrides_and_too_little_memory(ckpt):
    path, d = ckpt
    big = avail(d, 100 * d["total_expert_bytes"])
    plan = make_plan(path, get_profile("cpu"), mem_available=big, c_safe=0, l_semantic=20)
    assert (plan.pinned_layers, plan.cache_bytes, plan.prefetch_depth) == (8, 0, 0)  # capped at n; nothing streams
    plan = make_plan(path, get_profile("cpu"), mem_available=big, c_safe=0, l_semantic=5)
    assert plan.pinned_layers == 5
    with pytest.raises(VismmoeError, match="cannot hold one layer's top-4.*lower --c-safe-gib"):
        make_plan(path, get_profile("cpu"), mem_available=avail(d, 3 * d["bytes_per_expert"]), c_safe=0)
    # run and serve take C_safe from the profile: the advice must name an option they accept (issue 22)
    profile = get_profile("cpu")
    c_safe = int(profile.planner.c_safe_gib * (1 << 30))
    with pytest.raises(VismmoeError, match="choose a --profile with a smaller c_safe_gib") as refused:
        make_plan(path, profile, mem_available=avail(d, 3 * d["bytes_per_expert"], c_safe))
    assert "--c-safe-gib" not in str(refused.value)


def test_discrete_gpu_plans_from_free_gpu_memory(ckpt):
    path, d = ckpt
    plan = make_plan(path, get_profile("desktop-gpu"), gpu_free=avail(d, 6 * d["expert_bytes_per_layer"]), c_safe=0)
    assert plan.tier == "gpu" and "free GPU memory" in plan.m_avail_source and plan.pinned_layers == 3


def test_gpu_slots_that_miss_plan_the_embedding_into_host_memory(ckpt):
    """Where GPU slots cannot hold every expert, the token embedding's GPU memory becomes slots
    (models/host_embedding.py): the budget grows by exactly its bytes, and `plan` says so."""
    path, d = ckpt
    gpu_free = avail(d, 6 * d["expert_bytes_per_layer"])
    plan = make_plan(path, get_profile("desktop-gpu"), gpu_free=gpu_free, c_safe=0)
    on_cuda = runtime_parts(inspect_checkpoint(path), device="cuda").total_bytes  # weights, KV, activations, reads
    embedding = plan.weights["embedding_bytes"]
    assert plan.tier == "gpu" and plan.embedding_in_host and embedding > 0
    assert plan.memory_budget_bytes == gpu_free - on_cuda + embedding
    assert plan.resident_bytes == d["resident_bytes"] - embedding
    assert "token embedding is not among them" in format_plan(plan)
    everything = make_plan(path, get_profile("desktop-gpu"), gpu_free=avail(d, 9 * d["expert_bytes_per_layer"]),
                           c_safe=0)  # fmt: skip
    assert not everything.embedding_in_host and everything.resident_bytes == d["resident_bytes"]


def test_the_embedding_goes_where_named(ckpt):
    """embedding="device" keeps it in GPU memory even where slots miss (the run-20 layout); "host" moves it even
    where every expert fits (nothing to gain, but asked for)."""
    path, d = ckpt
    desktop = get_profile("desktop-gpu")
    short = avail(d, 6 * d["expert_bytes_per_layer"])
    assert not make_plan(path, desktop, gpu_free=short, c_safe=0, embedding="device").embedding_in_host
    roomy = avail(d, 9 * d["expert_bytes_per_layer"])
    assert make_plan(path, desktop, gpu_free=roomy, c_safe=0, embedding="host").embedding_in_host


def test_plan_command_names_a_bad_embedding_variable_in_one_line(ckpt, capsys, monkeypatch):
    path, _ = ckpt
    monkeypatch.setenv("VISMMOE_EMBEDDING", "hbm")
    with pytest.raises(typer.Exit) as exit_info:
        plan_command(path, profile="desktop-gpu")
    assert exit_info.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "VISMMOE_EMBEDDING='hbm': use one of auto, host, device" in err


def test_mem_available_is_read_from_meminfo(ckpt):
    path, _ = ckpt
    root = BOARDS / "orin-nano-8gb-super-jp6"
    plan = make_plan(path, get_profile(NANO), root=root)
    assert plan.m_avail_bytes == 5243904 * 1024 and "MemAvailable" in plan.m_avail_source


def test_why_explains_each_choice(ckpt):
    path, d = ckpt
    plan = make_plan(path, get_profile(NANO), mem_available=avail(d, 5 * d["expert_bytes_per_layer"]), c_safe=0)
    text = format_plan(plan)
    for needle in (
        "M_avail =",
        "C_safe =",
        "non-expert weights",
        "S_layer =",
        "rule: L_semantic <= L <= L_max",
        "L = L_semantic = 3",
        "cache = min(",
        "memory budget =",
        "prefetch depth 2",
        "tier unified",
    ):
        assert needle in text, needle


def test_plan_command_prints_the_plan_and_why(ckpt, capsys):
    path, _ = ckpt
    plan_command(path, profile="cpu", c_safe_gib=0.0, l_semantic=2)
    out = capsys.readouterr().out
    assert "pinned layers   2 of 8 MoE layers" in out and "why:" in out
    assert "profile cpu: --profile cpu" in out and "L = L_semantic = 2 (--l-semantic)" in out
    plan_command(path, profile="cpu", json_out=True, c_safe_gib=0.0)
    data = json.loads(capsys.readouterr().out)
    assert data["pinned_layers"] == 3 and data["profile"] == "cpu" and data["why"]


def test_plan_command_unknown_profile_is_one_line(ckpt, capsys):
    path, _ = ckpt
    with pytest.raises(typer.Exit) as exit_info:
        plan_command(path, profile="jetson-tx2")
    assert exit_info.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown profile 'jetson-tx2'" in err and "cpu" in err


def test_plan_command_registers_as_a_typer_command(ckpt):
    from typer.testing import CliRunner

    app = typer.Typer()
    app.command("plan")(plan_command)
    app.command("noop")(lambda: None)  # two commands, so "plan" is a subcommand as in the real CLI
    result = CliRunner().invoke(app, ["plan", str(ckpt[0]), "--profile", "cpu", "--c-safe-gib", "0", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["pinned_layers"] == 3
    result = CliRunner().invoke(app, ["plan", str(ckpt[0]), "--profile", "nope"])
    assert result.exit_code == 2
