"""Offline byte-level BPE tokenizers for test and training checkpoints: deterministic, no hub, no network."""

from __future__ import annotations

import json
from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2Tokenizer

# Fixed training text: the tokenizer only has to be deterministic and cover the demo prompts compactly.
CORPUS: tuple[str, ...] = (
    "Describe the image in one sentence.",
    "What is in this picture? There is a red circle, a blue square and a digit.",
    "The red circle is on the left and the blue square is on the right.",
    "How many shapes are there? What colour is the background?",
    "The digit 7 is drawn in black. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100.",
    "user assistant system: You are a helpful assistant. Answer the question about the image.",
    "A photo of a cat, a dog, a car, a tree, a house, a person and the sky.",
    "Hello world! This is a tiny random model, so its answers are noise.",
)


VOCAB_SIZE = 400


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
