"""Visual-token compression for DeepSeek-VL2: saliency per tile view from the SigLIP tower (checked against its
eager attention and mapped through the projector's padded 2x2 blocks and the tile layout by explicit loops),
newline / separator tokens always kept, identity at keep ratio 1.0, transformers' DeepseekV2 language model on the
kept embeddings at their original 1-D positions, and what the cut, decode and the predictor's features see."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache
from transformers.models.siglip import modeling_siglip as smod
from typer.testing import CliRunner

import vismmoe_edge
from tests.compress_checks import METHODS, check_cut, check_keep_ratio_one, forced_logits, sequence_keep
from tests.test_deepseek_vl2 import picture, transformers_language_model
from vismmoe_edge.compress import normalize01
from vismmoe_edge.compress.prune import CompressionConfig
from vismmoe_edge.compress.tile_saliency import TileSaliency, pool_to_tokens
from vismmoe_edge.models.deepseek_vl2.model import layout_index

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from reference.deepseek_vl2 import DeepseekVL2Reference  # noqa: E402

LAYERS = 5  # layer 0 dense, 1..4 MoE
TOKENS = [5, 17, 42]
IMAGES = [picture(40, 120, 1), picture(90, 80, 2)]  # 42 px tiles: 1 wide x 3 high, 2 x 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from vismmoe_edge.testing.tiny_deepseek_vl2 import build_tiny_deepseek_vl2_checkpoint

    root = tmp_path_factory.mktemp("dsc")
    return {v: build_tiny_deepseek_vl2_checkpoint(root / v, v, seed=3, num_layers=LAYERS) for v in ("tiny", "small")}


@pytest.fixture(scope="module")
def two_images(ckpts):
    return vismmoe_edge.load(ckpts["tiny"], device="cpu").encode("Compare the two.", IMAGES)


# ---- mapping patches to tokens, tokens to the prompt ----------------------------------------------------------
def reference_layout(th: int, tw: int, t: int, head: bool) -> list[int]:
    """The tile_tag 2D layout written out (as tools/reference/deepseek_vl2.py lays out features)."""
    glob = []
    for r in range(t):
        glob += [r * t + c for c in range(t)] + [-1]
    local = []
    for row in range(th * t):
        for col in range(tw * t):
            tile = 1 + (row // t) * tw + col // t
            local.append(tile * t * t + (row % t) * t + col % t)
        local.append(-1)
    return glob + [-1] + local if head else local + [-1] + glob


@pytest.mark.parametrize("head", [True, False])
def test_layout_index_matches_the_written_out_layout(head: bool) -> None:
    for th, tw in ((1, 1), (1, 3), (3, 1), (2, 2), (2, 3)):
        for t in (2, 14):
            assert layout_index(th, tw, t, head).tolist() == reference_layout(th, tw, t, head)


def reference_pool(scores: torch.Tensor, ratio: int) -> torch.Tensor:
    """Explicit loops: token (i, j) of a view is the mean of the real patches in rows/cols [ratio*i, ratio*i+r)."""
    views, hw = scores.shape
    side = int(hw**0.5)
    t = -(-side // ratio)
    out = torch.zeros(views, t * t, dtype=scores.dtype)
    for v in range(views):
        for i in range(t):
            for j in range(t):
                cells = [
                    scores[v, r * side + c]
                    for r in range(ratio * i, min(ratio * i + ratio, side))
                    for c in range(ratio * j, min(ratio * j + ratio, side))
                ]
                out[v, i * t + j] = sum(cells) / len(cells)
    return out


def test_pool_to_tokens_counts_only_real_patches() -> None:
    g = torch.Generator().manual_seed(0)
    for views, side in ((2, 3), (3, 27), (1, 4)):
        scores = torch.rand(views, side * side, generator=g, dtype=torch.float64)
        torch.testing.assert_close(pool_to_tokens(scores, 2), reference_pool(scores, 2))


def test_projected_token_is_its_padded_2x2_block(ckpts) -> None:
    """The real projector: changing one patch's feature changes exactly the token pool_to_tokens maps it to;
    and image_features places each view's projected tokens where layout_index says, newlines / separator between."""
    model = vismmoe_edge.load(ckpts["tiny"], device="cpu").model
    side, t = 3, 2
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, side * side, model.config.vision_config.hidden_size, generator=g)
    with torch.no_grad():
        base = model.projector(features)
        for patch in range(side * side):
            moved = features.clone()
            moved[0, patch] += 1.0
            changed = (model.projector(moved) - base).abs().amax(dim=-1)[0] > 0
            r, c = divmod(patch, side)
            assert changed.nonzero().flatten().tolist() == [(r // 2) * t + c // 2], patch
    inputs = vismmoe_edge.load(ckpts["tiny"], device="cpu").encode("Look.", IMAGES)
    grid = inputs.image_grid_thw
    with torch.no_grad():
        tokens = model.image_features(inputs.pixel_values, grid)
        projected = model.projector(model.vision(inputs.pixel_values).last_hidden_state)
    start, view = 0, 0
    for _, th, tw in grid.tolist():
        layout = layout_index(th, tw, t, True)
        views = projected[view : view + 1 + th * tw].reshape(-1, projected.shape[-1])
        for i, row in enumerate(layout.tolist()):
            want = views[row] if row >= 0 else None
            got = tokens[start + i]
            if want is None:
                assert torch.equal(got, model.image_newline) or torch.equal(got, model.view_seperator)
            else:
                assert torch.equal(got, want)
        start, view = start + len(layout), view + 1 + th * tw
    assert start == tokens.shape[0]


def test_saliency_matches_eager_attention_per_tile(ckpts, two_images, monkeypatch: pytest.MonkeyPatch) -> None:
    """TileSaliency (hooked, chunked) equals SigLIP's materialised eager softmax of the last layer, per tile view,
    averaged over heads and queries, pooled over each padded 2x2 block's real patches, laid out per image and
    min-max normalised: all by explicit loops here."""
    engine = vismmoe_edge.load(ckpts["tiny"], device="cpu")
    model, grid = engine.model, two_images.image_grid_thw
    with torch.no_grad(), engine.ops.saliency(model, grid) as sal:
        assert isinstance(sal, TileSaliency)
        sal.chunk = 4  # fewer than the 9 patches of a view
        plain = model.image_features(two_images.pixel_values, grid)
    got = sal.per_image()
    last, weights = model.vision.encoder.layers[-1].self_attn, []
    eager = smod.eager_attention_forward

    def capturing(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, w = eager(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        if module is last:
            weights.append(w.detach())  # [views, heads, n, n]
        return out, w

    monkeypatch.setattr(smod, "eager_attention_forward", capturing)
    monkeypatch.setattr(model.vision.config, "_attn_implementation_internal", "eager")
    with torch.no_grad():
        eager_tokens = model.image_features(two_images.pixel_values, grid)
    torch.testing.assert_close(eager_tokens, plain, atol=1e-5, rtol=1e-5)  # the capture changes nothing
    assert len(weights) == 1
    patch_scores = weights[0].double().mean(dim=(1, 2))  # [views, patches]
    token_scores = reference_pool(patch_scores, 2)  # [views, 4]
    view = 0
    droppable = engine.ops.droppable_tokens(model, grid)
    for image, (_, th, tw) in enumerate(grid.tolist()):
        views = token_scores[view : view + 1 + th * tw].reshape(-1)
        layout = reference_layout(th, tw, 2, True)
        want = normalize01(torch.tensor([float(views[row]) for row in layout if row >= 0], dtype=torch.float64))
        assert droppable[image].tolist() == [i for i, row in enumerate(layout) if row >= 0]
        assert got[image].min().item() == 0.0 and got[image].max().item() == 1.0
        torch.testing.assert_close(got[image].double(), want.double(), rtol=1e-5, atol=1e-5)
        view += 1 + th * tw


# ---- the engine --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pinned", [0, 1])
@pytest.mark.parametrize("method", METHODS)
def test_keep_ratio_one_is_no_compression(ckpts, two_images, method: str, pinned: int) -> None:
    engine = vismmoe_edge.load(ckpts["tiny"], memory_budget="100%", pinned_layers=pinned, device="cpu")
    check_keep_ratio_one(engine, two_images, method, TOKENS)


@pytest.mark.parametrize("method", ["random", "saliency", "zip", "affinity"])
def test_newlines_and_separator_are_always_kept(ckpts, two_images, method: str) -> None:
    engine = vismmoe_edge.load(ckpts["tiny"], pinned_layers=1, device="cpu")
    engine.compression = CompressionConfig(method=method, keep_ratio=0.3)
    engine.prefill(two_images)
    report, grid = engine.last_compression, two_images.image_grid_thw
    for kept, (_, th, tw) in zip(report.kept, grid.tolist(), strict=True):
        layout = layout_index(th, tw, 2, True)
        patches = int((layout >= 0).sum())
        assert set((layout < 0).nonzero().flatten().tolist()) <= set(kept.tolist())
        assert int((layout[kept] >= 0).sum()) == int(0.3 * patches)  # floor(beta * patch tokens)
        assert kept.tolist() == sorted(set(kept.tolist()))


def transformers_on_kept_tokens(model_dir: Path, inputs, keep: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """transformers' DeepseekV2ForCausalLM fed the kept embeddings (embedding table + the plain reference's image
    tokens) with their original 1-D positions as explicit position_ids; decode continues after the uncompressed
    numbering."""
    reference = DeepseekVL2Reference(model_dir)
    language = transformers_language_model(model_dir)
    ids = inputs.input_ids[0]
    embeds = reference.w["language.model.embed_tokens.weight"][ids].clone()
    visual = ids == json.loads((model_dir / "config.json").read_text())["image_token_id"]
    embeds[visual] = reference.image_tokens(inputs.pixel_values, inputs.image_grid_thw.tolist())
    positions = torch.arange(len(ids))
    cache = DynamicCache(config=language.config)
    with torch.no_grad():
        out = language(
            inputs_embeds=embeds[keep][None], position_ids=positions[keep][None],
            attention_mask=torch.ones(1, int(keep.sum()), dtype=torch.long), cache=cache, use_cache=True,
        )  # fmt: skip
        logits = [out.logits[0, -1].float()]
        for step, token in enumerate(tokens):
            out = language(
                input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[len(ids) + step]]),
                attention_mask=torch.ones(1, cache.get_seq_length() + 1, dtype=torch.long), cache=cache,
                use_cache=True,
            )  # fmt: skip
            logits.append(out.logits[0, -1].float())
    return logits


@pytest.mark.parametrize("method", ["random", "saliency", "affinity"])
def test_no_prefix_equals_transformers_on_kept_tokens(ckpts, two_images, method: str) -> None:
    """VL2-Small's structure (MLA), no pinned prefix: the cut happens before layer 0."""
    engine = vismmoe_edge.load(ckpts["small"], memory_budget="25%", pinned_layers=0, device="cpu")
    engine.compression = CompressionConfig(method=method, keep_ratio=0.5, seed=3)
    ours, state = forced_logits(engine, two_images, TOKENS)
    report = engine.last_compression
    assert 0 < report.kept_visual_tokens < report.visual_tokens
    keep = sequence_keep(engine, two_images)
    reference = transformers_on_kept_tokens(ckpts["small"], two_images, keep, TOKENS)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert all(layer.keys.shape[-2] == int(keep.sum()) + len(TOKENS) for layer in state.cache.layers)
    assert state.next_position == two_images.num_tokens + len(TOKENS)


@pytest.mark.parametrize(("variant", "method"), [("tiny", "affinity"), ("small", "zip")])
def test_cut_positions_cache_and_predictor_features(ckpts, two_images, variant: str, method: str) -> None:
    engine = vismmoe_edge.load(ckpts[variant], memory_budget="100%", pinned_layers=1, device="cpu")
    check_cut(engine, two_images, method, TOKENS)
    assert engine.last_compression.note == ""


def test_analyze_command(ckpts, tmp_path: Path) -> None:
    from vismmoe_edge.cli import app

    out = tmp_path / "an"
    result = CliRunner().invoke(
        app,
        ["analyze", "--model", str(ckpts["tiny"]), "--limit", "1", "--compressors", "none,affinity",
         "--keep-ratio", "0.5", "--memory-budget", "50%", "--pinned-layers", "1", "--tier", "host",
         "--device", "cpu", "--out", str(out), "--no-plots", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((out / "analysis.json").read_text())
    none, affinity = record["compressors"]
    assert none["kept_visual_tokens_mean"] == none["visual_tokens_mean"] > affinity["kept_visual_tokens_mean"] > 0
    assert len(affinity["unique_experts_per_layer"]) == LAYERS - 1
