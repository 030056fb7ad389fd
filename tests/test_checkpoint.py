"""The checkpoint reader: byte ranges equal the tensors, and every broken input names its file and tensor."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vismmoe_edge.checkpoint import build_expert_catalogue, read_shard_header, read_tensor_table
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ExpertStore, ShardFiles
from vismmoe_edge.models import qwen3_vl_moe


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def shard_holding(model_dir: Path, suffix: str) -> tuple[Path, str]:
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(k for k in weight_map if k.endswith(suffix))
    return model_dir / weight_map[name], name


@pytest.mark.parametrize("layout", ["v5", "hub", "per_expert"])
def test_catalogue_layout_and_byte_ranges_match_safetensors(checkpoints, layout: str) -> None:
    model_dir = checkpoints[layout]
    config = qwen3_vl_moe.read_config(model_dir)
    catalogue = qwen3_vl_moe.FAMILY.catalogue_for(config, read_tensor_table(model_dir))
    text = config.text_config
    assert catalogue.layout == layout
    assert catalogue.moe_layers == list(range(text.num_hidden_layers))
    assert len(catalogue.experts) == text.num_hidden_layers * text.num_experts
    assert catalogue.expert_bytes == 3 * text.moe_intermediate_size * text.hidden_size * 4  # fp32

    # Every expert read from our byte ranges equals the same expert cut out of the v5 tensors by safetensors.
    reference_dir = checkpoints["v5"]
    store = ExpertStore(catalogue, ShardFiles(), torch.float32, torch.device("cpu"))
    for layer, expert in [(0, 0), (3, 7), (text.num_hidden_layers - 1, text.num_experts - 1)]:
        weights = store.load(layer, expert)
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        for kind, ours in (("gate_up_proj", weights.gate_up), ("down_proj", weights.down)):
            shard, _ = shard_holding(reference_dir, f"layers.{layer}.mlp.experts.{kind}")
            with safe_open(shard, "pt") as f:
                assert torch.equal(ours, f.get_slice(f"{prefix}.{kind}")[expert])
    assert store.bytes_read == 3 * catalogue.expert_bytes


def test_single_file_checkpoint(tmp_path: Path) -> None:
    tensors = {
        "model.language_model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 6, 5),
        "model.language_model.layers.0.mlp.experts.down_proj": torch.randn(4, 5, 3),
        "other.weight": torch.randn(2),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    catalogue = build_expert_catalogue(read_tensor_table(tmp_path), num_experts=4, hidden=5, inter=3)
    assert catalogue.layout == "v5" and catalogue.moe_layers == [0]
    part = catalogue.expert(0, 2).parts[1]
    raw = (tmp_path / "model.safetensors").read_bytes()[part.offset : part.offset + part.nbytes]
    assert torch.equal(
        torch.frombuffer(bytearray(raw), dtype=torch.float32).view(5, 3),
        tensors["model.language_model.layers.0.mlp.experts.down_proj"][2],
    )


def test_ambiguous_layout_is_refused(tmp_path: Path) -> None:
    save_file(
        {
            "m.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 8, 8),
            "m.layers.0.mlp.experts.down_proj": torch.zeros(2, 8, 4),
        },
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(VismmoeError, match="ambiguous"):
        build_expert_catalogue(read_tensor_table(tmp_path), num_experts=2, hidden=8, inter=4)


def test_truncated_shard_names_file_and_tensor(checkpoints, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(checkpoints["v5"], tmp_path / "m")
    shard, name = shard_holding(model_dir, "layers.2.mlp.experts.gate_up_proj")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(VismmoeError) as err:
        read_tensor_table(model_dir)
    assert shard.name in str(err.value) and name in str(err.value) and "truncated" in str(err.value)


def test_shard_shorter_than_its_header(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 5000) + b"{}")
    with pytest.raises(VismmoeError, match="corrupt safetensors header"):
        read_shard_header(path)
    path.write_bytes(b"abc")
    with pytest.raises(VismmoeError, match="truncated"):
        read_shard_header(path)


def test_garbage_header(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 8) + b"not json" + b"\0" * 64)
    with pytest.raises(VismmoeError, match="not JSON"):
        read_shard_header(path)


def test_offsets_past_file_end(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)
    with pytest.raises(VismmoeError, match=r"tensor w ends at byte .* past the file end"):
        read_shard_header(path)


def test_offsets_disagree_with_shape(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [10], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 100)
    with pytest.raises(VismmoeError, match="does not match shape"):
        read_shard_header(path)


def test_missing_shard_listed_in_index(checkpoints, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(checkpoints["v5"], tmp_path / "m")
    shard, _ = shard_holding(model_dir, "layers.1.mlp.experts.down_proj")
    shard.unlink()
    with pytest.raises(VismmoeError, match=f"shard {shard.name} .* is missing"):
        read_tensor_table(model_dir)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x-1.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "x-2.safetensors"))
    with pytest.raises(VismmoeError, match="tensor a appears in both"):
        read_tensor_table(tmp_path)


def test_index_names_tensor_absent_from_shard(checkpoints, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(checkpoints["v5"], tmp_path / "m")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.language_model.layers.0.mlp.gate.extra"] = next(iter(index["weight_map"].values()))
    index_path.write_text(json.dumps(index))
    with pytest.raises(VismmoeError, match="layers.0.mlp.gate.extra listed in"):
        read_tensor_table(model_dir)


def test_missing_expert_tensor(tmp_path: Path) -> None:
    save_file({"m.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 6, 5)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(VismmoeError, match="missing tensor mlp.experts.down_proj"):
        build_expert_catalogue(read_tensor_table(tmp_path), num_experts=2, hidden=5, inter=3)


def test_expert_shape_mismatch_with_config(checkpoints) -> None:
    table = read_tensor_table(checkpoints["hub"])
    with pytest.raises(VismmoeError, match=r"gate_up_proj has shape \[16, 128, 96\], expected"):
        build_expert_catalogue(table, num_experts=16, hidden=128, inter=40)
    with pytest.raises(VismmoeError, match="expected 12 experts"):
        build_expert_catalogue(table, num_experts=12, hidden=128, inter=48)


def test_per_expert_missing_expert(checkpoints, tmp_path: Path) -> None:
    table = read_tensor_table(checkpoints["per_expert"])
    table = {k: v for k, v in table.items() if ".layers.4.mlp.experts.9." not in k}
    with pytest.raises(VismmoeError, match="layer 4: expert 9 is missing"):
        build_expert_catalogue(table, num_experts=16, hidden=128, inter=48)


def test_non_expert_shape_mismatch_names_tensor(checkpoints, tmp_path: Path) -> None:
    import vismmoe_edge

    model_dir = copy_checkpoint(checkpoints["v5"], tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"]["num_attention_heads"] = 8  # q_proj then has the wrong shape for this config
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        VismmoeError,
        match=r"layers\.\d+\.self_attn\.\w+\.weight has shape \[.*\], config.json implies",
    ):
        vismmoe_edge.load(model_dir)


def test_dtype_mismatch_between_layers_is_caught(tmp_path: Path) -> None:
    save_file(
        {
            "m.layers.0.mlp.experts.gate_up_proj": torch.zeros(2, 6, 5),
            "m.layers.0.mlp.experts.down_proj": torch.zeros(2, 5, 3, dtype=torch.bfloat16),
        },
        str(tmp_path / "model.safetensors"),
    )
    with pytest.raises(VismmoeError, match="dtype"):
        build_expert_catalogue(read_tensor_table(tmp_path), num_experts=2, hidden=5, inter=3)
