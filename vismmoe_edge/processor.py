"""Offline Qwen3-VL processor: a tiny deterministic tokenizer for demos/tests, and a loader for real ones.

Nothing here touches the network. `ImageOnlyProcessor` exists because `Qwen3VLProcessor` declares a video
processor, which cannot be resolved without torchvision (notes/transformers-vlmoe.md §4.4).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import ProcessorMixin, Qwen2Tokenizer
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

from vismmoe_edge.errors import VismmoeError

SPECIAL_TOKENS: list[str] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen3-VL vision geometry: a merged visual token covers (PATCH * MERGE)^2 pixels.
PATCH_SIZE = 16
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2

# Qwen-style template, content-list format. Strings are also accepted so text-only callers stay simple.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}"
    "{{- part['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Fixed training text: the tokenizer only has to be deterministic and cover the demo prompts compactly.
_CORPUS: tuple[str, ...] = (
    "Describe the image in one sentence.",
    "What is in this picture? There is a red circle, a blue square and a digit.",
    "The red circle is on the left and the blue square is on the right.",
    "How many shapes are there? What colour is the background?",
    "The digit 7 is drawn in black. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100.",
    "user assistant system: You are a helpful assistant. Answer the question about the image.",
    "A photo of a cat, a dog, a car, a tree, a house, a person and the sky.",
    "Hello world! This is a tiny random model, so its answers are noise.",
)
_VOCAB_SIZE = 400


class ImageOnlyProcessor(Qwen3VLProcessor):
    """`Qwen3VLProcessor` without the video processor (which needs torchvision).

    `ProcessorMixin` reads the sub-processor list from this signature, so omitting `video_processor` here
    is what makes construction and `from_pretrained` work.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )


def train_bpe_tokenizer(
    corpus: Sequence[str], vocab_size: int, special_tokens: list[str], *, eos_token: str, pad_token: str
) -> Qwen2Tokenizer:
    """A byte-level BPE tokenizer trained on `corpus`: deterministic, offline, never produces an unknown token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # The full byte alphabet means no input is ever unknown.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=special_tokens,
        show_progress=False,
    )
    # The trainer breaks count ties by pair order, so a fixed corpus gives a fixed vocab (checked by a test).
    tok.train_from_iterator(list(corpus), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    # Merges must be tuples: Qwen2Tokenizer rejects "a b" strings ("failed to extract enum PyMerges").
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    out = Qwen2Tokenizer(
        vocab=dict(model["vocab"]), merges=merges, unk_token=None, eos_token=eos_token, pad_token=pad_token
    )
    out.add_special_tokens({"additional_special_tokens": special_tokens})
    return out


def build_offline_tokenizer(corpus: Sequence[str] = _CORPUS, vocab_size: int = _VOCAB_SIZE) -> Qwen2Tokenizer:
    """The Qwen-style offline tokenizer of the demo and test checkpoints."""
    return train_bpe_tokenizer(corpus, vocab_size, SPECIAL_TOKENS, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def build_offline_processor(
    *, min_pixels: int, max_pixels: int, tokenizer: Qwen2Tokenizer | None = None
) -> ImageOnlyProcessor:
    """A complete Qwen3-VL-style processor built from nothing; identical output on every call."""
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )
    return ImageOnlyProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer if tokenizer is not None else build_offline_tokenizer(),
        chat_template=CHAT_TEMPLATE,
    )


def load_processor(model_dir: Path, processor_class: type[ProcessorMixin] = ImageOnlyProcessor) -> ProcessorMixin:
    """Load the processor saved beside a checkpoint (ours, or a Hugging Face directory) as `processor_class`."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise VismmoeError(f"processor directory {model_dir} does not exist")
    missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (model_dir / n).is_file()]
    if not any((model_dir / n).is_file() for n in ("preprocessor_config.json", "processor_config.json")):
        missing.append("preprocessor_config.json or processor_config.json")
    if missing:
        raise VismmoeError(f"cannot load the processor from {model_dir}: missing {', '.join(missing)}")
    try:
        proc = processor_class.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # transformers raises many types here; the user needs one line either way
        reason = " ".join(str(exc).split())[:300]
        raise VismmoeError(f"cannot load the processor from {model_dir}: {type(exc).__name__}: {reason}") from exc
    if not proc.chat_template:
        raise VismmoeError(f"the processor in {model_dir} has no chat template: add chat_template.jinja or .json")
    return proc
