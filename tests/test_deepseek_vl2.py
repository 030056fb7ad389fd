"""DeepSeek-VL2 through the engine, on tiny checkpoints in the original layout (one per released structure):
- the language model against transformers' own DeepseekV2ForCausalLM (same weights, converted names);
- the vision tower (timm names) and the whole model with images against tools/reference/deepseek_vl2.py, a
  plain implementation of the public definition (no cache, no pipeline);
- tiling against hand-computed layouts; `info`; one-line errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2ForCausalLM

import vismmoe_edge
from vismmoe_edge.compress.prune import CompressionConfig
from vismmoe_edge.config import parse_budget
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import OffloadedExperts
from vismmoe_edge.sampling import SamplingConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from reference.deepseek_vl2 import DeepseekVL2Reference  # noqa: E402

NEW_TOKENS = 6
LAYERS = 5  # layer 0 dense, 1..4 MoE
MOE_LAYERS = [1, 2, 3, 4]
HIDDEN, MOE_INTER, DENSE_INTER, EXPERTS = 64, 32, 128, 16
VARIANTS = ("tiny", "small", "base")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vismmoe_edge.testing.tiny_deepseek_vl2 import build_tiny_deepseek_vl2_checkpoint

    root = tmp_path_factory.mktemp("dsvl2")
    return {v: build_tiny_deepseek_vl2_checkpoint(root / v, v, seed=3, num_layers=LAYERS) for v in VARIANTS}


def picture(width: int, height: int, seed: int) -> Image.Image:
    img = Image.new("RGB", (width, height), (40 + 60 * seed, 120, 200 - 50 * seed))
    draw = ImageDraw.Draw(img)
    draw.ellipse((2, 2, width // 2, height // 2), fill=(220, 30, 30))
    draw.rectangle((width // 2, height // 2, width - 2, height - 2), fill=(20, 20, 220))
    return img


# tile 42 px: 126x42 -> 3 wide x 1 high; 40x120 -> 1 x 3; three images -> no local cropping (1 x 1 each)
PROMPTS = {
    "wide": ("What shape is red?", [picture(126, 42, 0)]),
    "tall_and_square": ("Compare the two.", [picture(40, 120, 1), picture(90, 80, 2)]),
    "three": ("Which is bluest?", [picture(126, 42, 0), picture(40, 120, 1), picture(90, 80, 2)]),
    "text": ("Tell me a story about the sea.", []),
}


def test_checkpoint_is_in_the_original_layout(ckpts) -> None:
    from vismmoe_edge.checkpoint import read_tensor_table
    from vismmoe_edge.models import deepseek_vl2

    raw = read_tensor_table(ckpts["base"])
    assert len({i.shard for i in raw.values()}) > 1
    for name in (
        "language.model.layers.1.mlp.experts.15.gate_proj.weight",
        "language.model.layers.1.mlp.shared_experts.up_proj.weight",
        "language.model.layers.0.mlp.gate_proj.weight",
        "language.model.layers.1.mlp.gate.e_score_correction_bias",
        "language.model.layers.1.self_attn.q_a_proj.weight",
        "language.lm_head.weight",
        "vision.blocks.1.attn.qkv.weight",
        "vision.pos_embed",
        "vision.attn_pool.latent",
        "projector.layers.2.weight",
        "image_newline",
        "view_seperator",
    ):
        assert name in raw, name
    assert raw["language.model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2 * MOE_INTER, HIDDEN)
    assert raw["vision.pos_embed"].shape == (1, 9, 32)
    assert "language.model.layers.1.self_attn.q_proj.weight" in read_tensor_table(ckpts["tiny"])
    config = deepseek_vl2.read_config(ckpts["base"])
    table = deepseek_vl2.select_tensors(config, raw)
    catalogue = deepseek_vl2.FAMILY.catalogue_for(config, table)
    assert catalogue.layout == "per_expert" and catalogue.moe_layers == MOE_LAYERS
    assert not any(n.startswith(("vision.blocks", "vision.attn_pool")) for n in table)
    q = table["vision.encoder.layers.1.self_attn.k_proj.weight"]
    assert q.shape == (32, 32) and q.offset == raw["vision.blocks.1.attn.qkv.weight"].offset + 32 * 32 * 4


# ---- language model vs transformers' DeepseekV2ForCausalLM ------------------------------------------------------
def transformers_language_model(model_dir: Path) -> DeepseekV2ForCausalLM:
    """transformers' own model with the checkpoint's language weights under transformers' names (fused experts)."""
    from vismmoe_edge.models.deepseek_vl2.config import read_config

    state = {}
    for shard in model_dir.glob("*.safetensors"):
        state |= load_file(str(shard))
    config = read_config(model_dir).text_config
    ours: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("language."):
            ours[name.removeprefix("language.")] = tensor
    for layer in MOE_LAYERS:
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat([ours.pop(f"{p}.{j}.gate_proj.weight"), ours.pop(f"{p}.{j}.up_proj.weight")])
            for j in range(EXPERTS)
        ]
        ours[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        ours[f"{p}.down_proj"] = torch.stack([ours.pop(f"{p}.{j}.down_proj.weight") for j in range(EXPERTS)])
    model = DeepseekV2ForCausalLM._from_config(config, experts_implementation="eager").eval()
    missing, unexpected = model.load_state_dict(ours, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    return model


@pytest.mark.parametrize("budget", ["100%", "25%"])
def test_language_model_matches_transformers(ckpts, budget: str) -> None:
    """VL2-Small's structure (MLA, greedy softmax routing): text-only, our offloaded engine and transformers'
    DeepseekV2ForCausalLM give the same greedy tokens and the same logits at every step."""
    model_dir = ckpts["small"]
    reference = transformers_language_model(model_dir)
    engine = vismmoe_edge.load(model_dir, memory_budget=budget, device="cpu")
    budget_bytes = parse_budget(budget, engine.catalogue.expert_bytes * len(engine.catalogue.experts))
    for prompt in ("Tell me a story about the sea.", "What is red and blue?"):
        inputs = engine.encode(prompt)
        with torch.no_grad():
            out = reference.generate(
                inputs.input_ids, attention_mask=torch.ones_like(inputs.input_ids), max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
                eos_token_id=engine.eos_token_ids, pad_token_id=engine.eos_token_ids[0],
            )  # fmt: skip
        tokens = out.sequences[0, inputs.num_tokens :].tolist()
        result = engine.generate_from_inputs(
            inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == tokens, prompt
        logits, state = engine.prefill(inputs)
        steps = [logits]
        for token in tokens[:-1]:
            steps.append(engine.decode_step(token, state))
        for step, (a, b) in enumerate(zip(steps, out.logits, strict=True)):
            assert torch.allclose(a.float(), b[0].float(), atol=1e-4, rtol=0), f"step {step}: {(a - b[0]).abs().max()}"
        assert engine.experts.pipeline.stats.peak_resident_bytes <= budget_bytes
        if budget == "25%":
            assert result.experts["misses"] > 0 and result.experts["evictions"] > 0


# ---- vision tower and whole model vs the plain reference ---------------------------------------------------------
def test_siglip_tower_from_timm_names_matches_reference(ckpts) -> None:
    """transformers' SiglipVisionModel, filled from the original timm names (qkv split in the tensor table), gives
    the features of the timm forward written out plainly from the same tensors."""
    engine = vismmoe_edge.load(ckpts["tiny"], device="cpu")
    reference = DeepseekVL2Reference(ckpts["tiny"])
    inputs = engine.encode("Look.", [picture(126, 42, 0), picture(40, 120, 1)])
    with torch.no_grad():
        ours = engine.model.vision(inputs.pixel_values).last_hidden_state
    theirs = reference.vision(inputs.pixel_values)
    assert ours.shape == theirs.shape == (1 + 3 + 1 + 3, 9, 32)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    with torch.no_grad():
        tokens = engine.model.image_features(inputs.pixel_values, inputs.image_grid_thw)
    expected = reference.image_tokens(inputs.pixel_values, inputs.image_grid_thw.tolist())
    assert torch.allclose(tokens, expected, atol=1e-5, rtol=0), (tokens - expected).abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_model_matches_plain_reference(ckpts, variant: str) -> None:
    """Images and text through the offloaded engine (40% budget, one pinned layer) against the plain
    full-recompute reference: identical greedy tokens, prefill logits within 1e-4, every MoE layer routed."""
    engine = vismmoe_edge.load(ckpts[variant], memory_budget="40%", pinned_layers=1, device="cpu")
    reference = DeepseekVL2Reference(ckpts[variant])
    seen: set[int] = set()
    engine.experts.route_hooks.append(lambda layer, hidden, index, weights: seen.add(layer))
    for name, (prompt, images) in PROMPTS.items():
        inputs = engine.encode(prompt, images)
        result = engine.generate_from_inputs(
            inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        grid = inputs.image_grid_thw.tolist() if images else []
        expected = reference.generate(
            inputs.input_ids[0].tolist(), engine.model.config.image_token_id, inputs.pixel_values, grid,
            NEW_TOKENS, engine.eos_token_ids,
        )  # fmt: skip
        assert result.token_ids == expected, f"{variant} {name}"
        logits, _ = engine.prefill(inputs)
        embeds = reference.w["language.model.embed_tokens.weight"][inputs.input_ids[0]]
        if images:
            embeds[inputs.input_ids[0] == engine.model.config.image_token_id] = reference.image_tokens(
                inputs.pixel_values, grid
            )
        assert torch.allclose(logits, reference.logits(embeds), atol=1e-4, rtol=0), f"{variant} {name}"
    assert sorted(seen) == MOE_LAYERS  # routing is recorded per MoE layer: traces and predictors see it
    assert result.experts["misses"] > 0
    layers = engine.model.model.language_model.layers
    assert all(isinstance(layers[i].mlp.experts, OffloadedExperts) for i in MOE_LAYERS)
    assert not hasattr(layers[0].mlp, "experts") and not any(p.is_meta for p in engine.model.parameters())


def test_predictor_and_unified_tier_keep_tokens(ckpts) -> None:
    engine = vismmoe_edge.load(ckpts["base"], memory_budget="25%", tier="unified", predictor="next-layer-gate")
    reference = vismmoe_edge.load(ckpts["base"], memory_budget="100%", device="cpu")
    for prompt, images in PROMPTS.values():
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert (
            engine.generate(prompt, images, sampling).token_ids
            == reference.generate(prompt, images, sampling).token_ids
        )
    assert engine.experts.pipeline.stats.speculative_bytes > 0


# ---- processor -----------------------------------------------------------------------------------------------
def test_tiling_matches_hand_computed_layouts() -> None:
    """VL2's 384 px tiles and its candidate list: which resolution, how many tiles, how many tokens."""
    from vismmoe_edge.models.deepseek_vl2.processor import DeepseekVL2Processor, select_best_resolution
    from vismmoe_edge.models.deepseek_vl2.variants import CANDIDATE_RESOLUTIONS
    from vismmoe_edge.testing.tiny_deepseek_vl2 import build_offline_deepseek_vl2_tokenizer

    processor = DeepseekVL2Processor(build_offline_deepseek_vl2_tokenizer(), CANDIDATE_RESOLUTIONS)
    assert processor.tokens_per_side == 14  # ceil(384 / 14 / 2) = ceil(27 / 2)
    # 640x480: 768x768 keeps all 307200 px (scale 1.2) and wastes the least of those that do -> 2x2 tiles
    assert select_best_resolution((640, 480), CANDIDATE_RESOLUTIONS) == (768, 768)
    # 1000x300: 1152x384 keeps all 300000 px (scale 1.152) with 142368 wasted -> 3 wide x 1 high
    assert select_best_resolution((1000, 300), CANDIDATE_RESOLUTIONS) == (1152, 384)
    assert select_best_resolution((200, 200), CANDIDATE_RESOLUTIONS) == (384, 384)
    image_id = processor.image_token_id
    out = processor(text=["<image>\nhi"], images=[Image.new("RGB", (640, 480), (255, 0, 0))])
    assert out["pixel_values"].shape == (1 + 4, 3, 384, 384) and out["image_grid_thw"].tolist() == [[1, 2, 2]]
    assert int((out["input_ids"] == image_id).sum()) == 14 * 15 + 1 + 28 * 29 == 1023
    assert out["input_ids"][0, 0] == processor.tokenizer.bos_token_id
    # the global view keeps the aspect: 384x288 centred, 48 rows of (127/255 - 0.5) / 0.5 padding above
    glob = out["pixel_values"][0]
    assert torch.allclose(glob[:, :48], torch.full_like(glob[:, :48], (127 / 255 - 0.5) / 0.5))
    assert torch.allclose(glob[0, 100:200], torch.ones_like(glob[0, 100:200]))  # red channel of the image
    wide = processor(text=["<image>"], images=[Image.new("RGB", (1000, 300))])
    assert wide["image_grid_thw"].tolist() == [[1, 1, 3]]
    assert int((wide["input_ids"] == image_id).sum()) == 14 * 15 + 1 + 14 * (3 * 14 + 1) == 813
    three = processor(text=["<image><image><image>"], images=[Image.new("RGB", (640, 480))] * 3)
    assert three["image_grid_thw"].tolist() == [[1, 1, 1]] * 3  # more than two images: no cropping
    assert three["pixel_values"].shape[0] == 6 and int((three["input_ids"] == image_id).sum()) == 3 * 421


def test_chat_format_is_deepseeks(ckpts) -> None:
    from vismmoe_edge.models.deepseek_vl2.processor import load_deepseek_vl2_processor

    processor = load_deepseek_vl2_processor(ckpts["tiny"])
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A ball."},
        {"role": "user", "content": "And the colour?"},
    ]
    text = processor.apply_chat_template(messages)
    assert text == (
        "<|User|>: <image>\nWhat is it?\n\n<|Assistant|>:A ball.<｜end▁of▁sentence｜>"
        "<|User|>: And the colour?\n\n<|Assistant|>:"
    )
    engine = vismmoe_edge.load(ckpts["tiny"], device="cpu")
    assert engine.eos_token_ids == [processor.tokenizer.convert_tokens_to_ids("<｜end▁of▁sentence｜>")] == [1]
    inputs = engine.encode_messages(messages, [picture(90, 80, 0)])
    assert inputs.input_ids[0, 0] == 0 and inputs.image_grid_thw.tolist() == [[1, 2, 2]]
    assert int(inputs.mm_token_type_ids.sum()) == 2 * 3 + 1 + 4 * 5


# ---- info, errors ------------------------------------------------------------------------------------------
def test_info_reports_shared_experts_in_the_resident_region(ckpts) -> None:
    from vismmoe_edge.planning.describe import describe_checkpoint, format_description

    d = describe_checkpoint(ckpts["small"], "25%")
    assert d["architecture"] == "DeepseekVLV2ForCausalLM" and d["expert_layout"] == "per_expert"
    assert (d["layers"], d["moe_layers"], d["experts_per_layer"], d["top_k"]) == (LAYERS, 4, EXPERTS, 4)
    assert d["shared_experts"] == 2
    assert d["shared_expert_bytes"] == len(MOE_LAYERS) * 3 * HIDDEN * 2 * MOE_INTER * 4  # two experts, fused
    assert (d["dense_mlp_bytes"], d["dense_mlp_layers"]) == (3 * HIDDEN * DENSE_INTER * 4, 1)
    assert d["total_expert_bytes"] == len(MOE_LAYERS) * EXPERTS * 3 * HIDDEN * MOE_INTER * 4
    assert d["resident_bytes"] > d["shared_expert_bytes"] + d["dense_mlp_bytes"]
    text = format_description(d)
    assert "2 shared" in text and "shared experts" in text and "(1 dense layers)" in text


@pytest.mark.parametrize("variant", VARIANTS)
def test_released_configs_are_accepted(tmp_path: Path, variant: str) -> None:
    from vismmoe_edge.models.deepseek_vl2.config import read_config
    from vismmoe_edge.models.deepseek_vl2.variants import variant_config

    (tmp_path / "config.json").write_text(json.dumps(variant_config(variant) | {"image_token_id": 128815}))
    config = read_config(tmp_path)
    assert (config.use_mla, config.topk_method) == {
        "tiny": (False, "greedy"), "small": (True, "greedy"), "base": (True, "noaux_tc")
    }[variant]  # fmt: skip
    assert config.tokens_per_side == 14 and len(config.candidate_resolutions) == 23
    assert config.vision_config.intermediate_size == 4304 and config.text_config.n_shared_experts == 2


def write_config(directory: Path, source: Path, **changes) -> Path:
    shutil.copytree(source, directory)
    raw = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("language_"):
            raw["language_config"][key.removeprefix("language_")] = value
        else:
            raw[key] = value
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tile_tag": "1D"}, "tile_tag '1D' is not supported"),
        ({"language_topk_method": "noaux_tc", "language_scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"language_rope_scaling": {"type": "yarn", "factor": 4}}, "rope_scaling"),
        ({"architectures": ["DeepseekOCRForCausalLM"]}, "DeepseekOCRForCausalLM is not supported"),
        ({"language_n_routed_experts": 8}, "config.json implies [8, 64]"),
    ],
)
def test_unsupported_configs_fail_in_one_line(ckpts, tmp_path: Path, changes: dict, message: str) -> None:
    model_dir = write_config(tmp_path / "m", ckpts["tiny"], **changes)
    with pytest.raises(VismmoeError) as e:
        vismmoe_edge.load(model_dir, device="cpu")
    assert "\n" not in str(e.value)
    assert any(part in str(e.value) for part in message.split("|")), str(e.value)


def test_missing_and_misshapen_tensors_fail_in_one_line(ckpts, tmp_path: Path) -> None:
    for drop, message in (
        ("vision.blocks.0.attn.qkv.weight", "missing tensor vision.encoder.layers.0.self_attn"),
        ("language.model.layers.2.mlp.experts.3.up_proj.weight", "missing tensor mlp.experts.3.up_proj.weight"),
        ("language.model.layers.1.mlp.shared_experts.down_proj.weight", "missing tensor language.model.layers.1"),
    ):
        model_dir = Path(shutil.copytree(ckpts["tiny"], tmp_path / drop))
        index_path = model_dir / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        shard = model_dir / index["weight_map"].pop(drop)
        state = load_file(str(shard))
        del state[drop]
        save_file(state, str(shard), metadata={"format": "pt"})
        index_path.write_text(json.dumps(index))
        with pytest.raises(VismmoeError, match=message) as e:
            vismmoe_edge.load(model_dir, device="cpu")
        assert "\n" not in str(e.value)
    model_dir = write_config(tmp_path / "shape", ckpts["tiny"], language_intermediate_size=96)
    with pytest.raises(VismmoeError, match=r"layers.0.mlp.(gate|up|down)_proj.weight has shape .*config.json implies"):
        vismmoe_edge.load(model_dir, device="cpu")


def test_bad_images_fail_in_one_line(ckpts, tmp_path: Path) -> None:
    engine = vismmoe_edge.load(ckpts["tiny"], device="cpu")
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    with pytest.raises(VismmoeError, match="not an image PIL can read"):
        engine.encode("What?", [bad])
    with pytest.raises(VismmoeError, match="expected a PIL image"):
        engine.processor(text=["<image>"], images=["not an image"])
    with pytest.raises(VismmoeError, match="1 <image> tokens but 2 images"):
        engine.processor(text=["<image>"], images=[picture(40, 40, 0)] * 2)
    engine.compression = CompressionConfig("random", keep_ratio=1.0)  # supported: test_compress_deepseek_vl2.py
