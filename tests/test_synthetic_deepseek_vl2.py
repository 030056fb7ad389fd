"""tools/checkpoints/synthetic_deepseek_vl2.py: a tiny build is in the original DeepSeek-VL2 layout, loads through
vismmoe_edge.load and generates; the real-size default plan has DeepSeek-VL2-Small's expert sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from checkpoints import synthetic_deepseek_vl2 as msd  # noqa: E402

# 1 dense + 2 MoE layers, 8 experts top-2, 2 shared, small MLA: ~0.6 MB, a few seconds on 2 cores.
TINY = dict(layers=3, experts=8, top_k=2, shared=2, hidden=64, heads=4, moe_intermediate=32, dense_intermediate=128,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab=512,
            shard_bytes=64 << 10)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return msd.build_synthetic_deepseek_vl2(tmp_path_factory.mktemp("dsv2syn") / "tiny", seed=3, progress=False, **TINY)


def test_original_layout_and_info(tiny_ckpt: Path) -> None:
    from safetensors import safe_open

    names = {p.name for p in tiny_ckpt.iterdir()}
    assert {"config.json", "generation_config.json", msd.INDEX_NAME, "tokenizer.json", "processor_config.json",
            msd.MARKER_NAME} <= names  # fmt: skip
    assert not list(tiny_ckpt.parent.glob(".*.partial"))
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    assert raw["model_type"] == "deepseek_vl_v2" and raw["architectures"] == ["DeepseekVLV2ForCausalLM"]
    lang = raw["language_config"]
    assert (lang["n_routed_experts"], lang["num_experts_per_tok"], lang["n_shared_experts"]) == (8, 2, 2)
    assert lang["use_mla"] and lang["q_lora_rank"] is None and lang["first_k_dense_replace"] == 1
    weight_map = json.loads((tiny_ckpt / msd.INDEX_NAME).read_text())["weight_map"]
    for name in (
        "language.model.layers.2.mlp.experts.7.gate_proj.weight",
        "language.model.layers.1.mlp.experts.0.down_proj.weight",
        "language.model.layers.1.mlp.shared_experts.up_proj.weight",
        "language.model.layers.0.mlp.gate_proj.weight",
        "language.model.layers.1.mlp.gate.weight",
        "language.model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        "language.lm_head.weight",
        "vision.blocks.1.attn.qkv.weight",
        "vision.pos_embed",
        "vision.attn_pool.latent",
        "projector.layers.2.weight",
        "image_newline",
        "view_seperator",
    ):
        assert name in weight_map, name
    assert not any(".experts.gate_up_proj" in n or n.startswith("vision.encoder") for n in weight_map)
    key = "language.model.layers.1.mlp.experts.3.up_proj.weight"
    with safe_open(str(tiny_ckpt / weight_map[key]), framework="pt") as f:
        up = f.get_tensor(key)
    assert up.dtype == torch.bfloat16 and tuple(up.shape) == (32, 64)

    summary = msd.validate_checkpoint(tiny_ckpt)  # headers vs index, then what `vismmoe-edge info` reads
    assert summary["shards"] > 1
    assert (summary["moe_layers"], summary["experts"], summary["top_k"], summary["shared_experts"]) == (2, 8, 2, 2)
    assert summary["bytes_per_expert"] == 3 * 32 * 64 * 2
    assert summary["shared_expert_bytes"] == 2 * 3 * (2 * 32) * 64 * 2  # both MoE layers' shared experts, resident
    attn_pool = (32 + 32 * 32) * 2  # vision.attn_pool.*: stored, never loaded
    assert summary["resident_bytes"] + 2 * 8 * summary["bytes_per_expert"] + attn_pool == summary["total_bytes"]


def test_loads_and_generates_in_vismmoe_edge(tiny_ckpt: Path) -> None:
    from PIL import Image

    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    engine = vismmoe_edge.load(tiny_ckpt, memory_budget="50%")
    assert engine.catalogue.moe_layers == [1, 2] and engine.catalogue.num_experts == 8
    result = engine.generate("hi", sampling=SamplingConfig(max_new_tokens=3))
    assert 1 <= len(result.token_ids) <= 3 and all(0 <= t < 512 for t in result.token_ids)
    assert result.experts["misses"] > 0
    result = engine.generate("what colour?", images=[Image.new("RGB", (84, 42), (200, 20, 20))],
                             sampling=SamplingConfig(max_new_tokens=2))  # fmt: skip
    assert 1 <= len(result.token_ids) <= 2


def test_deterministic_per_tensor(tiny_ckpt: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    again = msd.build_synthetic_deepseek_vl2(
        tmp_path / "again", seed=3, progress=False, **{**TINY, "shard_bytes": 1 << 30}
    )
    a = {}
    for shard in sorted(tiny_ckpt.glob("model-*.safetensors")):
        a.update(load_file(str(shard)))
    b = load_file(str(next(again.glob("model-*.safetensors"))))  # one shard now: same tensors, other packing
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_real_size_plan_without_writing() -> None:
    """The default plan: DeepSeek-VL2-Small's experts (3 x 1408 x 2048 bf16 = 17.3 MB) in 8 MoE layers, ~9.8 GB."""
    raw = msd.synthetic_config_json(image_token_id=3)
    lang = raw["language_config"]
    assert (lang["hidden_size"], lang["moe_intermediate_size"], lang["n_routed_experts"]) == (2048, 1408, 64)
    assert (lang["kv_lora_rank"], lang["qk_rope_head_dim"], lang["num_hidden_layers"]) == (512, 64, 9)
    specs = msd._plan(raw, dtype=torch.bfloat16, seed=0, router_std=0.3, expert_std=0.02, embed_std=4.0,
                      zero_lm_head_rows=[])  # fmt: skip
    experts = [s for s in specs if ".mlp.experts." in s.name]
    assert len(experts) == 8 * 64 * 3
    assert sum(s.nbytes for s in experts) == 8 * 64 * 3 * 1408 * 2048 * 2
    assert 9.6e9 < sum(s.nbytes for s in specs) < 10.0e9


def test_unified_tier_views_gate_and_up_without_a_copy(tiny_ckpt: Path) -> None:
    """Per-expert checkpoints: safetensors stores an expert's gate_proj right before its up_proj, so the unified
    tier computes from one view of both (no anonymous copy outside the budget) and decodes as the host tier."""
    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=4)
    unified = vismmoe_edge.load(tiny_ckpt, memory_budget="50%", tier="unified")
    shards = unified.experts.pipeline.tier.shards
    for key in unified.catalogue.experts:
        parts = {p.kind: p for p in unified.catalogue.expert(*key).parts}
        if parts["gate"].shard != parts["up"].shard:
            continue
        w = shards.weights(key)
        mapping = shards.files[parts["gate"].shard]
        base = torch.frombuffer(mapping.buffer, dtype=torch.uint8, count=1).data_ptr()
        assert w.gate_up.data_ptr() == base + parts["gate"].offset  # a view into the mapping
        assert w.gate_up.shape == (64, 64)
    host = vismmoe_edge.load(tiny_ckpt, memory_budget="100%", tier="host")
    assert unified.generate("hi", sampling=sampling).token_ids == host.generate("hi", sampling=sampling).token_ids
