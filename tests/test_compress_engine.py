"""Visual-token compression inside the engine: identity at keep ratio 1.0, transformers' own model on the kept
tokens as the reference when no prefix is pinned, and consistent cache lengths, positions and masks in decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, Qwen3VLMoeForConditionalGeneration

import vismmoe_edge
from vismmoe_edge.compress.prune import CompressionConfig, keep_mask
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor as load_processor
from vismmoe_edge.prompt import PromptInputs, encode_prompt, load_image

METHODS = ("random", "saliency", "zip", "affinity")
STEPS = 4


def forced_logits(engine, inputs: PromptInputs, tokens: list[int]) -> tuple[list[torch.Tensor], object]:
    logits, state = engine.prefill(inputs)
    out = [logits.float()]
    for token in tokens:
        out.append(engine.decode_step(token, state).float())
    return out, state


@pytest.fixture(scope="module")
def two_image_inputs(checkpoints: dict[str, Path], images: list[Path]) -> PromptInputs:
    processor = load_processor(checkpoints["v5"])
    return encode_prompt(processor, "Which image has more blue?", [load_image(p) for p in images])


@pytest.mark.parametrize("pinned", [0, 2])
@pytest.mark.parametrize("method", METHODS)
def test_keep_ratio_one_is_no_compression(checkpoints, two_image_inputs, method: str, pinned: int) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=pinned, device="cpu")
    tokens = [5, 17, 42, 9]
    plain, _ = forced_logits(engine, two_image_inputs, tokens)
    engine.compression = CompressionConfig(method=method, keep_ratio=1.0, salient_ratio=0.5)
    compressed, state = forced_logits(engine, two_image_inputs, tokens)
    report = engine.last_compression
    assert report is not None and report.kept_visual_tokens == report.visual_tokens > 0
    for a, b in zip(plain, compressed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert state.cache.get_seq_length() == two_image_inputs.num_tokens + len(tokens)


def hf_reference_on_kept_tokens(
    model: Qwen3VLMoeForConditionalGeneration, inputs: PromptInputs, kept: list[torch.Tensor], tokens: list[int]
) -> list[torch.Tensor]:
    """transformers' own modules, fed only the kept tokens (text + kept visual) at their original positions."""
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
        per_image = [int(t * h * w) // 4 for t, h, w in inputs.image_grid_thw.tolist()]
        keep = keep_mask(visual_mask[0], per_image, kept)
        kept_visual = keep[visual_mask[0]]
        cache = DynamicCache(config=m.language_model.config)
        out = m.language_model(
            inputs_embeds=embeds[:, keep],
            position_ids=positions[:, :, keep],
            visual_pos_masks=visual_mask[:, keep],
            deepstack_visual_embeds=[torch.cat(d)[kept_visual] if isinstance(d, (list, tuple)) else d[kept_visual]
                                     for d in vision.deepstack_features],
            cache=cache,
            use_cache=True,
        )  # fmt: skip
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
def test_no_prefix_equals_transformers_on_kept_tokens(checkpoints, two_image_inputs, method: str) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=0, device="cpu")
    engine.compression = CompressionConfig(method=method, keep_ratio=0.5, seed=3)
    tokens = [11, 23, 7, 64][:STEPS]
    ours, state = forced_logits(engine, two_image_inputs, tokens)
    report = engine.last_compression
    assert report.kept_visual_tokens < report.visual_tokens
    if method == "affinity":
        assert "saliency only" in report.note  # no prefix: the fallback is said, not hidden
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"], experts_implementation="eager")
    reference = hf_reference_on_kept_tokens(model.eval(), two_image_inputs, report.kept, tokens)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the cache holds exactly the kept prompt tokens plus the decoded ones, in every layer
    kept_prompt = two_image_inputs.num_tokens - report.visual_tokens + report.kept_visual_tokens
    assert all(layer.keys.shape[-2] == kept_prompt + len(tokens) for layer in state.cache.layers)


def test_prefix_layers_keep_all_tokens_until_the_cut(checkpoints, two_image_inputs) -> None:
    """With a pinned prefix of 2, the first two layers see every token; later layers only the kept ones; decode
    positions continue the uncompressed numbering."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=2, device="cpu")
    seen: dict[int, int] = {}
    engine.experts.route_hooks.append(lambda layer, hidden, idx, w: seen.setdefault(layer, hidden.shape[0]))
    engine.compression = CompressionConfig(method="affinity", keep_ratio=0.5, salient_ratio=0.2)
    _, state = engine.prefill(two_image_inputs)
    report = engine.last_compression
    full = two_image_inputs.num_tokens
    short = full - report.visual_tokens + report.kept_visual_tokens
    assert [seen[layer] for layer in sorted(seen)] == [full, full] + [short] * (len(seen) - 2)
    assert report.note == ""
    assert [layer.keys.shape[-2] for layer in state.cache.layers] == [short] * len(state.cache.layers)
    uncompressed_engine_state = vismmoe_edge.load(checkpoints["v5"], device="cpu").prefill(two_image_inputs)[1]
    assert state.next_position == uncompressed_engine_state.next_position
    # per image, each keeps floor(0.5 * N) tokens
    per_image = [int(t * h * w) // 4 for t, h, w in two_image_inputs.image_grid_thw.tolist()]
    assert [len(k) for k in report.kept] == [n // 2 for n in per_image]


def test_text_only_prompt_is_untouched(checkpoints) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], pinned_layers=1, device="cpu")
    inputs = engine.encode("Tell me about the sea.")
    plain = engine.prefill(inputs)[0]
    engine.compression = CompressionConfig(method="affinity", keep_ratio=0.5)
    torch.testing.assert_close(engine.prefill(inputs)[0], plain, atol=0, rtol=0)
    assert engine.last_compression is None
