"""Visual-token compression for GLM-4.5V: saliency from GLM's own vision tower (checked against its eager
attention and its patch order), identity at keep ratio 1.0, transformers' own modules on the kept tokens at their
original M-RoPE positions, and what the cut, decode and the predictor's features see."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import DynamicCache, Glm4vMoeForConditionalGeneration
from transformers.models.glm4v_moe import modeling_glm4v_moe as gmod
from transformers.vision_utils import get_vision_position_ids
from typer.testing import CliRunner

import vismmoe_edge
from tests.compress_checks import METHODS, check_cut, check_keep_ratio_one, forced_logits, sequence_keep
from vismmoe_edge.compress import VisionSaliency, merge_to_llm_tokens, normalize01
from vismmoe_edge.compress.prune import CompressionConfig
from vismmoe_edge.prompt import PromptInputs, encode_prompt, load_image

LAYERS = 4  # layer 0 dense, 1..3 MoE
TOKENS = [5, 17, 42]


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_glm4v import build_tiny_glm4v_checkpoint

    return build_tiny_glm4v_checkpoint(tmp_path_factory.mktemp("glmc") / "tiny", seed=7, num_layers=LAYERS)


@pytest.fixture(scope="module")
def hf_model(glm_dir: Path) -> Glm4vMoeForConditionalGeneration:
    return Glm4vMoeForConditionalGeneration.from_pretrained(glm_dir, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def two_images(glm_dir: Path, images: list[Path]) -> PromptInputs:
    from vismmoe_edge.models.glm4v_moe import load_glm4v_processor

    inputs = encode_prompt(load_glm4v_processor(glm_dir), "Which has more blue?", [load_image(p) for p in images])
    assert inputs.image_grid_thw[0].tolist() != inputs.image_grid_thw[1].tolist()
    return inputs


# ---- saliency ----------------------------------------------------------------------------------------------------
def test_patch_order_matches_the_tower_and_mrope(glm_dir: Path, hf_model) -> None:
    """GLM's processor orders patches block-major over 2x2 merge groups (what the tower's view(-1, 2, 2, C)
    downsample assumes and its rotary positions say), and LLM token m, made of patches [4m, 4m + 4), sits at the
    merged-grid cell its M-RoPE (h, w) positions name: so merge_to_llm_tokens is right for GLM."""
    from vismmoe_edge.models.glm4v_moe import load_glm4v_processor
    from vismmoe_edge.testing.tiny_glm4v import MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE

    processor = load_glm4v_processor(glm_dir)
    w, h = 112, 84  # multiples of 28 inside the pixel limits: no resampling, so colours survive exactly
    img = Image.new("RGB", (w, h))
    draw = ImageDraw.Draw(img)
    for r in range(h // PATCH_SIZE):
        for c in range(w // PATCH_SIZE):
            box = (c * PATCH_SIZE, r * PATCH_SIZE, (c + 1) * PATCH_SIZE - 1, (r + 1) * PATCH_SIZE - 1)
            draw.rectangle(box, fill=(r * 9, c * 9, 0))
    inputs = encode_prompt(processor, "Where?", [img])
    grid = inputs.image_grid_thw
    gh, gw, m = h // PATCH_SIZE, w // PATCH_SIZE, MERGE_SIZE
    assert grid.tolist() == [[1, gh, gw]]
    ip = processor.image_processor
    plane = TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE
    pix = inputs.pixel_values

    def channel(i: int) -> torch.Tensor:  # undo normalisation of the patch's first pixel in channel i
        return torch.round((pix[:, i * plane] * ip.image_std[i] + ip.image_mean[i]) * 255).long() // 9

    patches = list(zip(channel(0).tolist(), channel(1).tolist(), strict=True))
    expect = [
        (bh * m + mh, bw * m + mw)
        for bh in range(gh // m)
        for bw in range(gw // m)
        for mh in range(m)
        for mw in range(m)
    ]
    assert patches == expect
    assert get_vision_position_ids(grid, m).tolist() == [list(p) for p in expect]
    model = hf_model
    positions, _ = model.model.get_rope_index(
        inputs.input_ids, mm_token_type_ids=inputs.mm_token_type_ids, image_grid_thw=grid
    )
    image = (inputs.input_ids[0] == model.config.image_token_id).nonzero().flatten()
    t, rows, cols = (positions[i, 0, image] - positions[0, 0, image[0]] for i in range(3))
    assert (t == 0).all()
    for token in range(len(image)):
        block = {(r // m, c // m) for r, c in patches[token * m * m : (token + 1) * m * m]}
        assert block == {(int(rows[token]), int(cols[token]))}


def test_saliency_matches_eager_attention(hf_model, two_images, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooked saliency of GLM's vision tower equals the last block's materialised eager softmax, averaged
    over heads and queries, merged 2x2 and min-max normalised per image, for two images of different grids."""
    visual = hf_model.model.visual
    pixel_values, grid = two_images.pixel_values, two_images.image_grid_thw
    with torch.no_grad(), VisionSaliency(visual, chunk=16, rotary=gmod.apply_rotary_pos_emb_vision) as sal:
        plain = visual(pixel_values, grid_thw=grid)
    got = sal.per_image()
    last, weights = visual.blocks[-1].attn, []
    eager = gmod.eager_attention_forward

    def capturing(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, w = eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        if module is last:
            weights.append(w.detach())  # [1, heads, n, n], one call per image
        return out, w

    monkeypatch.setattr(gmod, "eager_attention_forward", capturing)
    monkeypatch.setattr(visual.config, "_attn_implementation_internal", "eager")
    with torch.no_grad():
        eager_out = visual(pixel_values, grid_thw=grid)
    assert len(weights) == len(grid) == 2
    torch.testing.assert_close(eager_out.pooler_output, plain.pooler_output, atol=1e-5, rtol=1e-5)
    m = visual.spatial_merge_size
    for g, w, (t, h, w_) in zip(got, weights, grid.tolist(), strict=True):
        want = normalize01(merge_to_llm_tokens(w[0].double().mean(dim=(0, 1)), (t, h, w_), m).float())
        assert g.shape == (t * h * w_ // m**2,) and g.min().item() == 0.0 and g.max().item() == 1.0
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5)


# ---- the engine --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pinned", [0, 1])
@pytest.mark.parametrize("method", METHODS)
def test_keep_ratio_one_is_no_compression(glm_dir, two_images, method: str, pinned: int) -> None:
    engine = vismmoe_edge.load(glm_dir, memory_budget="100%", pinned_layers=pinned, device="cpu")
    check_keep_ratio_one(engine, two_images, method, TOKENS)


def transformers_on_kept_tokens(
    model: Glm4vMoeForConditionalGeneration, inputs: PromptInputs, keep: torch.Tensor, tokens: list[int]
) -> list[torch.Tensor]:
    """transformers' own modules fed only the kept rows (text + kept visual) at their original M-RoPE positions."""
    m = model.model
    ids = inputs.input_ids
    with torch.no_grad():
        embeds = m.get_input_embeddings()(ids)
        vision = m.get_image_features(inputs.pixel_values, inputs.image_grid_thw)
        visual_mask = ids == model.config.image_token_id
        embeds = embeds.masked_scatter(visual_mask.unsqueeze(-1), torch.cat(vision.pooler_output))
        positions, _ = m.get_rope_index(
            ids, mm_token_type_ids=inputs.mm_token_type_ids, image_grid_thw=inputs.image_grid_thw
        )
        cache = DynamicCache(config=m.language_model.config)
        out = m.language_model(
            inputs_embeds=embeds[:, keep], position_ids=positions[:, :, keep], cache=cache, use_cache=True
        )
        logits = [model.lm_head(out.last_hidden_state[:, -1])[0].float()]
        next_position = int(positions.max()) + 1
        for token in tokens:
            out = m.language_model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.full((3, 1, 1), next_position),
                attention_mask=torch.ones(1, cache.get_seq_length() + 1, dtype=torch.long),
                cache=cache,
                use_cache=True,
            )
            logits.append(model.lm_head(out.last_hidden_state[:, -1])[0].float())
            next_position += 1
    return logits


