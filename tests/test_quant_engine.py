"""Quantized Qwen3-VL-MoE checkpoints through the engine against transformers' own model loaded with the same file's
dequantized weights: same greedy tokens and logits within LOGIT_ATOL (tests/hf_reference.py), text and images,
at 100% and 25% budgets, on the host slots and the unified page-cache tier, and through the static decoder.

The tiny checkpoints use moe_intermediate 96 so that group 32 (a group the int4 kernels take) divides both
widths: what runs is `_weight_int4pack_mm_for_cpu` on the record's bytes, not the dequantize fallback (the
default widths, 48, take that fallback; it is tested too).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

import vismmoe_edge
from tests.hf_reference import assert_matches, hf_references
from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from vismmoe_edge.config import parse_budget
from vismmoe_edge.conversion import dequantize_checkpoint, quantize_checkpoint
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.kernels import CUDA_TINYGEMM, cpu_kernel_ok
from vismmoe_edge.quant.packing import native_cpu_layout

LAYERS = 10  # a 25% budget keeps a 1-layer pinned prefix and cache slots beside it
KERNEL_WIDTHS = {"moe_intermediate": 96}  # hidden 128: group 32 divides 128 and 96


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("qeng")
    out = {
        layout: build_tiny_checkpoint(root / layout, seed=7, layout=layout, num_layers=LAYERS, **KERNEL_WIDTHS)
        for layout in ("v5", "hub", "per_expert")
    }
    out["narrow"] = build_tiny_checkpoint(root / "narrow", seed=11, num_layers=8)  # moe_intermediate 48
    return out


@pytest.fixture(scope="module")
def quantized(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qengq")
    out = {}
    for layout in ("v5", "hub", "per_expert"):
        out[f"int4-{layout}"] = quantize_checkpoint(sources[layout], root / f"int4-{layout}", 4, 32, progress=False)
    out["int8-v5"] = quantize_checkpoint(sources["v5"], root / "int8-v5", 8, progress=False)
    out["int4-rowmajor"] = quantize_checkpoint(sources["v5"], root / "rowmajor", 4, 32, progress=False,
                                               layout="rowmajor")  # fmt: skip
    out["int4-g16-narrow"] = quantize_checkpoint(sources["narrow"], root / "narrow", 4, 16, progress=False)
    for dense_bits in (4, 8):  # attention, lm_head at dense_bits, the vision tower at int8
        out[f"int4-dense{dense_bits}"] = quantize_checkpoint(sources["v5"], root / f"dense{dense_bits}", 4, 32,
                                                             progress=False, dense_bits=dense_bits)  # fmt: skip
    return out


_refs: dict[str, dict] = {}


@pytest.fixture
def references(quantized: dict[str, Path], images: list[Path], tmp_path_factory: pytest.TempPathFactory):
    """transformers on each quantized file's dequantized copy, built once per file."""

    def get(name: str):
        if name not in _refs:
            ddir = dequantize_checkpoint(quantized[name], tmp_path_factory.mktemp("deq") / name)
            model = Qwen3VLMoeForConditionalGeneration.from_pretrained(ddir, experts_implementation="eager").eval()
            engine = vismmoe_edge.load(quantized[name], device="cpu")  # its processor encodes the prompts
            _refs[name] = hf_references(model, engine.encode, images)
        return _refs[name]

    return get


def load(model_dir: Path, budget: str, tier: str):
    pinned = 0 if budget == "100%" else 1
    return vismmoe_edge.load(model_dir, memory_budget=budget, pinned_layers=pinned, tier=tier, device="cpu")


