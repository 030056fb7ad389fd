"""DeepSeek-VL2's processor, offline: dynamic tiling, normalisation, the `<image>` token layout and the chat format.

What deepseek_vl2/models/processing_deepseek_vl_v2.py does, without torchvision:
- each image gives a global view (padded, aspect kept, to one tile) and local tiles: the image padded to the
  candidate resolution `select_best_resolution` picks, cut row by row into tiles; with more than two images in
  the prompt the candidate is a single tile (no cropping), as the original;
- pixels are (x / 255 - mean) / std, mean = std = 0.5 (ToTensor + Normalize);
- each image takes h*(w+1) global tokens, 1 separator, (th*h)*(tw*w+1) local tokens, h = w =
  ceil(tile / patch / downsample) (14 for 384 / 14 / 2);
- the "deepseek" conversation: [BOS] "<|User|>: {content}\n\n<|Assistant|>:" per user turn, "{reply}<eos>" per
  assistant turn, a system message as plain text first.
Outputs use the engine's PromptInputs fields: pixel_values [tiles, 3, S, S], image_grid_thw [images, 3] as
(1, height tiles, width tiles), mm_token_type_ids 1 on image tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from vismmoe_edge.errors import VismmoeError

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE_TOKEN = "<image>"
USER, ASSISTANT = "<|User|>", "<|Assistant|>"
# BOS/EOS first, so that they get ids 0 and 1 as in DeepSeek's tokenizer; then what the processor adds.
SPECIAL_TOKENS = [
    BOS,
    EOS,
    PAD,
    IMAGE_TOKEN,
    "<|ref|>",
    "<|/ref|>",
    "<|det|>",
    "<|/det|>",
    "<|grounding|>",
    USER,
    ASSISTANT,
]
PROCESSOR_FILE = "processor_config.json"


def select_best_resolution(image_size: tuple[int, int], candidates: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (width, height) keeping most of the image's pixels once scaled to fit, then wasting the fewest."""
    width, height = image_size
    best, best_effective, best_wasted = candidates[0], 0, math.inf
    for w, h in candidates:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (w, h), effective, wasted
    return best


