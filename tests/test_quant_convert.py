"""quantize_checkpoint on tiny checkpoints of every family and expert layout, and on FP8 / W4A16 / AWQ sources.

Checked on each output: expert bytes against the issue's budget, experts dequantizing to exactly what the
quantizer makes of the source weights (read here with safetensors, not with the converter's reader), every other
tensor byte-identical, tokenizer/processor/template files copied, and that the model family still reads the
config. Sources of the downloaded formats come from tests/quant_sources.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.quant_sources import (
    one_thread,  # noqa: F401 - autouse: one torch thread in this module
    write_awq,
    write_compressed_tensors,
    write_fp8,
)
from vismmoe_edge.checkpoint import read_tensor_table
from vismmoe_edge.conversion import quantize_checkpoint, read_quantized_catalogue
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.models.registry import model_family
from vismmoe_edge.quant import convert
from vismmoe_edge.quant.kernels import dequantize_expert, expert_views
from vismmoe_edge.quant.quantize import quantize_int4, quantize_int8

EXPERT = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj|\d+\.(gate|up|down)_proj\.weight)$")
QWEN = {"num_layers": 2, "hidden": 384, "moe_intermediate": 128, "dtype": torch.bfloat16, "max_shard_size": "300KB"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny bf16 Qwen3-VL-MoE in each layout, with dimensions group 128 divides (hidden 384, experts 128)."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("qsrc")
    return {layout: build_tiny_checkpoint(root / layout, seed=3, layout=layout, **QWEN) for layout in ("v5", "hub", "per_expert")}  # fmt: skip  # noqa: E501


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(directory / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def source_experts(src: dict[str, torch.Tensor], layer: int, e: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [2I, H], down [H, I]) float32 of one expert, from the tensors as saved."""
    fused = [k for k in src if re.search(rf"\.layers\.{layer}\.mlp\.experts\.gate_up_proj$", k)]
    if fused:
        gate_up, down = src[fused[0]][e].float(), src[fused[0].replace("gate_up_proj", "down_proj")][e].float()
        if gate_up.shape[0] != 2 * inter:  # hub: [H, 2I] / [I, H]
            gate_up, down = gate_up.t(), down.t()
        return gate_up, down
    base = next(k for k in src if re.search(rf"\.layers\.{layer}\.mlp\.experts\.{e}\.gate_proj\.weight$", k))
    base = base.removesuffix("gate_proj.weight")
    gate_up = torch.cat([src[base + "gate_proj.weight"], src[base + "up_proj.weight"]]).float()
    return gate_up, src[base + "down_proj.weight"].float()


def check_output(src_dir: Path, out: Path, bits: int, group: int | None, reference=None) -> dict[str, torch.Tensor]:
    """The invariants of every conversion; returns the output's tensors for further checks."""
    catalogue = read_quantized_catalogue(out)
    spec = catalogue.spec
    assert spec.quant.bits == bits and spec.quant.group_size == group
    dense = 3 * spec.hidden * spec.inter * 2 * len(catalogue.experts)  # the same experts in bf16
    if group in (None, 128):
        assert catalogue.total_bytes / dense <= (0.28 if bits == 4 else 0.53)
    src, dst = tensors(src_dir), tensors(out)
    kept = {k for k in src if not EXPERT.search(k)}
    assert kept <= set(dst)
    assert set(dst) - kept == catalogue.tensor_names
    files = ShardFiles()
    try:
        for layer, e in [(catalogue.moe_layers[0], 0), (catalogue.moe_layers[-1], catalogue.num_experts - 1)]:
            r = catalogue.expert(layer, e)
            got = dequantize_expert(expert_views(files.view(r.shard, r.offset, r.nbytes, "U8", (r.nbytes,)), spec))
            want = reference(layer, e) if reference else source_experts(src, layer, e, spec.inter)
            for g, w in zip(got, want, strict=True):
                expected = quantize_int4(w, group).dequantize() if bits == 4 else _int8(w)
                assert torch.equal(g, expected)
    finally:
        files.close()
    for name in (f.name for f in src_dir.iterdir() if f.is_file() and not f.name.endswith(".safetensors")):
        if name not in ("config.json", "model.safetensors.index.json"):
            assert (out / name).read_bytes() == (src_dir / name).read_bytes(), name
    family = model_family(out)
    family.read_config(out)
    return dst


