"""`vismmoe-edge run` inside real cgroup-v1 memory caps (page cache included, as on a Jetson's shared DRAM):
too small to start is one line, not a silent SIGKILL; a fixed budget the cap cannot hold is one line; and at the
budget the planner picks within the cap the run completes, streaming experts, without ever touching the
profile's reserve. Each run is bounded in time."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from bench import memcgroup  # noqa: E402

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
PROFILE = ["--profile", "orin-nano-8gb-super--maxn-super", "--device", "cpu"]  # a 1 GiB reserve (C_safe)
RESERVE = 1 << 30
CAP = 1600 * MIB  # ~330 MiB to start, the 1 GiB reserve, ~270 MiB for the model: too little for all its experts
TIMEOUT = 240
_OK, _WHY = memcgroup.memory_cgroup_support()
pytestmark = pytest.mark.skipif(not _OK, reason=f"no usable cgroup v1 memory controller: {_WHY}")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    # 288 MiB of experts (32 per layer, 1.1 MiB each), in 64 MB shards
    return build_tiny_checkpoint(tmp_path_factory.mktemp("capped") / "m", seed=3, num_layers=8, num_experts=32,
                                 hidden=256, moe_intermediate=384, max_shard_size="64MB")  # fmt: skip


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vismmoe_edge.cli", *args]


ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def capped(name: str, limit: int, *cmds: list[str], evict: list[Path] = ()) -> list[memcgroup.CappedRun]:
    with memcgroup.MemoryCgroup(name, limit) as cg:
        return [cg.run(cmd, capture_output=True, env=ENV, timeout=TIMEOUT, evict=evict) for cmd in cmds]


def test_a_cap_too_small_to_start_is_one_line_not_a_kill(model):
    res, help_ = capped("t-start", 250 * MIB, cli("run", "--model", str(model), "--prompt", "hi", *PROFILE),
                        cli("run", "--help"))  # fmt: skip
    assert not res.oom_killed and res.returncode == 2, res.summary()
    assert res.stderr.count("\n") == 1 and res.stderr.startswith("error: the memory cgroup leaves")
    assert help_.returncode == 0 and "Usage" in help_.stdout  # --help needs no model: it still answers


def test_a_fixed_budget_the_cap_cannot_hold_is_one_line(model):
    (res,) = capped("t-fixed", CAP, cli("run", "--model", str(model), "--prompt", "hi", "--memory-budget", "2GiB",
                                        "--pinned-layers", "0", "--tier", "unified", "--device", "cpu"))  # fmt: skip
    assert not res.oom_killed and res.returncode == 2, res.summary()
    assert res.stderr.strip().splitlines()[-1].startswith("error: --memory-budget 2.00 GiB")
    assert "exceed what the memory cgroup leaves" in res.stderr


@pytest.mark.parametrize("tier", ["unified", "unified-slots"])
def test_at_the_planned_budget_the_run_completes_within_the_cap(model, tier):
    shards = sorted(model.glob("*.safetensors"))
    plan_run, run = capped(
        f"t-{tier}",
        CAP,
        cli("plan", str(model), *PROFILE, "--json"),
        cli("run", "--model", str(model), "--prompt", "Tell me a story about the sea and the sky.",
            "--max-new-tokens", "4", "--tier", tier, "--json", *PROFILE),  # fmt: skip
        evict=shards,
    )
    assert plan_run.returncode == 0, plan_run.stderr
    plan = json.loads(plan_run.stdout)
    assert "memory cgroup" in plan["m_avail_source"] and plan["device"] == "cpu"
    total_experts = plan["s_layer_bytes"] * plan["moe_layers"]
    assert plan["memory_budget_bytes"] < total_experts  # the cap forces streaming
    assert run.returncode == 0 and not run.oom_killed and run.oom_kills == 0, run.summary() + run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["experts"]["misses"] > 0 and result["experts"]["evictions"] > 0
    assert len(result["token_ids"]) == 4
    # page cache included, the run never reached into the reserve the plan kept free
    assert run.max_usage_bytes <= CAP - RESERVE, run.summary()
