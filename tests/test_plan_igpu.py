"""Device and tier choice on a Jetson: the recorded boards plus a simulated integrated CUDA device plan device
cuda and the integrated-GPU tier; without CUDA, or under --device cpu, the CPU page-cache tier; `plan --profile
<jetson> --json` says what that board runs on any machine; `doctor` prints the device's attributes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vismmoe_edge.checkpoint_info import inspect_checkpoint
from vismmoe_edge.cli import app
from vismmoe_edge.hardware import doctor, gpu_access, system
from vismmoe_edge.hardware.gpu_access import SLOTS_TIER, simulated_integrated
from vismmoe_edge.hardware.profiles import get_profile, select_profile
from vismmoe_edge.options import LoadOptions, resolve
from vismmoe_edge.planning.plan import format_plan, make_plan

BOARDS = Path(__file__).parent / "fixtures" / "boards"
JETSONS = ["agx-orin-64gb-jp6", "orin-nano-8gb-super-jp6", "orin-nx-16gb-jp5", "orin-nano-8gb-super-7w-jp62"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("igpu-plan") / "tiny", num_layers=8)


@pytest.mark.parametrize("board", JETSONS)
def test_a_jetson_with_an_integrated_cuda_device_plans_cuda_and_the_igpu_tier(tiny, board):
    root = BOARDS / board
    profile, _, _ = select_profile("auto", root)
    assert profile.kind == "jetson"
    plan = make_plan(tiny, profile, root=root, gpu=simulated_integrated())
    assert (plan.device, plan.tier) == ("cuda", SLOTS_TIER)
    assert plan.m_avail_bytes == system.mem_available_bytes(root) and plan.gpu is not None
    assert plan.gpu["integrated"] and not plan.gpu["pageable_memory_access"]
    for part in ("language_weights_bytes", "vision_weights_bytes", "kv_cache_bytes", "activation_bytes",
                 "pinned_prefix_bytes", "cache_bytes", "reserve_bytes"):  # fmt: skip
        assert plan.memory_parts[part] > 0, part
    assert plan.memory_parts["total_bytes"] <= plan.m_avail_bytes
    text = format_plan(plan)
    assert "device cuda, tier unified-slots" in text and "vision tower" in text and "KV cache" in text
    # the same board with CPU-only torch: the CPU computes from the page cache
    cpu_plan = make_plan(tiny, profile, root=root, gpu=None)
    assert (cpu_plan.device, cpu_plan.tier) == ("cpu", "unified")


def test_a_device_that_cannot_map_host_memory_stays_on_the_cpu(tiny):
    plan = make_plan(tiny, get_profile("agx-orin-64gb--maxn"), mem_available=8 << 30,
                     gpu=simulated_integrated(can_map_host_memory=False))  # fmt: skip
    assert (plan.device, plan.tier) == ("cpu", "unified") and "cannot map host memory" in plan.why[-1]


def test_registration_as_default_falls_back_where_refused(tiny, monkeypatch):
    import vismmoe_edge.planning.plan as plan_module

    real = gpu_access.igpu_tier  # as if the measurement had made registration the default
    monkeypatch.setattr(plan_module, "igpu_tier", lambda access: real(access, gpu_access.REGISTERED_TIER))
    ok = make_plan(tiny, get_profile("agx-orin-64gb--maxn"), mem_available=8 << 30, gpu=simulated_integrated())
    assert ok.tier == gpu_access.REGISTERED_TIER
    refused = make_plan(tiny, get_profile("agx-orin-64gb--maxn"), mem_available=8 << 30,
                        gpu=simulated_integrated(read_only_host_register_supported=False))  # fmt: skip
    assert refused.tier == SLOTS_TIER and "attribute 113 = 0" in refused.why[-1]


def test_plan_for_a_named_jetson_profile_says_cuda_on_any_machine(tiny, monkeypatch):
    monkeypatch.setattr(gpu_access, "probe_quietly", lambda index=0: None)  # as on a machine without CUDA
    result = CliRunner().invoke(app, ["plan", str(tiny), "--profile", "agx-orin-64gb--maxn", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert (data["device"], data["tier"]) == ("cuda", SLOTS_TIER)
    assert data["gpu"]["source"].startswith("documented for Orin") and data["memory_parts"]["total_bytes"] > 0
    assert any("planned for the board's iGPU" in w for w in data["warnings"])
    result = CliRunner().invoke(app, ["plan", str(tiny), "--profile", "agx-orin-64gb--maxn", "--json",
                                      "--device", "cpu"])  # fmt: skip
    assert (json.loads(result.output)["device"], json.loads(result.output)["tier"]) == ("cpu", "unified")


def test_options_resolve_device_and_tier_from_the_plan(tiny, monkeypatch):
    info = inspect_checkpoint(tiny)
    options = LoadOptions(profile="agx-orin-64gb--maxn")
    monkeypatch.setattr(gpu_access, "probe_quietly", lambda index=0: simulated_integrated())  # CUDA torch here
    resolved = resolve(options, info, mem_available=8 << 30)
    assert (resolved.device, resolved.tier) == ("cuda", SLOTS_TIER) and "device cuda" in resolved.note
    resolved = resolve(LoadOptions(profile="agx-orin-64gb--maxn", device="cpu"), info, mem_available=8 << 30)
    assert (resolved.device, resolved.tier) == ("cpu", "unified")  # --device cpu keeps the CPU path
    monkeypatch.setattr(gpu_access, "probe_quietly", lambda index=0: None)  # CPU-only torch here
    resolved = resolve(options, info, mem_available=8 << 30)
    assert resolved.plan is not None and resolved.plan.device == "cuda"  # the board's plan
    assert (resolved.device, resolved.tier) == ("auto", "unified")  # loaded here: the CPU page-cache tier


def test_doctor_reports_the_gpu_attributes(monkeypatch):
    monkeypatch.setattr(system, "cuda_info", lambda: {"device_count": 1})
    monkeypatch.setattr(gpu_access, "probe", lambda index=0: simulated_integrated())
    check = doctor.check_gpu_access(None)
    assert check.ok and "integrated 1" in check.detail and "read-only register 1" in check.detail
    assert "pageable access 0" in check.detail and "registered shard ranges ok" in check.detail
    no_read_only = simulated_integrated(read_only_host_register_supported=False)
    monkeypatch.setattr(gpu_access, "probe", lambda index=0: no_read_only)
    check = doctor.check_gpu_access(None)
    assert check.ok and "registered shard ranges refused" in check.detail and "113" in check.detail
    monkeypatch.setattr(gpu_access, "probe", lambda index=0: simulated_integrated(can_map_host_memory=False))
    board = system.detect_jetson(BOARDS / "agx-orin-64gb-jp6")
    check = doctor.check_gpu_access(board)
    assert not check.ok and not check.required and check.fix