def _int8(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_int8(w)
    return q.float() * s.float()[:, None]


def assert_kept_identical(src_dir: Path, dst: dict[str, torch.Tensor], skip=lambda name: False) -> None:
    for name, t in tensors(src_dir).items():
        if not EXPERT.search(name) and not skip(name):
            assert dst[name].dtype == t.dtype and torch.equal(dst[name].view(torch.uint8), t.view(torch.uint8)), name


@pytest.mark.parametrize("layout", ["v5", "hub", "per_expert"])
def test_qwen_int4_every_layout(qwen: dict[str, Path], layout: str, tmp_path: Path) -> None:
    out = quantize_checkpoint(qwen[layout], tmp_path / "q4", 4, progress=False, max_shard_size="400KB")
    dst = check_output(qwen[layout], out, 4, 128)
    assert_kept_identical(qwen[layout], dst)
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    assert not list(tmp_path.glob(".q4*"))  # the temporary directory is gone


def test_qwen_int8(qwen: dict[str, Path], tmp_path: Path) -> None:
    out = quantize_checkpoint(qwen["v5"], tmp_path / "q8", 8, progress=False)
    assert_kept_identical(qwen["v5"], check_output(qwen["v5"], out, 8, None))


def test_glm4v_int4(tmp_path: Path) -> None:
    """Per-expert GLM-4.5V (fp32, shared experts, a dense first layer): hidden 128 and experts 48 wide -> g16."""
    from vismmoe_edge.testing.tiny_glm4v import build_tiny_glm4v_checkpoint

    src = build_tiny_glm4v_checkpoint(tmp_path / "glm", num_layers=3)
    out = quantize_checkpoint(src, tmp_path / "q", 4, 16, progress=False)
    dst = check_output(src, out, 4, 16)
    assert_kept_identical(src, dst)
    assert any(".shared_experts." in k for k in dst) and read_quantized_catalogue(out).moe_layers == [1, 2]


def test_deepseek_vl2_int4(tmp_path: Path) -> None:
    from vismmoe_edge.testing.tiny_deepseek_vl2 import build_tiny_deepseek_vl2_checkpoint

    src = build_tiny_deepseek_vl2_checkpoint(tmp_path / "ds", "tiny", num_layers=3)
    out = quantize_checkpoint(src, tmp_path / "q", 4, 32, progress=False)
    assert_kept_identical(src, check_output(src, out, 4, 32))


@pytest.fixture(scope="module")
def per_expert_src(qwen: dict[str, Path]) -> Path:
    return qwen["per_expert"]


def _reference_experts(reference: dict[str, torch.Tensor]):
    def experts(layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = next(k for k in reference if f".layers.{layer}.mlp.experts.{e}.gate_proj" in k)
        base = base.removesuffix("gate_proj.weight")
        gate_up = torch.cat([reference[base + "gate_proj.weight"], reference[base + "up_proj.weight"]])
        return gate_up, reference[base + "down_proj.weight"]

    return experts


def test_fp8_source_with_fused_experts(qwen: dict[str, Path], tmp_path: Path) -> None:
    reference = write_fp8(qwen["v5"], tmp_path / "fp8")
    out = quantize_checkpoint(tmp_path / "fp8", tmp_path / "q", 4, progress=False)

    def experts(layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"model.language_model.layers.{layer}.mlp.experts."
        return reference[prefix + "gate_up_proj"][e], reference[prefix + "down_proj"][e]

    dst = check_output(qwen["v5"], out, 4, 128, experts)
    assert_kept_identical(qwen["v5"], dst, skip=lambda n: n in reference)


def test_fp8_source(per_expert_src: Path, tmp_path: Path) -> None:
    reference = write_fp8(per_expert_src, tmp_path / "fp8")
    out = quantize_checkpoint(tmp_path / "fp8", tmp_path / "q", 4, progress=False)
    dst = check_output(per_expert_src, out, 4, 128, _reference_experts(reference))
    attention = [k for k in reference if ".self_attn." in k]
    for name in attention:  # quantized non-expert weights come back dequantized, in bf16
        assert dst[name].dtype == torch.bfloat16 and torch.equal(dst[name], reference[name].to(torch.bfloat16))
    assert not any(k.endswith("_scale_inv") for k in dst)
    assert_kept_identical(per_expert_src, dst, skip=lambda n: n in reference)


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_source_keeps_its_codes(per_expert_src: Path, tmp_path: Path, symmetric: bool) -> None:
    reference = write_compressed_tensors(per_expert_src, tmp_path / "ct", symmetric=symmetric)
    out = quantize_checkpoint(tmp_path / "ct", tmp_path / "q", 4, progress=False)
    source_scales = {key: scales_of(tmp_path / "ct", *key, "weight_scale", lambda t: t) for key in [(0, 0), (1, 15)]}
    catalogue = read_quantized_catalogue(out)
    files = ShardFiles()
    for layer, e in [(0, 0), (1, 15)]:
        r = catalogue.expert(layer, e)
        got = dequantize_expert(
            expert_views(files.view(r.shard, r.offset, r.nbytes, "U8", (r.nbytes,)), catalogue.spec)
        )
        for g, w in zip(got, _reference_experts(reference)(layer, e), strict=True):
            if symmetric:  # bf16 scales, zero 0: the same codes and scales, bit for bit
                assert torch.equal(g, w)
            else:  # the float zero -zp*scale rounded to bf16 (half an ulp: <= 2^-8 relative): <= 8 * 2^-8 scale
                step = source_scales[(layer, e)].pop(0)  # [out, groups], the source's own scales
                assert within(g, w, step / 32)
    files.close()
    dst = tensors(out)
    for name in (k for k in reference if ".self_attn." in k):
        assert torch.equal(dst[name], reference[name].to(torch.bfloat16))
    assert_kept_identical(per_expert_src, dst, skip=lambda n: n in reference)


def test_awq_source(per_expert_src: Path, tmp_path: Path) -> None:
    reference = write_awq(per_expert_src, tmp_path / "awq")
    out = quantize_checkpoint(tmp_path / "awq", tmp_path / "q4", 4, progress=False)
    catalogue = read_quantized_catalogue(out)
    files = ShardFiles()
    r = catalogue.expert(1, 7)
    got = dequantize_expert(expert_views(files.view(r.shard, r.offset, r.nbytes, "U8", (r.nbytes,)), catalogue.spec))
    steps = scales_of(tmp_path / "awq", 1, 7, "scales", lambda t: t.t())  # AWQ keeps [in/g, out]
    for g, w, step in zip(got, _reference_experts(reference)(1, 7), steps, strict=True):
        # fp16 scale and the float zero (8 - z) * scale rounded to bf16 (<= 2^-8 relative): <= 8 * 2^-8 scale each
        assert within(g, w, step / 16)
    files.close()
    out8 = quantize_checkpoint(tmp_path / "awq", tmp_path / "q8", 8, progress=False)
    check_output(per_expert_src, out8, 8, None, _reference_experts(reference))


def scales_of(directory: Path, layer: int, e: int, suffix: str, orient) -> list[torch.Tensor]:
    """The source's per-group scales of one expert as [out, groups] float32: gate_up (gate rows, up rows), down."""
    t = tensors(directory)
    base = next(k for k in t if f".layers.{layer}.mlp.experts.{e}.gate_proj." in k).split(".gate_proj.")[0]
    get = [orient(t[f"{base}.{m}_proj.{suffix}"]).float() for m in ("gate", "up", "down")]
    return [torch.cat(get[:2]), get[2]]


def within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> bool:
    """|got - want| <= bound per group of 128 inputs (plus float32 rounding of the products)."""
    err = (got - want).abs().view(want.shape[0], -1, 128)
    return bool((err <= bound[..., None] * (1 + 1e-3) + 1e-7).all())


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert message and "\n" not in message
    return message


def test_refusals(qwen: dict[str, Path], per_expert_src: Path, tmp_path: Path) -> None:
    src = qwen["v5"]
    with pytest.raises(VismmoeError) as e:  # 96 divides hidden 384 but not the experts' 128
        quantize_checkpoint(src, tmp_path / "a", 4, 96, progress=False)
    assert "--group-size 96 does not divide" in one_line(e)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(VismmoeError) as e:
        quantize_checkpoint(src, tmp_path / "full", 4, progress=False)
    assert "not an empty directory" in one_line(e)
    with pytest.raises(VismmoeError) as e:
        quantize_checkpoint(src, tmp_path / "b", 8, 128, progress=False)
    assert "per output channel" in one_line(e)
    done = quantize_checkpoint(src, tmp_path / "c", 4, progress=False)
    with pytest.raises(VismmoeError) as e:
        quantize_checkpoint(done, tmp_path / "d", 4, progress=False)
    assert "already quantized by vismmoe-edge" in one_line(e)
    write_compressed_tensors(per_expert_src, tmp_path / "actorder", symmetric=True, act_order=True)
    with pytest.raises(VismmoeError) as e:
        quantize_checkpoint(tmp_path / "actorder", tmp_path / "e", 4, progress=False)
    assert "weight_g_idx" in one_line(e) and "act-order" in one_line(e)
    config = json.loads((src / "config.json").read_text()) | {"quantization_config": {"quant_method": "gptq"}}
    (tmp_path / "gptq").mkdir()
    for f in src.iterdir():
        (tmp_path / "gptq" / f.name).symlink_to(f)
    (tmp_path / "gptq" / "config.json").unlink()
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(VismmoeError) as e:
        quantize_checkpoint(tmp_path / "gptq", tmp_path / "f", 4, progress=False)
    assert "'gptq' is not supported" in one_line(e)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # nothing half-written left behind


def test_interrupted_run_leaves_nothing_that_loads(qwen: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    written = []
    real = convert._write_shard

    def stop_after_one(path, units, bar):
        if written:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the second shard
        real(path, units, bar)
        written.append(path)

    monkeypatch.setattr(convert, "_write_shard", stop_after_one)
    with pytest.raises(KeyboardInterrupt):
        quantize_checkpoint(qwen["v5"], tmp_path / "out", 4, progress=False, max_shard_size="300KB")
    assert written and not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_and_leaves_nothing(qwen: dict[str, Path], tmp_path: Path, monkeypatch) -> None:
    """Too little free space is refused before converting; a disk that fills up during the run (another writer)
    ends in one line too. Either way nothing is left at the output path."""
    import errno
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(convert.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(VismmoeError, match=r"the output needs .* free: free space there"):
        quantize_checkpoint(qwen["v5"], tmp_path / "out", 4, progress=False)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    def full(path, units, bar):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert, "_write_shard", full)
    with pytest.raises(VismmoeError, match="filled up while writing"):
        quantize_checkpoint(qwen["v5"], tmp_path / "out", 4, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_killed_run_leaves_no_config(qwen: dict[str, Path], tmp_path: Path) -> None:
    """SIGKILL (no cleanup runs): the hidden temporary directory stays, but it has no config.json, and OUT is absent."""
    import subprocess
    import sys

    script = f"""
import os, signal
from vismmoe_edge.quant import convert
real = convert._write_shard
def die(path, units, bar):
    real(path, units, bar)
    os.kill(os.getpid(), signal.SIGKILL)
convert._write_shard = die
from vismmoe_edge.conversion import quantize_checkpoint
quantize_checkpoint({str(qwen["v5"])!r}, {str(tmp_path / "out")!r}, 4, progress=False, max_shard_size="300KB")
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(root), "PATH": "", "OMP_NUM_THREADS": "1"},
        capture_output=True,
    )
    assert done.returncode == -9, done.stderr[-500:]
    assert not (tmp_path / "out").exists()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".out.partial-")
    assert list(left[0].glob("*.safetensors")) and not (left[0] / "config.json").exists()
    with pytest.raises(VismmoeError):
        read_quantized_catalogue(left[0])


def test_shards_respect_the_size_limit(qwen: dict[str, Path], tmp_path: Path) -> None:
    out = quantize_checkpoint(qwen["hub"], tmp_path / "q", 4, progress=False, max_shard_size="250KB")
    table = read_tensor_table(out)
    record = read_quantized_catalogue(out).expert_bytes
    for shard in {t.shard for t in table.values()}:
        data = sum(t.nbytes for t in table.values() if t.shard == shard)
        biggest = max(t.nbytes for t in table.values() if t.shard == shard)
        assert data <= max(250_000, biggest, record)
