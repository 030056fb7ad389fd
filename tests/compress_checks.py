"""Family-independent checks of visual-token compression through the engine (used by test_compress_glm4v.py and
test_compress_deepseek_vl2.py): identity at keep ratio 1.0, and what the layers after the cut, the decode steps
and the predictor's features see."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vismmoe_edge.compress.prune import CompressionConfig, keep_mask
from vismmoe_edge.prompt import PromptInputs

METHODS = ("random", "saliency", "zip", "affinity")


def forced_logits(engine, inputs: PromptInputs, tokens: list[int]) -> tuple[list[torch.Tensor], object]:
    logits, state = engine.prefill(inputs)
    out = [logits.float()]
    for token in tokens:
        out.append(engine.decode_step(token, state).float())
    return out, state


def check_keep_ratio_one(engine, inputs: PromptInputs, method: str, tokens: list[int]) -> None:
    """Keep ratio 1.0 keeps every visual token, so prefill and decode equal no compression."""
    engine.compression = CompressionConfig()
    plain, _ = forced_logits(engine, inputs, tokens)
    engine.compression = CompressionConfig(method=method, keep_ratio=1.0, salient_ratio=0.5)
    compressed, state = forced_logits(engine, inputs, tokens)
    report = engine.last_compression
    assert report is not None and report.kept_visual_tokens == report.visual_tokens > 0
    for a, b in zip(plain, compressed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert state.cache.get_seq_length() == inputs.num_tokens + len(tokens)


def full_positions(engine, inputs: PromptInputs) -> torch.Tensor:
    """The uncompressed prompt's positions [3, 1, S], from the family's own ops."""
    return engine.ops.rope_positions(engine.model, inputs.input_ids, inputs.mm_token_type_ids, inputs.image_grid_thw)


def sequence_keep(engine, inputs: PromptInputs) -> torch.Tensor:
    """[S] bool: the prompt rows the last compressed prefill kept."""
    visual = inputs.input_ids[0] == engine.model.config.image_token_id
    per_image = engine.ops.visual_token_counts(engine.model, inputs.image_grid_thw)
    return keep_mask(visual, per_image, engine.last_compression.kept)


@dataclass
class Probe:
    """What each decoder layer and MoE router saw during one compressed prefill and its decode steps."""

    rows: dict[int, int] = field(default_factory=dict)  # MoE layer -> routed rows in the prefill
    interest: dict[int, torch.Tensor | None] = field(default_factory=dict)  # engine.interest_rows at that layer
    summary: dict[int, torch.Tensor | None] = field(default_factory=dict)  # engine.visual_summary at that layer
    rotary: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # position embeddings of the cut layer


def probe_run(engine, inputs: PromptInputs, cut: int, tokens: list[int]) -> tuple[Probe, object]:
    probe = Probe()
    prefill = [True]

    def on_route(layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
        if prefill[0]:
            probe.rows[layer] = hidden.shape[0]
            rows = engine.interest_rows
            probe.interest[layer] = None if rows is None else rows.clone()
            summary = engine.visual_summary
            probe.summary[layer] = None if summary is None else summary.clone()

    def on_layer(module, args, kwargs) -> None:
        embeddings = kwargs["position_embeddings"]
        probe.rotary.append(embeddings if isinstance(embeddings, tuple) else (embeddings,))

    engine.experts.route_hooks.append(on_route)
    handle = engine.language_model.layers[cut].register_forward_pre_hook(on_layer, with_kwargs=True)
    try:
        _, state = engine.prefill(inputs)
        prefill[0] = False
        for token in tokens:
            engine.decode_step(token, state)
    finally:
        handle.remove()
        engine.experts.route_hooks.remove(on_route)
    return probe, state


def check_cut(engine, inputs: PromptInputs, method: str, tokens: list[int]) -> None:
    """With a pinned prefix: the prefix routes every token and later layers only the kept ones; the layer after
    the cut gets the kept tokens' original position embeddings; every layer's cache holds the kept prompt plus
    the decoded tokens; decode positions continue the uncompressed numbering; the predictor's tokens of interest
    and visual summary follow the kept visual tokens."""
    cut = engine._cut_layer()
    assert cut > 0
    engine.compression = CompressionConfig()
    _, plain_state = engine.prefill(inputs)
    engine.compression = CompressionConfig(method=method, keep_ratio=0.5, salient_ratio=0.3, seed=5)
    probe, state = probe_run(engine, inputs, cut, tokens)
    report = engine.last_compression
    keep = sequence_keep(engine, inputs)
    full, short = inputs.num_tokens, int(keep.sum())
    assert report.kept_visual_tokens < report.visual_tokens and short == full - report.visual_tokens + (
        report.kept_visual_tokens
    )
    moe = engine.catalogue.moe_layers
    assert [probe.rows[layer] for layer in moe] == [full if layer < cut else short for layer in moe]
    # positions: the cut layer's embeddings are the full prompt's, at the kept rows; decode continues after it
    lm = engine.language_model
    positions = full_positions(engine, inputs)
    dummy = torch.zeros(1, full, engine.text_config.hidden_size, dtype=engine.dtype)
    whole = engine.ops.rotary(lm, dummy, positions)
    whole = whole if isinstance(whole, tuple) else (whole,)
    index = keep.nonzero().flatten()
    for got, want in zip(probe.rotary[0], whole, strict=True):
        torch.testing.assert_close(got, want.index_select(1, index), atol=1e-6, rtol=0)
    assert plain_state.next_position == int(positions.max()) + 1
    assert state.next_position == plain_state.next_position + len(tokens)
    for step, token_embeddings in enumerate(probe.rotary[1:]):
        at = torch.full((3, 1, 1), plain_state.next_position + step)
        want = engine.ops.rotary(lm, dummy[:, :1], at)
        for got, w in zip(token_embeddings, want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(got, w, atol=0, rtol=0)
    assert [layer.keys.shape[-2] for layer in state.cache.layers] == [short + len(tokens)] * len(state.cache.layers)
    # the predictor's features: visual rows of the sequence in flight, mean of the kept visual embeddings
    visual = inputs.input_ids[0] == engine.model.config.image_token_id
    with torch.no_grad():
        embeds = engine.ops.image_features(engine.model, inputs.pixel_values, inputs.image_grid_thw).embeds.float()
    kept_visual = keep[visual]
    for layer in moe:
        before = layer < cut
        assert torch.equal(probe.interest[layer], visual if before else visual[keep]), layer
        assert int(probe.interest[layer].sum()) == (report.visual_tokens if before else report.kept_visual_tokens)
        want = embeds.mean(dim=0) if before else embeds[kept_visual].mean(dim=0)
        torch.testing.assert_close(probe.summary[layer], want, atol=1e-5, rtol=1e-5)
