"""LoadOptions -> the plan -> the loaded engine: one resolution for every command, the checkpoint read once, the
plan's prefetch depth as the pipeline's speculative cap."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from vismmoe_edge import checkpoint
from vismmoe_edge.checkpoint_info import inspect_checkpoint
from vismmoe_edge.config import parse_budget
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.runtime import DEFAULT_PREFETCH_DEPTH
from vismmoe_edge.options import LoadOptions, load_engine, resolve
from vismmoe_edge.planning.describe import describe_checkpoint
from vismmoe_edge.planning.memory_plan import runtime_parts

GIB = 1 << 30
NANO = "orin-nano-8gb-super--maxn-super"  # l_semantic 3, c_safe 1 GiB, prefetch depth 2, unified memory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("options") / "tiny", num_layers=8)


def available_for(model: Path, expert_bytes: int) -> int:
    """MemAvailable that leaves `expert_bytes` for experts under the Nano profile (1 GiB C_safe), planned for the
    board's iGPU (named Jetson profile): weights, KV cache, activations and reads in flight come first."""
    return expert_bytes + runtime_parts(inspect_checkpoint(model), device="cuda").total_bytes + GIB


def test_nothing_left_to_the_plan_is_taken_as_given(tiny: Path) -> None:
    options = LoadOptions(memory_budget="40%", pinned_layers=1, tier="host")
    resolved = resolve(options, inspect_checkpoint(tiny))
    total = describe_checkpoint(tiny)["total_expert_bytes"]  # float32 stored and computed
    assert resolved.memory_budget_bytes == parse_budget("40%", total)
    assert (resolved.pinned_layers, resolved.tier) == (1, "host")
    assert resolved.prefetch_depth == DEFAULT_PREFETCH_DEPTH and resolved.plan is None and resolved.note == ""


def test_auto_takes_every_number_from_the_plan(tiny: Path) -> None:
    d = describe_checkpoint(tiny)
    m_e = 5 * d["expert_bytes_per_layer"] + 10 * d["bytes_per_expert"]
    resolved = resolve(LoadOptions(profile=NANO), inspect_checkpoint(tiny), mem_available=available_for(tiny, m_e))
    plan = resolved.plan
    assert plan is not None
    assert resolved.memory_budget_bytes == plan.memory_budget_bytes == m_e
    assert (resolved.pinned_layers, resolved.tier, resolved.prefetch_depth) == (3, "unified", plan.prefetch_depth)
    assert f"profile {NANO}" in resolved.note and "prefetch depth 2" in resolved.note


def test_a_fixed_budget_caps_the_planned_pinned_depth(tiny: Path) -> None:
    d = describe_checkpoint(tiny)
    s_layer, s_e = d["expert_bytes_per_layer"], d["bytes_per_expert"]
    roomy = available_for(tiny, 100 * d["total_expert_bytes"])  # the plan alone would pin 3
    budget = str(2 * s_layer + s_e)  # room for two layers and one streamed expert
    resolved = resolve(LoadOptions(memory_budget=budget, profile=NANO), inspect_checkpoint(tiny), mem_available=roomy)
    assert resolved.plan is not None and resolved.plan.pinned_layers == 3
    assert resolved.pinned_layers == 2 and resolved.memory_budget_bytes == int(budget)
    assert parse_budget(budget, d["total_expert_bytes"]) - 2 * s_layer >= s_e


