"""The incremental detokenizer: the pieces add up to the full decode, and each token decodes a short window."""

from __future__ import annotations

import random

import pytest

from vismmoe_edge.detokenize import TextStream
from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor


@pytest.fixture(scope="module")
def tokenizer():
    from vismmoe_edge.demo import ensure_demo_model

    return load_qwen3_vl_processor(ensure_demo_model()).tokenizer


class CountingTokenizer:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, tokens: list[int], **kwargs) -> str:
        self.longest = max(self.longest, len(tokens))
        return self.inner.decode(tokens, **kwargs)


def stream(tokenizer, tokens: list[int]) -> tuple[list[str], TextStream]:
    text = TextStream(tokenizer)
    pieces = [text.push(t) for t in tokens]
    pieces.append(text.finish())
    return pieces, text


def test_pieces_add_up_to_the_full_decode(tokenizer) -> None:
    rng = random.Random(0)
    multibyte = tokenizer.encode("héllo wörld — 東京 ✓ 🙂 naïve", add_special_tokens=False)
    ascii_words = tokenizer.encode("What colour is the circle? It is orange.", add_special_tokens=False)
    specials = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    for trial in range(40):
        pool = multibyte + ascii_words + specials
        tokens = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
        if trial % 4 == 0:  # split a multi-byte character's bytes across tokens
            tokens = multibyte[: rng.randint(1, len(multibyte))]
        pieces, text = stream(tokenizer, tokens)
        assert "".join(pieces) == text.text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert all(not p.endswith("\ufffd") for p in pieces[:-1])  # nothing emitted mid-character


def test_each_token_decodes_a_short_window(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    tokens = tokenizer.encode("the circle is orange and the square is blue. " * 60, add_special_tokens=False)
    pieces, text = stream(counting, tokens)
    assert len(tokens) > 500
    assert text.text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert counting.longest <= 4  # a window around the newest token, not the whole reply (quadratic)
