"""`vismmoe-edge quantize` and `info` on quantized checkpoints as a user meets them (real subprocesses), and the bad
inputs of a quantized checkpoint refused in one line each: corrupt and truncated shards, a group size that does
not divide a dimension, unknown quantization configs, shapes that disagree with config.json.

The config variants run the CLI's `main()` in this process (tests/test_cli.py, run_cli_in_process): the corrupt
shard's real `info` subprocess already covers their path from the command to the printed line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.test_cli import assert_one_line_error, run_cli, run_cli_in_process

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("qcli") / "src", seed=5, num_layers=2, moe_intermediate=96)


@pytest.fixture(scope="module")
def quantized(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qcliout") / "int4"
    proc = run_cli("quantize", str(source), str(out), "--bits", "4", "--group-size", "32", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "int4, group 32" in proc.stdout and "x bf16" in proc.stdout
    return out


def test_info_shows_bits_group_and_bytes_per_expert(quantized: Path) -> None:
    proc = run_cli("info", str(quantized), "--json")
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    spec_bytes = 192 * 128 // 2 + 128 // 32 * 192 * 4 + 128 * 96 // 2 + 96 // 32 * 128 * 4  # codes + scales/zeros
    assert d["quantization"]["bits"] == 4 and d["quantization"]["group_size"] == 32
    assert d["bytes_per_expert"] == d["quantization"]["bytes_per_expert"] == spec_bytes
    assert d["total_expert_bytes"] == spec_bytes * 16 * 2  # what budgets and the planner count
    assert d["dtype"] == "int4-g32" and d["expert_layout"] == "quantized"
    text = run_cli_in_process("info", str(quantized)).stdout
    assert "quantized      int4, group 32" in text and f"{spec_bytes:,} B per expert" in text


def test_quantize_refuses_bad_arguments_in_one_line(source: Path, tmp_path: Path) -> None:
    assert_one_line_error(run_cli("quantize", str(source), str(tmp_path / "a"), "--bits", "3"), "--bits 3")
    proc = run_cli_in_process("quantize", str(source), str(tmp_path / "b"), "--bits", "4", "--group-size", "24")
    assert_one_line_error(proc, "--group-size 24 does not divide", "pick a divisor")
    proc = run_cli_in_process("quantize", str(source), str(tmp_path / "c"), "--bits", "8", "--group-size", "32")
    assert_one_line_error(proc, "int8 is per output channel")
    assert not (tmp_path / "b").exists() and not any(tmp_path.iterdir())  # nothing half-written


@pytest.fixture
def copy(quantized: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(quantized, tmp_path / "copy"))


def expert_shard(directory: Path) -> Path:
    weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    return directory / weight_map["model.language_model.layers.1.mlp.experts.3.gate_up_proj.qweight"]


def edit_config(directory: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = directory / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_a_corrupt_quantized_shard_is_one_line(copy: Path) -> None:
    shard = expert_shard(copy)
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32
    shard.write_bytes(bytes(data))
    assert_one_line_error(run_cli("info", str(copy)), shard.name, "corrupt safetensors header")


def test_a_truncated_quantized_shard_is_one_line(copy: Path) -> None:
    shard = expert_shard(copy)
    shard.write_bytes(shard.read_bytes()[:-1000])
    assert_one_line_error(run_cli("run", "--model", str(copy), "--prompt", "hi", "--device", "cpu"), "truncated")


def test_a_group_size_that_does_not_divide_a_dimension_is_one_line(copy: Path) -> None:
    edit_config(copy, lambda c: c["quantization_config"].update(group_size=48))  # 128 % 48 != 0
    assert_one_line_error(run_cli_in_process("info", str(copy)), "group_size 48 does not divide", "128 inputs")


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        (lambda q: q.update(quant_method="gptq"), ("quantization 'gptq' is not supported",)),
        (lambda q: q.update(quant_method="fp8"), ("a fp8 checkpoint; convert it first", "vismmoe-edge quantize")),
        (lambda q: q.update(format_version=2), ("format version 2",)),
        (lambda q: q.update(bits=3), ("invalid quantization_config",)),
        (lambda q: q.update(kernel="marlin"), ("unknown quantization_config field 'kernel'",)),
    ],
)
def test_an_unknown_quantization_config_is_one_line(copy: Path, change, needles) -> None:
    edit_config(copy, lambda c: change(c["quantization_config"]))
    assert_one_line_error(run_cli_in_process("info", str(copy)), *needles)


def test_shapes_that_disagree_with_the_config_are_one_line(copy: Path) -> None:
    edit_config(copy, lambda c: c["text_config"].update(moe_intermediate_size=64))
    proc = run_cli_in_process("info", str(copy))
    assert_one_line_error(proc, "gate_up_proj.qweight is U8 [192, 64]", "implies U8 [128, 64]")


def test_a_dense_expert_left_in_a_quantized_checkpoint_is_one_line(copy: Path, source: Path) -> None:
    """A quantization_config over a dense checkpoint (someone copied config.json across)."""
    dense = Path(shutil.copytree(source, copy.parent / "dense"))
    shutil.copy(copy / "config.json", dense / "config.json")
    assert_one_line_error(run_cli_in_process("info", str(dense)), "is a dense expert in a quantized checkpoint")


def test_the_planner_counts_quantized_bytes(quantized: Path, source: Path) -> None:
    """S_e and S_layer are the records' bytes: the same memory holds ~4x the int4 experts it holds in fp32."""
    from vismmoe_edge.hardware.profiles import get_profile
    from vismmoe_edge.planning.plan import make_plan

    q = make_plan(quantized, get_profile("orin-nano-8gb-super--maxn-super"), mem_available=10**9, c_safe=0)
    dense = make_plan(source, get_profile("orin-nano-8gb-super--maxn-super"), mem_available=10**9, c_safe=0)
    assert q.bytes_per_expert == 23040 and dense.bytes_per_expert == 3 * 128 * 96 * 4  # int4 g32 record; fp32
    assert q.s_layer_bytes == 16 * q.bytes_per_expert and "int4-g32" in " ".join(q.why)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_shipped_model_quantizes_with_defaults(bits: int, tmp_path: Path) -> None:
    from vismmoe_edge.demo import TRAINED_DEMO_DIR

    out = tmp_path / f"int{bits}"
    cli = run_cli if bits == 4 else run_cli_in_process  # int8: the command paths of int4's subprocesses, in process
    proc = cli("quantize", str(TRAINED_DEMO_DIR), str(out), "--bits", str(bits), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    if bits == 4:  # hidden 192, moe_intermediate 48: 128 divides neither, no kernel group divides 48
        assert "int4, group 48 (picked: divides hidden 192 and moe_intermediate 48" in proc.stdout
        assert json.loads((out / "config.json").read_text())["quantization_config"]["group_size"] == 48
    else:
        assert "int8, per output channel" in proc.stdout and "picked" not in proc.stdout
    proc = cli("run", "--model", str(out), "--prompt", "What shape is it?", "--max-new-tokens", "2")
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


def test_pick_group_size_prefers_128_then_kernel_groups() -> None:
    from vismmoe_edge.errors import VismmoeError
    from vismmoe_edge.quant.config import pick_group_size

    assert pick_group_size(2048, 768) == 128  # Qwen3-VL-30B-A3B
    assert pick_group_size(192, 96) == 32 and pick_group_size(192, 48) == 48 and pick_group_size(30, 18) == 6
    with pytest.raises(VismmoeError, match="no even divisor"):
        pick_group_size(15, 9)
