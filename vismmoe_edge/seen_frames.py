"""A frame the daemon has seen: its next question is built without decoding or processing the image again.

A robot asks several questions of one camera frame, and sends the same encoded bytes each time. Once a request
has been prefilled, its image's vision features are in the prefix cache (prefix_cache.py) under the key of its
decoded pixels. Here the *encoded* bytes are remembered too, with that key and the image's grid. A later request
with the same bytes, while the features are still cached, skips the PNG/JPEG decode, the processor's resize and
normalisation and the pixel hash (together most of what a warm request still cost: docs/benchmarks.md, "One
frame, many questions"): its prompt is the chat template's text with each image placeholder expanded to the
image's visual-token count, as the processor expands it, then tokenized.

Only for families whose processor does nothing else with an image's tokens (`ops.expands_image_placeholders`:
Qwen3-VL-MoE; tests/test_seen_frames.py checks the ids against the processor's), without video, and without a
compressor that needs the vision tower's attention.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from vismmoe_edge.models.ops import VisualFeatures
from vismmoe_edge.prefix_cache import processor_settings
from vismmoe_edge.prefix_keys import cached_vision
from vismmoe_edge.prompt import PromptInputs, count_parts


def frame_keys(engine: Any, datas: list[bytes]) -> list[str]:
    """The address of each image as received: its encoded bytes, the processor's settings and the model's salt.
    Computed once per request: `encode_seen` looks them up, `remember` stores them after a miss."""
    settings = (engine.prefix_cache.salt + processor_settings(engine.processor)).encode()
    keys = []
    for data in datas:
        h = hashlib.blake2b(settings, digest_size=16)
        h.update(data)
        keys.append(h.hexdigest())
    return keys


def applies(engine: Any, messages: list[dict[str, Any]], num_images: int, num_videos: int) -> bool:
    return (
        engine.prefix_cache is not None
        and engine.ops.expands_image_placeholders
        and num_images > 0
        and num_videos == 0
        and count_parts(messages, "video") == 0
        and not engine.compression.needs_saliency
    )


def encode_seen(engine: Any, messages: list[dict[str, Any]], frames: list[str]) -> PromptInputs | None:
    """The prompt for `messages` whose images are `frames` (`frame_keys`, in order), or None unless every image
    was seen and its vision features are still cached: the caller then decodes and processes as usual. The
    features are taken now and travel with the inputs, so an eviction before the prefill cannot lose them."""
    cache, processor = engine.prefix_cache, engine.processor
    seen = [cache.frame(frame) for frame in frames]
    if any(s is None for s in seen) or count_parts(messages, "image") != len(frames):
        return None
    keys = [s[0] for s in seen]  # type: ignore[index]
    grid = torch.tensor([s[1] for s in seen], dtype=torch.long)  # type: ignore[index]
    visual: VisualFeatures | None = cached_vision(cache, keys)
    if visual is None:
        return None
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if text.count(processor.image_token) != len(frames):
        return None  # a template that writes the placeholder other than once per image part
    merge = processor.image_processor.merge_size
    counts = [int(t * h * w) // merge**2 for t, h, w in grid.tolist()]
    input_ids = expand_placeholders(processor.tokenizer([text])["input_ids"][0], engine.model.config.image_token_id,
                                    counts)  # fmt: skip
    if input_ids is None:
        return None
    mm_types = torch.as_tensor(processor.create_mm_token_type_ids(input_ids.tolist()), dtype=torch.long)
    cache.count_seen_frames(len(keys))
    return PromptInputs(input_ids, None, grid, mm_types, image_keys=keys, vision=visual)


def expand_placeholders(ids: list[int], image_id: int, counts: list[int]) -> torch.Tensor | None:
    """The ids of a prompt tokenized with one placeholder an image, each placeholder repeated as many times as
    its image has visual tokens -> [1, N]; None unless there is one placeholder an image. The processor expands
    the text and tokenizes that instead, with the same ids: the placeholder is an added token, at which the
    tokenizer splits its input before anything else. Tokenizing ~1,100 placeholders cost ~2 ms a question."""
    at = [i for i, t in enumerate(ids) if t == image_id]
    if len(at) != len(counts):
        return None
    expanded: list[int] = []
    start = 0
    for i, n in zip(at, counts, strict=True):
        expanded += ids[start:i] + [image_id] * n
        start = i + 1
    return torch.tensor([expanded + ids[start:]], dtype=torch.long)


def remember(engine: Any, frames: list[str], inputs: PromptInputs) -> None:
    """After a request was encoded the usual way: its images' `frame_keys` stand for their pixel keys and grids."""
    if inputs.image_keys is None or inputs.image_grid_thw is None or len(inputs.image_keys) != len(frames):
        return
    for frame, key, grid in zip(frames, inputs.image_keys, inputs.image_grid_thw.tolist(), strict=True):
        engine.prefix_cache.remember_frame(frame, key, tuple(grid))
