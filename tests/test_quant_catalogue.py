"""Reading a quantized checkpoint: one byte range per expert, and one-line errors for every broken input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from vismmoe_edge.checkpoint import read_tensor_table
from vismmoe_edge.conversion import quantize_checkpoint, read_quantized_catalogue
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.catalogue import quantized_expert_ranges
from vismmoe_edge.quant.config import make_config, parse_quant_config, read_quant_config


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("qcat")
    src = build_tiny_checkpoint(root / "src", seed=5, num_layers=2, hidden=128, moe_intermediate=96)
    return quantize_checkpoint(src, root / "q", 4, 32, progress=False, max_shard_size="200KB")


@pytest.fixture
def copy(quantized: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(quantized, tmp_path / "copy"))


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(VismmoeError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert message and "\n" not in message
    return message


def test_one_contiguous_range_per_expert(quantized: Path) -> None:
    catalogue = read_quantized_catalogue(quantized)
    assert catalogue.moe_layers == [0, 1] and len(catalogue.experts) == 2 * 16
    table = read_tensor_table(quantized)
    for (layer, e), r in catalogue.experts.items():
        fields = [t for n, t in table.items() if f".layers.{layer}.mlp.experts.{e}." in n]
        assert len(fields) == 4 and {t.shard for t in fields} == {r.shard}
        assert min(t.offset for t in fields) == r.offset and sum(t.nbytes for t in fields) == r.nbytes
        assert max(t.offset + t.nbytes for t in fields) == r.offset + r.nbytes  # no gap, nothing else inside
    assert catalogue.total_bytes == 32 * catalogue.expert_bytes


def test_quantization_config_is_checked(copy: Path) -> None:
    good = json.loads((copy / "config.json").read_text())["quantization_config"]
    assert read_quant_config(copy) == make_config(4, 32, good["layout"])
    broken = {
        "quant_method": good | {"quant_method": "gptq"},
        "format version": good | {"format_version": 2},
        "bits": good | {"bits": 3},
        "group": good | {"group_size": 0},
        "layout": good | {"layout": "cpu_b128"},
        "unknown field": good | {"act_order": True},
        "modules": good | {"quantized_modules": ["routed_experts", "attention"]},
        "record": good | {"expert_record": good["expert_record"][::-1]},
    }
    for what, raw in broken.items():
        assert error(parse_quant_config, raw, "config.json").startswith("config.json:"), what
    assert "not a JSON object" in error(parse_quant_config, [1], "c")
    (copy / "config.json").write_text("{not json")
    assert "not valid JSON" in error(read_quant_config, copy)


def test_shapes_disagreeing_with_config(copy: Path) -> None:
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 64
    (copy / "config.json").write_text(json.dumps(config))
    assert "config.json implies" in error(read_quantized_catalogue, copy)
    config["text_config"]["moe_intermediate_size"] = 96
    config["text_config"]["num_local_experts"] = 8
    (copy / "config.json").write_text(json.dumps(config))
    assert "config.json has 8 experts" in error(read_quantized_catalogue, copy)
    config["text_config"]["num_local_experts"] = 16
    config["quantization_config"]["group_size"] = 64
    (copy / "config.json").write_text(json.dumps(config))
    assert "group 64" in error(read_quantized_catalogue, copy)


def test_truncated_and_corrupt_shards(copy: Path) -> None:
    shard = sorted(copy.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert "truncated" in error(read_quantized_catalogue, copy)
    shard.write_bytes(data[:8] + b"#" * 16 + data[24:])
    assert "corrupt safetensors header" in error(read_quantized_catalogue, copy)
    shard.write_bytes(data[:4])
    assert "truncated" in error(read_quantized_catalogue, copy)


def test_record_that_is_not_contiguous(quantized: Path, tmp_path: Path) -> None:
    """safetensors' own writer orders data by dtype: an expert's bf16 scales end up away from its uint8 codes."""
    table = read_tensor_table(quantized)
    qc = read_quant_config(quantized)
    files = {}
    for name, info in table.items():
        if ".experts.0." in name and ".layers.0." in name:
            raw = info.shard.read_bytes()[info.offset : info.offset + info.nbytes]
            files[name] = torch.frombuffer(bytearray(raw), dtype=info.torch_dtype).view(info.shape)
    save_file(files, str(tmp_path / "one.safetensors"))
    one = read_tensor_table(tmp_path)
    assert "not contiguous" in error(quantized_expert_ranges, one, qc, hidden=128, inter=96, num_experts=1)


def test_missing_and_dense_experts(quantized: Path) -> None:
    table = read_tensor_table(quantized)
    qc = read_quant_config(quantized)
    kwargs = {"hidden": 128, "inter": 96, "num_experts": 16, "moe_layers": [0, 1]}
    partial = {n: t for n, t in table.items() if ".layers.1.mlp.experts.3.down_proj.scales_zeros" not in n}
    assert "no down_proj.scales_zeros" in error(quantized_expert_ranges, partial, qc, **kwargs)
    fewer = {n: t for n, t in table.items() if ".layers.1.mlp.experts.3." not in n}
    assert "expert 3 is missing" in error(quantized_expert_ranges, fewer, qc, **kwargs)
    assert "implies [0, 1, 2]" in error(quantized_expert_ranges, table, qc, **(kwargs | {"moe_layers": [0, 1, 2]}))
    info = next(iter(table.values()))
    dense = table | {"model.language_model.layers.0.mlp.experts.gate_up_proj": info}
    assert "dense expert" in error(quantized_expert_ranges, dense, qc, **kwargs)
    assert "no expert records" in error(quantized_expert_ranges, {}, qc, **kwargs)