def test_the_plans_prefetch_depth_is_the_pipelines_speculative_cap(tiny: Path) -> None:
    d = describe_checkpoint(tiny)
    m_e = 5 * d["expert_bytes_per_layer"] + 10 * d["bytes_per_expert"]
    options = LoadOptions(profile=NANO, device="cpu", predictor="previous-token")
    for depth in (None, 1, 0):  # the plan's (2), then the user's
        engine, resolved = load_engine(
            tiny, replace(options, prefetch_depth=depth), mem_available=available_for(tiny, m_e)
        )
        pipeline = engine.experts.pipeline
        top_k = d["top_k"]
        expected_depth = resolved.plan.prefetch_depth if depth is None else depth
        assert resolved.prefetch_depth == expected_depth
        cap_experts = min(expected_depth * top_k, pipeline.capacity // 4)
        assert pipeline.speculative_cap_bytes == cap_experts * pipeline.tier.slot_bytes
        pipeline.close()


def test_loading_reads_the_checkpoint_once(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = checkpoint.read_tensor_table  # looked up by inspect_checkpoint when it runs

    def counting(directory: Path) -> dict:
        calls.append(directory)
        return real(directory)

    monkeypatch.setattr(checkpoint, "read_tensor_table", counting)
    available = available_for(tiny, 5 * describe_checkpoint(tiny)["expert_bytes_per_layer"])
    calls.clear()
    engine, _ = load_engine(tiny, LoadOptions(profile=NANO, device="cpu"), mem_available=available)
    engine.experts.pipeline.close()
    assert calls == [tiny]  # the planner and the loader share one inspection


def test_a_percentage_budget_is_of_the_compute_dtype_bytes_the_cache_holds(tmp_path: Path) -> None:
    """--dtype float32 on a bf16 checkpoint: "40%", the plan and the loaded cache all count float32 experts."""
    import torch

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path / "bf16", num_layers=8, dtype=torch.bfloat16)
    info = inspect_checkpoint(model)
    d = describe_checkpoint(info)
    s_e, s_layer = 2 * d["bytes_per_expert"], 2 * d["expert_bytes_per_layer"]  # float32 = twice the stored bf16
    fixed = LoadOptions(memory_budget="40%", pinned_layers=1, tier="host", dtype="float32", device="cpu")
    resolved = resolve(fixed, info)
    assert resolved.memory_budget_bytes == parse_budget("40%", 2 * d["total_expert_bytes"])
    engine, _ = load_engine(info, fixed)
    assert engine.dtype == torch.float32
    assert engine.experts.pipeline.capacity == (resolved.memory_budget_bytes - s_layer) // s_e

    # Room for two float32 layers: counted at bf16 the plan would pin three (l_semantic) and overfill the cache.
    from vismmoe_edge.planning.weights import weight_bytes

    m_e = 2 * s_layer + 10 * s_e
    others = runtime_parts(info, device="cuda", weights=weight_bytes(info, float_scale=2.0)).total_bytes  # float32
    planned = resolve(LoadOptions(profile=NANO, dtype="float32"), info, mem_available=m_e + others + GIB)
    assert planned.plan is not None and planned.plan.s_layer_bytes == s_layer and planned.plan.bytes_per_expert == s_e
    assert planned.pinned_layers == 2 and planned.memory_budget_bytes == m_e
    assert any("compute dtype float32" in line for line in planned.plan.why)


def test_a_planned_desktop_gpu_that_misses_loads_the_embedding_in_host_memory(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan counted the embedding out of GPU memory (planning/plan.py), so the loader must put it in host
    memory; a budget the user fixed was not planned that way, and leaves it to the loader's "auto"."""
    import vismmoe_edge.options as options

    monkeypatch.setattr(options, "plan_gpu", lambda *args, **kwargs: (None, True, None))  # as if this had the GPU
    from vismmoe_edge.hardware.profiles import get_profile

    d = describe_checkpoint(tiny)
    c_safe = int(get_profile("desktop-gpu").planner.c_safe_gib * GIB)
    gpu_free = 4 * d["expert_bytes_per_layer"] + runtime_parts(inspect_checkpoint(tiny), device="cuda").total_bytes
    gpu_free += c_safe
    planned = resolve(LoadOptions(profile="desktop-gpu"), inspect_checkpoint(tiny), gpu_free=gpu_free)
    assert planned.plan is not None and planned.plan.embedding_in_host and planned.tier == "gpu"
    assert planned.embedding == "host" and "token embedding in host memory" in planned.note
    fixed = resolve(LoadOptions(profile="desktop-gpu", memory_budget="40%"), inspect_checkpoint(tiny),
                    gpu_free=gpu_free)  # fmt: skip
    assert fixed.embedding == "auto" and "token embedding" not in fixed.note
    monkeypatch.setenv("VISMMOE_EMBEDDING", "device")  # the commands' and the daemon's way to keep it in GPU memory
    kept = resolve(LoadOptions(profile="desktop-gpu"), inspect_checkpoint(tiny), gpu_free=gpu_free)
    assert kept.plan is not None and not kept.plan.embedding_in_host and kept.embedding == "device"
    assert kept.memory_budget_bytes == planned.memory_budget_bytes - kept.plan.weights["embedding_bytes"]
    monkeypatch.setenv("VISMMOE_EMBEDDING", "gpu")
    with pytest.raises(VismmoeError, match=r"^VISMMOE_EMBEDDING='gpu': use one of auto, host, device$"):
        resolve(LoadOptions(profile="desktop-gpu"), inspect_checkpoint(tiny), gpu_free=gpu_free)