class DeepseekVL2Processor:
    """Callable as transformers' processors are by prompt.encode_messages: apply_chat_template, then
    processor(text=[...], images=[...], return_tensors="pt")."""

    chat_template = "deepseek"  # the original's conversation template name; the format is fixed in code

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        candidate_resolutions: Sequence[Sequence[int]],
        *,
        patch_size: int = 14,
        downsample_ratio: int = 2,
        image_mean: Sequence[float] = (0.5, 0.5, 0.5),
        image_std: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        self.tokenizer = tokenizer
        self.candidate_resolutions = [(int(w), int(h)) for w, h in candidate_resolutions]
        self.image_size = self.candidate_resolutions[0][0]  # the tile side, as the original takes it
        self.patch_size = patch_size
        self.downsample_ratio = downsample_ratio
        self.image_mean, self.image_std = tuple(image_mean), tuple(image_std)
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise VismmoeError(f"the tokenizer has no {IMAGE_TOKEN} token; DeepSeek-VL2's tokenizer ships one")

    @property
    def tokens_per_side(self) -> int:
        return math.ceil(self.image_size // self.patch_size / self.downsample_ratio)

    def num_image_tokens(self, width_tiles: int, height_tiles: int) -> int:
        h = w = self.tokens_per_side
        return h * (w + 1) + 1 + (height_tiles * h) * (width_tiles * w + 1)

    # ---- text --------------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = True
    ) -> str:
        """The "deepseek" conversation as text, without BOS (added when tokenizing). Every user turn ends with
        "<|Assistant|>:", so a conversation ending in a user turn is ready for the reply."""
        out = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), _content_text(message.get("content", ""))
            if role == "user":
                out.append(f"{USER}: {content.strip()}\n\n{ASSISTANT}:")
            elif role == "assistant":
                if IMAGE_TOKEN in content:
                    raise VismmoeError(f"an assistant message holds {IMAGE_TOKEN}; images go in user messages")
                out.append(content.strip() + EOS)
            elif role == "system" and i == 0:
                out.append(content.strip())
            else:
                raise VismmoeError(f"message {i}: role {role!r} is not supported (user, assistant, system first)")
        return "".join(out)

    # ---- images ------------------------------------------------------------------------------------------
    def _to_tensor(self, image: Image.Image) -> torch.Tensor:
        x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mean = torch.tensor(self.image_mean).view(3, 1, 1)
        std = torch.tensor(self.image_std).view(3, 1, 1)
        return (x - mean) / std

    def tile_image(self, image: Image.Image, cropping: bool) -> tuple[list[torch.Tensor], int, int]:
        """The global view and the local tiles (row by row) of one image, and its (width, height) in tiles."""
        if not isinstance(image, Image.Image):
            raise VismmoeError(f"expected a PIL image, got {type(image).__name__}")
        if image.width < 1 or image.height < 1:
            raise VismmoeError(f"image is {image.width}x{image.height}: nothing to see")
        image = image.convert("RGB")
        size = self.image_size
        width, height = select_best_resolution(image.size, self.candidate_resolutions) if cropping else (size, size)
        fill = tuple(int(m * 255) for m in self.image_mean)
        views = [self._to_tensor(ImageOps.pad(image, (size, size), color=fill))]
        local = ImageOps.pad(image, (width, height), color=fill)
        for top in range(0, height, size):
            for left in range(0, width, size):
                views.append(self._to_tensor(local.crop((left, top, left + size, top + size))))
        return views, width // size, height // size

    # ---- both --------------------------------------------------------------------------------------------
    def __call__(
        self, text: list[str] | str, images: list[Image.Image] | None = None, return_tensors: str = "pt"
    ) -> dict[str, torch.Tensor]:
        prompt = text[0] if isinstance(text, list) else text
        images = list(images or [])
        pieces = prompt.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise VismmoeError(f"the prompt holds {len(pieces) - 1} {IMAGE_TOKEN} tokens but {len(images)} images")
        cropping = len(images) <= 2  # as the original: many images get no local tiles beyond one
        ids = [self.tokenizer.bos_token_id]
        views: list[torch.Tensor] = []
        grid = []
        for piece, image in zip(pieces, images + [None], strict=True):
            ids += self.tokenizer.encode(piece, add_special_tokens=False)
            if image is None:
                continue
            tiles, width_tiles, height_tiles = self.tile_image(image, cropping)
            views += tiles
            grid.append([1, height_tiles, width_tiles])
            ids += [self.image_token_id] * self.num_image_tokens(width_tiles, height_tiles)
        input_ids = torch.tensor([ids], dtype=torch.long)
        out = {"input_ids": input_ids}
        if images:
            out["pixel_values"] = torch.stack(views)
            out["image_grid_thw"] = torch.tensor(grid, dtype=torch.long)
            out["mm_token_type_ids"] = (input_ids == self.image_token_id).long()
        return out

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(directory)
        config = {
            "processor_class": "DeepseekVLV2Processor",
            "candidate_resolutions": [list(r) for r in self.candidate_resolutions],
            "patch_size": self.patch_size,
            "downsample_ratio": self.downsample_ratio,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "normalize": True,
            "image_token": IMAGE_TOKEN,
            "pad_token": PAD,
            "sft_format": "deepseek",
        }
        (directory / PROCESSOR_FILE).write_text(json.dumps(config, indent=2))


def _content_text(content: Any) -> str:
    """A message's content as text: transformers' content-list parts, `{"type": "image"}` -> "<image>\\n"."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise VismmoeError(f"message content must be a string or a list of parts, not {type(content).__name__}")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "image_url"):
            out.append(IMAGE_TOKEN + "\n")
        elif kind == "text":
            out.append(part.get("text", ""))
        else:
            raise VismmoeError(f"message part {part!r} is not supported (text or image)")
    return "".join(out)


def load_deepseek_vl2_processor(model_dir: Path) -> DeepseekVL2Processor:
    """The tokenizer beside the checkpoint and processor_config.json (the original's keys), offline."""
    model_dir = Path(model_dir)
    path = model_dir / PROCESSOR_FILE
    if not path.is_file() or not (model_dir / "tokenizer.json").is_file():
        raise VismmoeError(f"cannot load the processor from {model_dir}: missing {PROCESSOR_FILE} or tokenizer.json")
    try:
        config = json.loads(path.read_text())
        candidates = [(int(w), int(h)) for w, h in config["candidate_resolutions"]]
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise VismmoeError(f"{path}: not a DeepSeek-VL2 processor config ({type(e).__name__}: {e})") from e
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:  # transformers raises many types here; the user needs one line either way
        reason = " ".join(str(e).split())[:300]
        raise VismmoeError(f"cannot load the tokenizer from {model_dir}: {type(e).__name__}: {reason}") from e
    if tokenizer.bos_token_id is None:
        raise VismmoeError(f"the tokenizer in {model_dir} has no BOS token; DeepSeek-VL2's prompts start with one")
    return DeepseekVL2Processor(
        tokenizer,
        candidates,
        patch_size=int(config.get("patch_size", 14)),
        downsample_ratio=int(config.get("downsample_ratio", 2)),
        image_mean=config.get("image_mean", (0.5, 0.5, 0.5)),
        image_std=config.get("image_std", (0.5, 0.5, 0.5)),
    )