def test_every_source_layout_quantizes_to_the_same_file(quantized) -> None:
    """The expert layout is read at conversion only: from v5, hub and per-expert sources the shards and the index are
    byte-identical, and config.json differs only in the source layout it records. So the engine checks below run on the
    v5 conversion and hold for the other two."""
    base = quantized["int4-v5"]
    names = sorted(f.name for f in base.iterdir())
    assert sum(n.endswith(".safetensors") for n in names) >= 1
    for layout in ("hub", "per_expert"):
        other = quantized[f"int4-{layout}"]
        assert sorted(f.name for f in other.iterdir()) == names
        for n in names:
            if n != "config.json":
                assert (other / n).read_bytes() == (base / n).read_bytes(), (layout, n)
        config, base_config = (json.loads((d / "config.json").read_text()) for d in (other, base))
        assert config["quantization_config"]["source"]["expert_layout"] == layout
        assert base_config["quantization_config"]["source"]["expert_layout"] == "v5"
        config["quantization_config"]["source"]["expert_layout"] = "v5"
        assert config == base_config


@pytest.mark.parametrize("tier", ["host", "unified", "unified-slots"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_int4_matches_transformers_on_the_dequantized_file(quantized, references, budget, tier) -> None:
    name = "int4-v5"  # the hub and per-expert conversions are the same bytes (the test above)
    engine = load(quantized[name], budget, tier)
    assert engine.dtype == torch.float32 and engine.catalogue.quant.quant.bits == 4
    tier_impl = engine.experts.pipeline.tier
    if tier != "unified":  # the CPU kernel's tiles sit in the slot as the file stores them: nothing rebuilt per fetch
        assert set(tier_impl.form.layouts.values()) == {native_cpu_layout()} and not tier_impl.form.rebuilds
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no per-call repack, no dequantize fallback warning
        assert_matches(engine, references(name))
    stats = engine.experts.pipeline.stats
    budget_bytes = parse_budget(budget, engine.catalogue.expert_bytes * len(engine.catalogue.experts))
    assert stats.peak_resident_bytes <= budget_bytes
    assert stats.bytes_read == stats.misses * engine.catalogue.quant.nbytes  # a miss moves the record's bytes
    if budget == "25%":
        assert stats.misses > 0 and stats.evictions > 0


@pytest.mark.parametrize("tier", ["host", "unified", "unified-slots"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_int8_matches_transformers_on_the_dequantized_file(quantized, references, budget, tier) -> None:
    engine = load(quantized["int8-v5"], budget, tier)
    assert engine.catalogue.quant.quant.bits == 8
    assert_matches(engine, references("int8-v5"))
    if budget == "25%":
        assert engine.experts.pipeline.stats.evictions > 0


@pytest.mark.parametrize("tier", ["host", "unified"])
def test_a_file_in_another_cpus_layout_still_matches(quantized, references, tier) -> None:
    """Row-major nibbles: host slots rebuild this CPU's tiles in place at fetch; the unified tier repacks per call
    (and says so once)."""
    engine = load(quantized["int4-rowmajor"], "25%", tier)
    if tier == "host":
        assert engine.experts.pipeline.tier.form.rebuilds
        assert_matches(engine, references("int4-rowmajor"))
        return
    with pytest.warns(RuntimeWarning, match="repacking every call"):
        assert_matches(engine, references("int4-rowmajor"))


def test_the_unified_slot_tier_refuses_codes_its_kernels_do_not_read(quantized) -> None:
    """unified-slots reads a record straight into the slot the kernels read and never rewrites it, so a file whose
    int4 codes are in another layout is refused at load in one line that names the conversion."""
    with pytest.raises(VismmoeError, match=r"layout rowmajor.*--layout auto"):
        load(quantized["int4-rowmajor"], "25%", "unified-slots")


def test_a_group_the_kernels_lack_falls_back_and_matches(quantized, references) -> None:
    """The default tiny widths (moe_intermediate 48, as the demo model's) allow no kernel group: group 16 computes
    through dequantize + F.linear, still the same tokens."""
    engine = load(quantized["int4-g16-narrow"], "25%", "host")
    tier = engine.experts.pipeline.tier
    expert = tier.weights(0)
    assert not cpu_kernel_ok(expert.gate_up) and not cpu_kernel_ok(expert.down)
    assert_matches(engine, references("int4-g16-narrow"))


@pytest.mark.parametrize("name", ["int4-v5", "int8-v5"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_static_decoder_matches_transformers(quantized, references, name, budget) -> None:
    """The preallocated-cache decoder (what CUDA graphs replay), eagerly on the CPU, over the quantized pool."""
    engine = load(quantized[name], budget, "host")
    engine.static_decode = "on"
    assert engine.uses_static_decode()
    assert_matches(engine, references(name), static=True)
    assert len(engine._decoders) == 1


def test_mmap_tier_and_the_pinned_prefix_outside_a_pool(quantized, references) -> None:
    engine = load(quantized["int4-v5"], "25%", "mmap")
    assert_matches(engine, references("int4-v5"))


def test_the_cuda_form_is_tinygemm_for_kernel_widths(quantized) -> None:
    """What a GPU slot will hold (built there at fetch): tinygemm tiles for both matrices; decided on the CPU."""
    from vismmoe_edge.conversion import read_quantized_catalogue
    from vismmoe_edge.quant.slot_form import SlotForm, tinygemm_shape

    spec = read_quantized_catalogue(quantized["int4-v5"]).spec
    form = SlotForm.for_device(spec, torch.device("cuda"))
    assert form.layouts == {"gate_up_proj": CUDA_TINYGEMM, "down_proj": CUDA_TINYGEMM} and form.rebuilds
    assert form.tiles == {"gate_up_proj": 8, "down_proj": 2}  # K 128 -> 8 tiles of 16; K 96 -> 2 (96 % 64 != 0)
    buf = torch.zeros(spec.nbytes, dtype=torch.uint8)
    views = form.views(buf)
    assert views.gate_up.qweight.shape == tinygemm_shape(192, 128, 8) and views.gate_up.qweight.dtype == torch.int32
    assert views.nbytes == spec.nbytes  # the tiles take the nibbles' bytes: a GPU slot is one record


@pytest.mark.parametrize("dense_bits", [4, 8])
@pytest.mark.parametrize("tier", ["host", "unified"])
def test_quantized_dense_weights_match_transformers_on_the_dequantized_file(quantized, references, dense_bits, tier):
    """`--dense-bits`: attention projections and lm_head run torch's int4/int8 kernels, the vision tower int8, the
    embedding is read by row from the shard; transformers on the same file dequantized gives the same tokens."""
    from vismmoe_edge.quant.dense import QuantizedLinear, RowEmbedding

    name = f"int4-dense{dense_bits}"
    engine = load(quantized[name], "25%", tier)
    lm, model = engine.language_model, engine.model
    attention = lm.layers[0].self_attn
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == dense_bits
    assert all(isinstance(getattr(attention, p), QuantizedLinear) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert attention.q_proj.bits == dense_bits
    assert isinstance(model.model.visual.blocks[0].attn.qkv, QuantizedLinear)
    assert model.model.visual.blocks[0].attn.qkv.bits == 8
    assert isinstance(lm.embed_tokens, RowEmbedding)
    assert not any(isinstance(m, torch.nn.Linear) and "experts" not in n and not n.endswith("gate")
                   for n, m in model.named_modules())  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the kernels on the stored bytes, no fallback
        assert_matches(engine, references(name))


@pytest.mark.parametrize("dense_bits", [4, 8])
def test_quantized_dense_weights_through_the_static_decoder(quantized, references, dense_bits) -> None:
    engine = load(quantized[f"int4-dense{dense_bits}"], "25%", "host")
    engine.static_decode = "on"
    assert engine.uses_static_decode()
    assert_matches(engine, references(f"int4-dense{dense_bits}"), static=True)


def test_quantized_dense_weights_are_smaller(sources, quantized) -> None:
    from vismmoe_edge.checkpoint_info import inspect_checkpoint

    full = sum(i.nbytes for i in inspect_checkpoint(sources["v5"]).resident_tensors.values())
    for dense_bits, bound in ((8, 0.5), (4, 0.4)):
        info = inspect_checkpoint(quantized[f"int4-dense{dense_bits}"])
        assert sum(i.nbytes for i in info.resident_tensors.values()) < bound * full
