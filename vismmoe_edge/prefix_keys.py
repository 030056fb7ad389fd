"""How the engine addresses a prompt in the prefix cache (prefix_cache.py): each image by its content, the prompt
as token ids with each image's placeholders replaced by its image's code, and vision features split per image."""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from vismmoe_edge.models.ops import VisualFeatures
from vismmoe_edge.prefix_cache import CachedVision, PrefixCache, image_code, image_key, pixels_key, processor_settings
from vismmoe_edge.prompt import PromptInputs


def has_video(config: Any, input_ids: torch.Tensor) -> bool:
    """Video placeholders are not addressed by content here: a prompt holding any never reuses or keeps KV
    (two clips of one size would otherwise compare equal)."""
    video = getattr(config, "video_token_id", None)
    return video is not None and bool((input_ids == video).any())


def pixel_keys(cache: PrefixCache, processor: Any, images: list[Image.Image]) -> list[str]:
    """Each image addressed by its decoded pixels and the processor's settings: hashing them costs a fraction of
    hashing the processor's float patches (prefix_cache.pixels_key)."""
    salt = cache.salt + processor_settings(processor)
    return [pixels_key(img, salt) for img in images]


def patch_keys(inputs: PromptInputs, salt: str) -> list[str]:
    """Each image's content address: its own rows of the processor's patches, its grid, the model's salt."""
    grid = inputs.image_grid_thw
    assert inputs.pixel_values is not None and grid is not None
    rows = [int(t * h * w) for t, h, w in grid.tolist()]
    patches = inputs.pixel_values.split(rows)
    return [image_key(p, g, salt) for p, g in zip(patches, grid, strict=True)]


def prompt_content(input_ids: torch.Tensor, image_token_id: int, keys: list[str], counts: list[int]) -> torch.Tensor:
    """The prompt as the prefix cache compares it: token ids, each image's placeholders (`counts` of them) its
    image's code."""
    content = input_ids[0].to("cpu", torch.long).clone()
    if keys:
        codes = [torch.full((n,), image_code(k), dtype=torch.long) for k, n in zip(keys, counts, strict=True)]
        codes = torch.cat(codes)
        placeholders = content == image_token_id
        if int(placeholders.sum()) == codes.numel():  # else prefill refuses the prompt with its own message
            content[placeholders] = codes
    return content


def cached_vision(cache: PrefixCache, keys: list[str]) -> VisualFeatures | None:
    """Every image's vision features from the cache, in prompt order, or None if one is missing."""
    found = cache.vision(keys)
    if found is None:
        return None
    layers = len(found[0].deepstack)
    deepstack = [torch.cat([f.deepstack[i] for f in found]) for i in range(layers)]
    return VisualFeatures(torch.cat([f.embeds for f in found]), deepstack)


def keep_vision(cache: PrefixCache, keys: list[str], visual: VisualFeatures, counts: list[int]) -> None:
    embeds = visual.embeds.split(counts)
    stacks = [features.split(counts) for features in visual.deepstack]
    for i, key in enumerate(keys):  # copies: an entry must not hold the whole request's tensor alive
        cache.put_vision(key, CachedVision(embeds[i].clone(), tuple(s[i].clone() for s in stacks)))
