"""Quantized GLM-4.5V and DeepSeek-VL2 through the engine against references on the same file's dequantized weights:
transformers' Glm4vMoeForConditionalGeneration (text and images), transformers' DeepseekV2ForCausalLM (DeepSeek-VL2's
language model, text) and, for DeepSeek-VL2 with images (transformers has no DeepSeek-VL2), the plain reference
tools/reference/deepseek_vl2.py. Same greedy tokens, logits within LOGIT_ATOL; 100% and 25% budgets; host and
unified tiers. Shared experts, dense layers and routers stay float (resident), only routed experts are int4.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file
from transformers import DeepseekV2ForCausalLM, Glm4vMoeForConditionalGeneration

import vismmoe_edge
from tests.hf_reference import LOGIT_ATOL, NEW_TOKENS, assert_matches, hf_references
from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from vismmoe_edge.conversion import dequantize_checkpoint, quantize_checkpoint
from vismmoe_edge.sampling import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from reference.deepseek_vl2 import DeepseekVL2Reference  # noqa: E402

GLM_LAYERS = 7  # layer 0 dense, 1..6 MoE
DS_MOE_LAYERS = [1, 2, 3, 4]  # layer 0 dense
DS_EXPERTS = 16


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory, images: list[Path]) -> tuple[Path, dict]:
    from vismmoe_edge.testing.tiny_glm4v import build_tiny_glm4v_checkpoint

    root = tmp_path_factory.mktemp("qglm")
    src = build_tiny_glm4v_checkpoint(root / "src", seed=7, num_layers=GLM_LAYERS, moe_intermediate=96)
    q = quantize_checkpoint(src, root / "int4", 4, 32, progress=False)
    model = Glm4vMoeForConditionalGeneration.from_pretrained(
        dequantize_checkpoint(q, root / "deq"), experts_implementation="eager"
    ).eval()
    return q, hf_references(model, vismmoe_edge.load(q, device="cpu").encode, images)


@pytest.mark.parametrize("tier", ["host", "unified"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_glm4v_int4_matches_transformers(glm, budget: str, tier: str) -> None:
    q, refs = glm
    engine = vismmoe_edge.load(q, memory_budget=budget, pinned_layers=int(budget == "25%"), tier=tier, device="cpu")
    assert engine.catalogue.layout == "quantized" and engine.catalogue.moe_layers == list(range(1, GLM_LAYERS))
    assert_matches(engine, refs)
    if budget == "25%":
        assert engine.experts.pipeline.stats.evictions > 0


def picture(width: int, height: int, seed: int) -> Image.Image:
    img = Image.new("RGB", (width, height), (40 + 60 * seed, 120, 200 - 50 * seed))
    ImageDraw.Draw(img).rectangle((width // 4, height // 4, width // 2, height // 2), fill=(220, 30, 30))
    return img


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """DeepSeek-VL2-Small's structure (MLA); hidden 64, moe_intermediate 32: group 32 divides both."""
    from vismmoe_edge.testing.tiny_deepseek_vl2 import build_tiny_deepseek_vl2_checkpoint

    root = tmp_path_factory.mktemp("qds")
    src = build_tiny_deepseek_vl2_checkpoint(root / "src", "small", seed=3, num_layers=5)
    q = quantize_checkpoint(src, root / "int4", 4, 32, progress=False)
    return q, dequantize_checkpoint(q, root / "deq")


