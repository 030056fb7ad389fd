"""A frame seen before (seen_frames.py): its next question is built from its encoded bytes without decoding or
processing it, and gives the processor's token ids and transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_reference import NEW_TOKENS
from vismmoe_edge.prefix_cache import PrefixCache
from vismmoe_edge.prompt import PromptInputs, build_messages, load_image
from vismmoe_edge.sampling import SamplingConfig
from vismmoe_edge.seen_frames import applies, encode_seen, frame_keys, remember


def greedy() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)


def test_a_seen_pair_of_images_gives_the_processors_ids_and_transformers_tokens(
    checkpoints: dict[str, Path], images: list[Path], references: dict
) -> None:
    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget="100%", device="cpu")
    engine.prefix_cache = cache = PrefixCache(64 << 20, salt="test")
    pil = [load_image(p) for p in images[:2]]  # two sizes: two grids
    datas = [p.read_bytes() for p in images[:2]]
    first = build_messages("Describe both images.", 2)
    question = references["two_images"].inputs
    second = build_messages("Which image has more blue?", 2)  # tests/hf_reference.py's "two_images" prompt
    assert applies(engine, second, 2, 0)

    def lookup(messages: list[dict], images: list[bytes]) -> PromptInputs | None:
        return encode_seen(engine, messages, frame_keys(engine, images))

    assert lookup(first, datas) is None  # never seen
    inputs = engine.encode_messages(first, pil)
    remember(engine, frame_keys(engine, datas), inputs)
    assert lookup(second, datas) is None  # remembered, but no vision features cached yet
    engine.generate_from_inputs(inputs, greedy())  # its prefill keeps both images' features

    seen = lookup(second, datas)
    full = engine.encode_messages(second, pil)
    assert seen is not None and seen.pixel_values is None and seen.vision is not None
    assert torch.equal(seen.input_ids, full.input_ids) and torch.equal(seen.input_ids, question.input_ids)
    assert torch.equal(seen.mm_token_type_ids, full.mm_token_type_ids)
    assert torch.equal(seen.image_grid_thw, full.image_grid_thw) and seen.image_keys == full.image_keys
    result = engine.generate_from_inputs(seen, greedy())
    assert result.token_ids == references["two_images"].tokens
    assert result.timings.vision_cached_images == 2 and result.timings.prefix_reused_tokens > 0
    assert cache.stats().frame_hits == 2

    assert lookup(second, datas[::-1]) is not None  # each image by its own bytes, in prompt order
    assert lookup(second, [datas[0], datas[0] + b"\0"]) is None  # other bytes: decoded as usual
    assert lookup(build_messages("Hi", 1), datas) is None  # parts and images disagree
    cache.clear()
    assert lookup(second, datas) is None  # the features are gone


def test_only_where_the_prompt_can_be_rebuilt(checkpoints: dict[str, Path]) -> None:
    from vismmoe_edge.compress.config import CompressionConfig
    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget="100%", device="cpu")
    one = build_messages("What shape is red?", 1)
    assert not applies(engine, one, 1, 0)  # no prefix cache
    engine.prefix_cache = PrefixCache(1 << 20, salt="test")
    assert applies(engine, one, 1, 0)
    assert not applies(engine, build_messages("What happens?", 0, 1), 0, 1)  # a clip
    assert not applies(engine, build_messages("Hello", 0), 0, 0)  # no image
    engine.compression = CompressionConfig("saliency", keep_ratio=0.5)  # reads the vision tower's attention
    assert not applies(engine, one, 1, 0)
