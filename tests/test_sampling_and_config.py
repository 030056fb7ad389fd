"""Sampling choices and the option parsers."""

from __future__ import annotations

import pytest
import torch

from vismmoe_edge.config import parse_budget
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.sampling import Sampler, SamplingConfig


def test_greedy_picks_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert Sampler(SamplingConfig(), stop_token_ids=[1])(logits, produced=5) == 1


def test_min_new_tokens_masks_stop_tokens() -> None:
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    sampler = Sampler(SamplingConfig(min_new_tokens=2), stop_token_ids=[1])
    assert sampler(logits, produced=0) == 2
    assert sampler(logits, produced=2) == 1


def test_top_p_keeps_only_the_nucleus() -> None:
    # probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.7 keeps the first two only
    logits = torch.log(torch.tensor([0.64, 0.24, 0.09, 0.03]))
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.7, seed=0), stop_token_ids=[])
    seen = {sampler(logits, produced=1) for _ in range(400)}
    assert seen == {0, 1}


def test_sampling_is_reproducible_from_a_seed_and_follows_probabilities() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    draws = [Sampler(SamplingConfig(temperature=1.0, seed=42), [])(logits, 1) for _ in range(3)]
    assert len(set(draws)) == 1
    sampler = Sampler(SamplingConfig(temperature=1.0, seed=1), [])
    counts = torch.bincount(torch.tensor([sampler(logits, 1) for _ in range(4000)]), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (SamplingConfig(max_new_tokens=0), "max_new_tokens"),
        (SamplingConfig(temperature=-1), "temperature"),
        (SamplingConfig(top_p=0), "top_p"),
    ],
)
def test_invalid_sampling_config(config: SamplingConfig, message: str) -> None:
    with pytest.raises(VismmoeError, match=message):
        config.validate()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("512MiB", 512 * 1024**2),
        ("123456", 123456),
        ("40%", 400),
        ("100%", 1000),
        (" 25 % ".strip(), 250),
    ],
)
def test_parse_budget(text: str, expected: int) -> None:
    assert parse_budget(text, total_bytes=1000) == expected


@pytest.mark.parametrize("text", ["lots", "0%", "150%", "-2GiB", "2 parsecs", "0"])
def test_parse_budget_rejects(text: str) -> None:
    with pytest.raises(VismmoeError, match="memory budget"):
        parse_budget(text, total_bytes=1000)
