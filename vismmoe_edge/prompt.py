"""Turn a text prompt, image files and video clips into model inputs through the checkpoint's own processor and
chat template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from vismmoe_edge.errors import VismmoeError

MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # refuse decompression bombs before the processor resizes them


@dataclass
class PromptInputs:
    """What the engine consumes: token ids, and for images and videos the patches and their grids (batch of one)."""

    input_ids: torch.Tensor  # [1, N]
    pixel_values: torch.Tensor | None = None  # [patches, C*T*P*P]
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    mm_token_type_ids: torch.Tensor | None = None  # [1, N]
    pixel_values_videos: torch.Tensor | None = None  # [patches, C*T*P*P], every clip's
    video_grid_thw: torch.Tensor | None = None  # [videos, 3]
    image_keys: list[str] | None = None  # each image's prefix-cache address, when the engine computed it
    vision: Any = None  # the images' cached VisualFeatures when no pixels were processed (seen_frames.py)

    @property
    def has_images(self) -> bool:
        return self.pixel_values is not None or self.vision is not None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def load_image(path: str | Path) -> Image.Image:
    """Open an image file fully now, so that a bad file fails here with its name and not inside the processor."""
    path = Path(path)
    if not path.exists():
        raise VismmoeError(f"{path}: image file not found")
    if path.is_dir():
        raise VismmoeError(f"{path}: is a directory, not an image file")
    try:
        with Image.open(path) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise VismmoeError(f"{path}: image is {img.width}x{img.height}, larger than {MAX_IMAGE_PIXELS} pixels")
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError as e:
        raise VismmoeError(f"{path}: not an image PIL can read (PNG, JPEG, WebP, ...)") from e
    except (OSError, Image.DecompressionBombError, ValueError) as e:
        raise VismmoeError(f"{path}: cannot read image ({e})") from e


def build_messages(prompt: str, num_images: int, num_videos: int = 0) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    content += [{"type": "video"} for _ in range(num_videos)]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}]


def encode_prompt(processor: Any, prompt: str, images: list[Image.Image], videos: list[Any] = ()) -> PromptInputs:
    if not prompt.strip():
        raise VismmoeError("the prompt is empty; pass --prompt TEXT")
    return encode_messages(processor, build_messages(prompt, len(images), len(videos)), images, videos)


def count_parts(messages: list[dict[str, Any]], kind: str) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == kind
    )


def encode_messages(
    processor: Any, messages: list[dict[str, Any]], images: list[Image.Image], videos: list[Any] = ()
) -> PromptInputs:
    """A whole conversation (transformers' content-list format, `{"type": "image"}` where each image goes and
    `{"type": "video"}` where each clip goes, in the order of `images` and `videos`: video.Clip, which imports this
    module) through the checkpoint's chat template, ready for the assistant's reply."""
    for kind, given in (("image", len(images)), ("video", len(videos))):
        if count_parts(messages, kind) != given:
            raise VismmoeError(f"the messages hold {count_parts(messages, kind)} {kind} parts but {given} were given")
    if videos and getattr(processor, "video_processor", None) is None:
        raise VismmoeError("this model family takes no video input (Qwen3-VL-MoE does)")
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    extra: dict[str, Any] = {}
    if videos:  # the frames are already sampled (video.py); their metadata gives the prompt's timestamps
        extra["videos"] = [clip.frames for clip in videos]
        extra["videos_kwargs"] = {"video_metadata": [c.metadata() for c in videos], "do_sample_frames": False}
    encoded = processor(text=[text], images=images or None, return_tensors="pt", **extra)
    return PromptInputs(
        input_ids=encoded["input_ids"],
        pixel_values=encoded.get("pixel_values"),
        image_grid_thw=encoded.get("image_grid_thw"),
        mm_token_type_ids=encoded.get("mm_token_type_ids"),
        pixel_values_videos=encoded.get("pixel_values_videos"),
        video_grid_thw=encoded.get("video_grid_thw"),
    )
