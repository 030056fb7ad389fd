"""tools/checkpoints/streaming_quantized.py: a quantized proxy written without its bf16 checkpoint is the same file
format `quantize --bits 4 --dense-bits 4` writes from that checkpoint, and our engine decodes it like transformers
on its dequantized copy. Narrow dimensions (tiny vision tower, hidden 384) keep it to seconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from checkpoints import streaming_quantized as sq  # noqa: E402
from checkpoints import synthetic_qwen3_vl_moe as msc  # noqa: E402

from vismmoe_edge.checkpoint import read_tensor_table  # noqa: E402

TEXT = dict(top_k=4, hidden=384, heads=4, kv_heads=2, head_dim=64, moe_intermediate=128)
SMALL = dict(layers=2, experts=16, vocab=1024, vision="tiny", **TEXT)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sq") / "proxy"
    return sq.build(out, dense_bits=4, seed=3, layout="rowmajor", progress=False, dense_intermediate=1152, **SMALL)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same geometry written in bf16 by the synthetic builder, then `quantize --bits 4 --dense-bits 4`."""
    from vismmoe_edge.conversion import quantize_checkpoint

    root = tmp_path_factory.mktemp("conv")
    src = msc.build_synthetic_checkpoint(root / "bf16", seed=3, progress=False, layers=2, experts=16, vocab=1024,
                                         **TEXT)  # fmt: skip
    config = json.loads((src / "config.json").read_text())
    assert config["text_config"]["intermediate_size"] == 1152  # synthetic_config's 3 x hidden, as `streamed` asks
    return quantize_checkpoint(src, root / "q", 4, progress=False, layout="rowmajor", dense_bits=4)


def test_same_format_as_quantize(streamed: Path, converted: Path) -> None:
    a, b = read_tensor_table(streamed), read_tensor_table(converted)
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name].dtype, a[name].shape) == (b[name].dtype, b[name].shape), name
    ca, cb = (json.loads((d / "config.json").read_text()) for d in (streamed, converted))
    assert ca["quantization_config"] == cb["quantization_config"]
    assert ca["quantization_config"]["dense"]["bits"] == 4
    assert ca["text_config"] == cb["text_config"]
    assert not list(streamed.parent.glob(".*"))  # no skeleton or partial directory left behind


def test_dense_weights_are_the_seeded_ones(streamed: Path, converted: Path) -> None:
    """Same seed, same generator per tensor name: the dense weights quantize to the same bytes either way."""
    from safetensors import safe_open

    table = read_tensor_table(streamed)
    names = [
        n for n in table if ".self_attn.q_proj." in n or n.startswith("lm_head.") or n.endswith("embed_tokens.weight")
    ]
    names = [n for n in names if "visual" not in n]
    assert len(names) >= 4
    for name in names:
        tensors = []
        for d in (streamed, converted):
            shard = read_tensor_table(d)[name].shard
            with safe_open(str(shard), framework="pt") as f:
                tensors.append(f.get_tensor(name))
        assert torch.equal(tensors[0], tensors[1]), name


@pytest.fixture(scope="module")
def dequantized(streamed: Path) -> Path:
    from vismmoe_edge.conversion import dequantize_checkpoint

    return dequantize_checkpoint(streamed, streamed.parent.parent / "deq", torch.float32)


def test_drawn_experts_have_the_asked_spread(dequantized: Path) -> None:
    from safetensors import safe_open

    table = read_tensor_table(dequantized)
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    with safe_open(str(table[name].shard), framework="pt") as f:
        w = f.get_tensor(name)
    assert tuple(w.shape) == (16, 2 * 128, 384)
    assert abs(w.std().item() - 0.02) < 0.001 and abs(w.mean().item()) < 0.001
    assert w[0].ne(w[1]).any()  # every expert drawn on its own


def test_engine_matches_transformers_on_the_dequantized_proxy(streamed: Path, dequantized: Path) -> None:
    from transformers import Qwen3VLMoeForConditionalGeneration

    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    deq = dequantized
    engine = vismmoe_edge.load(streamed, device="cpu", memory_budget="75%", pinned_layers=1, dtype="float32")
    inputs = engine.encode("Tell me a story about the sea.")
    got = engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=5, min_new_tokens=5)).token_ids
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(deq, dtype=torch.float32, experts_implementation="eager")
    ids = inputs.input_ids
    with torch.no_grad():
        want = ref.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                   min_new_tokens=5, do_sample=False)[0, inputs.num_tokens :]  # fmt: skip
    assert got == want.tolist()
