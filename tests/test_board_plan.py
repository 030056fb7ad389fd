"""Plans made for a Jetson module from another machine, for Qwen3-VL-30B-A3B's real dimensions (a header-only
checkpoint: real safetensors headers, sparse data), before and after a planned conversion (--bits/--dense-bits).

Done-when of the 8 GB Orin Nano / 16 GB Orin NX issue: on this machine, the Nano plan with int4 experts and int4
dense weights fits the module's memory with device cuda, non-expert weights at <= 40% of bf16's and a cache of
>= 10% of the experts; the NX with int4 experts alone keeps >= 30%.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vismmoe_edge.cli import app
from vismmoe_edge.hardware.profiles import get_profile
from vismmoe_edge.planning.board_memory import board_memory
from vismmoe_edge.planning.plan import make_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from checkpoints.header_only import write_header_only  # noqa: E402

BOARDS = Path(__file__).parent / "fixtures" / "boards"
NANO = "orin-nano-8gb-super--maxn-super"
NX = "orin-nx-16gb--maxn"


@pytest.fixture(scope="module")
def qwen30b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_header_only(tmp_path_factory.mktemp("h30") / "qwen3-vl-30b-a3b")


def plan_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["plan", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_the_header_only_checkpoint_has_the_real_sizes(qwen30b: Path) -> None:
    result = CliRunner().invoke(app, ["info", str(qwen30b), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["layers"], info["experts_per_layer"], info["top_k"]) == (48, 128, 8)
    assert info["bytes_per_expert"] == 3 * 2048 * 768 * 2
    assert round(info["resident_bytes"] / 2**30, 2) == 3.87  # of which the vision tower ~1 GiB
    assert round(info["parts"]["vision_bytes"] / 2**30, 2) == 1.0


def test_nano_8gb_plan_from_this_machine(qwen30b: Path) -> None:
    plan = plan_json(str(qwen30b), "--profile", NANO, "--bits", "4", "--dense-bits", "4")
    board = board_memory(get_profile(NANO))
    assert board is not None
    assert plan["board"]["module"] == "Orin Nano 8GB" and plan["m_avail_bytes"] == board.available_bytes
    assert plan["memory_parts"]["total_bytes"] <= plan["m_avail_bytes"] <= 8 * 2**30
    assert plan["device"] == "cuda" and plan["tier"] == "unified-slots"
    assert plan["resident_bytes"] <= 0.4 * plan["resident_bf16_bytes"]
    assert plan["cache_bytes"] >= 0.1 * plan["total_expert_bytes"]
    assert plan["weights"]["embedding_bytes"] == 0 and plan["weights"]["embedding_on_disk_bytes"] == 151936 * 2048 * 2
    assert any("not for this machine" in w for w in plan["warnings"])
    # unified-slots reads the codes where they land, so the conversion it asks for writes row-major ones
    assert any("quantize --bits 4 --layout rowmajor" in line for line in plan["why"])


def test_nx_16gb_plan_with_int4_experts(qwen30b: Path) -> None:
    plan = plan_json(str(qwen30b), "--profile", NX, "--bits", "4")
    assert plan["board"]["module"] == "Orin NX 16GB" and plan["device"] == "cuda"
    assert plan["memory_parts"]["total_bytes"] <= plan["m_avail_bytes"] <= 16 * 2**30
    assert plan["cache_bytes"] >= 0.3 * plan["total_expert_bytes"]
    assert plan["resident_bytes"] == plan["resident_bf16_bytes"]  # dense weights kept at bf16


def test_on_the_board_the_plan_reads_its_memory(qwen30b: Path) -> None:
    """A recorded Nano tree: MemAvailable of the board itself; another module's tree: the profile's module."""
    on_board = make_plan(qwen30b, get_profile(NANO), root=BOARDS / "orin-nano-8gb-super-jp6", cgroup=None,
                         bits=4, dense_bits=4)  # fmt: skip
    assert on_board.board is None and "MemAvailable" in on_board.m_avail_source
    elsewhere = make_plan(qwen30b, get_profile(NANO), root=BOARDS / "orin-nx-16gb-jp5", cgroup=None,
                          bits=4, dense_bits=4)  # fmt: skip
    assert elsewhere.board is not None and "Orin Nano 8GB's memory, not this machine's" in elsewhere.m_avail_source


def test_max_context_moves_the_kv_cache_and_a_refusal_names_the_ways_out(qwen30b: Path) -> None:
    short = make_plan(qwen30b, get_profile(NANO), root=BOARDS / "x86-desktop", cgroup=None, bits=4, dense_bits=4,
                      max_context=1024)  # fmt: skip
    long = make_plan(qwen30b, get_profile(NANO), root=BOARDS / "x86-desktop", cgroup=None, bits=4, dense_bits=4,
                     max_context=8192)  # fmt: skip
    assert long.memory_parts["kv_cache_bytes"] == 8 * short.memory_parts["kv_cache_bytes"]
    assert long.cache_bytes < short.cache_bytes
    result = CliRunner().invoke(app, ["plan", str(qwen30b), "--profile", NANO, "--max-context", "40000"])
    assert result.exit_code != 0
    message = result.output.strip().splitlines()[-1]
    for way in ("--bits 4", "--dense-bits 4", "--max-context", "--c-safe-gib"):
        assert way in message


def test_info_plans_a_conversion_part_by_part(qwen30b: Path) -> None:
    """--bits on a float checkpoint plans the conversion; info says so per part."""
    result = CliRunner().invoke(app, ["info", str(qwen30b), "--bits", "8", "--dense-bits", "8"])
    assert result.exit_code == 0, result.output
    assert "as `quantize --bits 8 --dense-bits 8` would write them" in result.output
    assert "read by row from disk" in result.output
    bad = CliRunner().invoke(app, ["info", str(qwen30b), "--dense-bits", "4"])
    assert bad.exit_code != 0 and "--dense-bits needs --bits" in bad.output