@pytest.mark.parametrize("method", ["random", "saliency", "affinity"])
def test_no_prefix_equals_transformers_on_kept_tokens(glm_dir, hf_model, two_images, method: str) -> None:
    engine = vismmoe_edge.load(glm_dir, memory_budget="25%", pinned_layers=0, device="cpu")
    engine.compression = CompressionConfig(method=method, keep_ratio=0.5, seed=3)
    ours, state = forced_logits(engine, two_images, TOKENS)
    report = engine.last_compression
    assert 0 < report.kept_visual_tokens < report.visual_tokens
    keep = sequence_keep(engine, two_images)
    reference = transformers_on_kept_tokens(hf_model, two_images, keep, TOKENS)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    kept_prompt = int(keep.sum())
    assert all(layer.keys.shape[-2] == kept_prompt + len(TOKENS) for layer in state.cache.layers)


@pytest.mark.parametrize("method", ["affinity", "zip"])
def test_cut_positions_cache_and_predictor_features(glm_dir, two_images, method: str) -> None:
    engine = vismmoe_edge.load(glm_dir, memory_budget="100%", pinned_layers=1, device="cpu")
    check_cut(engine, two_images, method, TOKENS)
    assert engine.last_compression.note == ""
    per_image = engine.ops.visual_token_counts(engine.model, two_images.image_grid_thw)
    assert [len(k) for k in engine.last_compression.kept] == [n // 2 for n in per_image]


def test_analyze_command(glm_dir: Path, tmp_path: Path) -> None:
    from vismmoe_edge.cli import app

    out = tmp_path / "an"
    result = CliRunner().invoke(
        app,
        ["analyze", "--model", str(glm_dir), "--limit", "1", "--compressors", "none,affinity",
         "--keep-ratio", "0.5", "--memory-budget", "50%", "--pinned-layers", "1", "--tier", "host",
         "--device", "cpu", "--out", str(out), "--no-plots", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((out / "analysis.json").read_text())
    none, affinity = record["compressors"]
    assert none["kept_visual_tokens_mean"] == none["visual_tokens_mean"] > affinity["kept_visual_tokens_mean"] > 0
    assert len(affinity["unique_experts_per_layer"]) == LAYERS - 1