def transformers_language_model(model_dir: Path) -> DeepseekV2ForCausalLM:
    """transformers' model with the dequantized checkpoint's language weights (experts fused under its names)."""
    from vismmoe_edge.models.deepseek_vl2.config import read_config

    state = {}
    for shard in model_dir.glob("*.safetensors"):
        state |= load_file(str(shard))
    ours = {name.removeprefix("language."): t for name, t in state.items() if name.startswith("language.")}
    for layer in DS_MOE_LAYERS:
        p = f"model.layers.{layer}.mlp.experts"
        ours[f"{p}.gate_up_proj"] = torch.stack([
            torch.cat([ours.pop(f"{p}.{j}.gate_proj.weight"), ours.pop(f"{p}.{j}.up_proj.weight")])
            for j in range(DS_EXPERTS)
        ])  # fmt: skip
        ours[f"{p}.down_proj"] = torch.stack([ours.pop(f"{p}.{j}.down_proj.weight") for j in range(DS_EXPERTS)])
    model = DeepseekV2ForCausalLM._from_config(read_config(model_dir).text_config, experts_implementation="eager")
    missing, unexpected = model.eval().load_state_dict(ours, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


@pytest.mark.parametrize("tier", ["host", "unified"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_deepseek_vl2_int4_text_matches_transformers(deepseek, budget: str, tier: str) -> None:
    q, deq = deepseek
    reference = transformers_language_model(deq)
    engine = vismmoe_edge.load(q, memory_budget=budget, tier=tier, device="cpu")
    for prompt in ("Tell me a story about the sea.", "What is red and blue?"):
        inputs = engine.encode(prompt)
        with torch.no_grad():
            out = reference.generate(
                inputs.input_ids, attention_mask=torch.ones_like(inputs.input_ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
                eos_token_id=engine.eos_token_ids, pad_token_id=engine.eos_token_ids[0],
            )  # fmt: skip
        tokens = out.sequences[0, inputs.num_tokens :].tolist()
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert engine.generate_from_inputs(inputs, sampling).token_ids == tokens, prompt
        logits, state = engine.prefill(inputs)
        steps = [logits]
        for token in tokens[:-1]:
            steps.append(engine.decode_step(token, state))
        for step, (a, b) in enumerate(zip(steps, out.logits, strict=True)):
            assert (a.float() - b[0].float()).abs().max() <= LOGIT_ATOL, f"step {step}"
    if budget == "25%":
        assert engine.experts.pipeline.stats.evictions > 0


@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_deepseek_vl2_int4_with_images_matches_the_plain_reference(deepseek, budget: str) -> None:
    q, deq = deepseek
    reference = DeepseekVL2Reference(deq)
    engine = vismmoe_edge.load(q, memory_budget=budget, device="cpu")
    image_id = engine.model.config.image_token_id
    for prompt, images in (("What shape is red?", [picture(126, 42, 0)]),
                           ("Compare the two.", [picture(40, 120, 1), picture(90, 80, 2)])):  # fmt: skip
        inputs = engine.encode(prompt, images)
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        grid = inputs.image_grid_thw.tolist()
        expected = reference.generate(inputs.input_ids[0].tolist(), image_id, inputs.pixel_values, grid, NEW_TOKENS,
                                      engine.eos_token_ids)  # fmt: skip
        assert engine.generate_from_inputs(inputs, sampling).token_ids == expected, prompt
        logits, _ = engine.prefill(inputs)
        embeds = reference.w["language.model.embed_tokens.weight"][inputs.input_ids[0]]
        embeds[inputs.input_ids[0] == image_id] = reference.image_tokens(inputs.pixel_values, grid)
        assert (logits - reference.logits(embeds)).abs().max() <= LOGIT_ATOL, prompt


@pytest.fixture(scope="module")
def glm_dense(tmp_path_factory: pytest.TempPathFactory, images: list[Path]) -> tuple[Path, dict]:
    """GLM-4.5V with --dense-bits 4: attention, the dense layer's MLP, the shared experts and lm_head int4."""
    from vismmoe_edge.testing.tiny_glm4v import build_tiny_glm4v_checkpoint

    root = tmp_path_factory.mktemp("qglmd")
    src = build_tiny_glm4v_checkpoint(root / "src", seed=7, num_layers=3, moe_intermediate=96)
    q = quantize_checkpoint(src, root / "int4", 4, 32, progress=False, dense_bits=4)
    model = Glm4vMoeForConditionalGeneration.from_pretrained(
        dequantize_checkpoint(q, root / "deq"), experts_implementation="eager"
    ).eval()
    return q, hf_references(model, vismmoe_edge.load(q, device="cpu").encode, images)


def test_glm4v_dense_int4_matches_transformers(glm_dense) -> None:
    from vismmoe_edge.quant.dense import QuantizedLinear

    q, refs = glm_dense
    engine = vismmoe_edge.load(q, memory_budget="50%", pinned_layers=0, tier="host", device="cpu")
    layers = engine.language_model.layers
    assert isinstance(layers[0].mlp.gate_proj, QuantizedLinear) and layers[0].mlp.gate_proj.bits == 4  # dense layer
    assert isinstance(layers[1].mlp.shared_experts.up_proj, QuantizedLinear)
    assert not isinstance(layers[1].mlp.gate, QuantizedLinear)  # the router stays float
    assert_matches(engine, refs)


@pytest.fixture(scope="module")
def deepseek_dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from vismmoe_edge.testing.tiny_deepseek_vl2 import build_tiny_deepseek_vl2_checkpoint

    root = tmp_path_factory.mktemp("qdsd")
    src = build_tiny_deepseek_vl2_checkpoint(root / "src", "small", seed=3, num_layers=5)
    q = quantize_checkpoint(src, root / "int4", 4, 32, progress=False, dense_bits=4)
    return q, dequantize_checkpoint(q, root / "deq")


def test_deepseek_vl2_dense_int4_text_matches_transformers(deepseek_dense) -> None:
    """MLA projections, the dense layer's MLP, shared experts and lm_head int4; the embedding read by row."""
    from vismmoe_edge.quant.dense import QuantizedLinear, RowEmbedding

    engine = vismmoe_edge.load(deepseek_dense[0], device="cpu")
    assert isinstance(engine.language_model.layers[0].self_attn.kv_b_proj, QuantizedLinear)
    assert isinstance(engine.language_model.embed_tokens, RowEmbedding)
    test_deepseek_vl2_int4_text_matches_transformers(deepseek_dense, "25%", "host")
