"""tools/checkpoints/synthetic_qwen3_vl_moe.py: a small build loads in transformers and in vismmoe_edge and
generates."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from checkpoints import synthetic_qwen3_vl_moe as msc  # noqa: E402

# The --layers 2 --experts 16 smoke mode, with narrower text dims so the whole test stays well under 20 s on a
# 2-core VM (the real 2048-wide version writes ~645 MB).
SMALL = dict(layers=2, experts=16, top_k=4, hidden=256, heads=4, kv_heads=2, head_dim=64, moe_intermediate=96,
             vocab=1024, shard_bytes=1 << 20)


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return msc.build_synthetic_checkpoint(tmp_path_factory.mktemp("syn") / "tiny", seed=3, progress=False, **SMALL)


def test_layout_config_and_headers(small_ckpt: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    names = {p.name for p in small_ckpt.iterdir()}
    assert {"config.json", "generation_config.json", msc.INDEX_NAME, "tokenizer.json", msc.MARKER_NAME} <= names
    assert not list(small_ckpt.parent.glob(".*.partial"))
    config = AutoConfig.from_pretrained(str(small_ckpt), local_files_only=True)
    assert config.architectures == ["Qwen3VLMoeForConditionalGeneration"]
    text = config.get_text_config()
    assert (text.num_hidden_layers, text.num_experts, text.hidden_size) == (2, 16, 256)
    assert config.vision_config.out_hidden_size == 256

    summary = msc.validate_checkpoint(small_ckpt)
    assert summary["shards"] > 1  # 1 MiB shards: several, every header parsed and matched to the index
    index = json.loads((small_ckpt / msc.INDEX_NAME).read_text())
    key = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    with safe_open(str(small_ckpt / index["weight_map"][key]), framework="pt") as f:
        gate_up = f.get_tensor(key)
    assert gate_up.dtype == torch.bfloat16 and tuple(gate_up.shape) == (16, 2 * 96, 256)  # v5 layout [E, 2I, H]
    assert abs(gate_up.float().std().item() - 0.02) < 0.002
    key = "model.language_model.layers.0.mlp.gate.weight"
    with safe_open(str(small_ckpt / index["weight_map"][key]), framework="pt") as f:
        assert abs(f.get_tensor(key).float().std().item() - 0.3) < 0.03


def test_deterministic_per_tensor(small_ckpt: Path, tmp_path: Path) -> None:
    one_shard = {**SMALL, "shard_bytes": 2 << 30}
    again = msc.build_synthetic_checkpoint(tmp_path / "again", seed=3, progress=False, **one_shard)
    from safetensors.torch import load_file

    a = {}
    for shard in sorted(small_ckpt.glob("model-*.safetensors")):
        a.update(load_file(str(shard)))
    b = load_file(str(next(again.glob("model-*.safetensors"))))  # one shard now: same tensors, other packing
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loads_and_generates_in_vismmoe_edge(small_ckpt: Path) -> None:
    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    engine = vismmoe_edge.load(small_ckpt, memory_budget="50%")
    result = engine.generate("hi", sampling=SamplingConfig(max_new_tokens=3))
    assert 1 <= len(result.token_ids) <= 3
    assert all(0 <= t < 1024 for t in result.token_ids)
    assert result.experts["misses"] > 0


def test_real_size_plan_without_writing() -> None:
    """The default (8-layer, Qwen3-VL-30B-A3B-sized) plan: 9 MiB per expert, ~10.2 GB in all; nothing is written."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_offline_tokenizer

    tok = build_offline_tokenizer()
    config = msc.synthetic_config(tokenizer=tok)
    specs = msc._plan(config, dtype=torch.bfloat16, seed=0, router_std=0.3, expert_std=0.02, layout="v5",
                      zero_lm_head_rows=[])
    experts = [s for s in specs if ".mlp.experts." in s.name]
    assert len(experts) == 16
    assert sum(s.nbytes for s in experts) == 8 * 128 * 9 * (1 << 20)
    total = sum(s.nbytes for s in specs)
    assert 10.0e9 < total < 10.4e9
    shards = msc._pack(specs, 2 << 30)
    assert all(sum(s.nbytes for s in shard) <= 2 << 30 for shard in shards)


def test_refuses_a_disk_too_small_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    full = shutil.disk_usage(tmp_path)._replace(free=1 << 20)  # 1 MiB free: less than the small build's ~3 MB
    monkeypatch.setattr(msc.shutil, "disk_usage", lambda path: full)
    with pytest.raises(SystemExit, match=r"needs \d+\.\d GB, 0\.0 GB free under .*: free space or choose"):
        msc.build_synthetic_checkpoint(tmp_path / "tiny", seed=3, progress=False, **SMALL)
    assert list(tmp_path.iterdir()) == []  # no partial directory left behind
