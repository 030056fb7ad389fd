"""Offline GLM-4.5V processor: a tiny deterministic tokenizer with GLM's special tokens, and a loader.

`Glm4vProcessor` declares a video processor that cannot be resolved without torchvision, as Qwen's does
(notes/transformers-vlmoe.md §4.4): the subclass below leaves it out of its signature. The image processor
is the PIL backend `Glm4vImageProcessorPil`, which needs no torchvision either.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from transformers import Qwen2Tokenizer
from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
from transformers.models.glm4v.processing_glm4v import Glm4vProcessor

from vismmoe_edge.processor import _CORPUS, load_processor, train_bpe_tokenizer

# GLM-4.5V's control tokens; image placeholders are <|begin_of_image|><|image|>...<|end_of_image|>.
SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
]
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # as GLM-4.5V's generation_config lists them

# GLM-4.5V vision geometry: a merged visual token covers (PATCH * MERGE)^2 pixels.
PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2

# GLM-style template, content-list format; strings are accepted too.
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|begin_of_image|><|image|><|end_of_image|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)
_VOCAB_SIZE = 400


class ImageOnlyGlm4vProcessor(Glm4vProcessor):
    """`Glm4vProcessor` without the video processor (which needs torchvision).

    `ProcessorMixin` reads the sub-processor list from this signature, so omitting `video_processor` here is
    what makes construction and `from_pretrained` work.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


def build_offline_glm4v_tokenizer(corpus: Sequence[str] = _CORPUS, vocab_size: int = _VOCAB_SIZE) -> Qwen2Tokenizer:
    """A byte-level BPE (GLM-4's tokenizer is byte-level BPE too) with GLM's special tokens; deterministic."""
    return train_bpe_tokenizer(
        corpus, vocab_size, SPECIAL_TOKENS, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def build_offline_glm4v_processor(
    *, min_pixels: int, max_pixels: int, tokenizer: Qwen2Tokenizer | None = None
) -> ImageOnlyGlm4vProcessor:
    """A complete GLM-4.5V-style processor built from nothing. Pixel bounds count both temporal copies of an
    image (GLM's smart_resize multiplies by temporal_patch_size)."""
    image_processor = Glm4vImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    return ImageOnlyGlm4vProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer if tokenizer is not None else build_offline_glm4v_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def load_glm4v_processor(model_dir: Path) -> ImageOnlyGlm4vProcessor:
    """Load the processor saved beside a GLM-4.5V checkpoint (ours, or a Hugging Face directory)."""
    return load_processor(model_dir, ImageOnlyGlm4vProcessor)
