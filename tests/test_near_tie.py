"""The GPU checks' near-tie rule (tests/hf_reference.near_tie_divergence) on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from tests.hf_reference import near_tie_divergence


def _logits(*values: float) -> torch.Tensor:
    return torch.tensor(values)


def test_equal_tokens_are_no_divergence() -> None:
    assert near_tie_divergence([1, 2], [1, 2], [], []) is None


def test_a_flip_within_the_noise_is_a_near_tie() -> None:
    ref = [_logits(0.0, 5.0, 1.0), _logits(0.0, 2.000, 1.996)]  # step 1: margin 0.004
    ours = [_logits(0.0, 5.0, 1.0), _logits(0.01, 1.995, 2.001)]  # noise up to 0.01
    d = near_tie_divergence([1, 2], [1, 1], ref, ours)
    assert d is not None and d.step == 1 and d.accepted
    assert d.margin == pytest.approx(0.004, abs=1e-6) and d.difference == pytest.approx(0.01, abs=1e-6)
    assert "accepted" in d.describe()


def test_a_flip_beyond_the_noise_is_not_excused() -> None:
    ref = [_logits(0.0, 3.0, 1.0)]  # margin 2
    ours = [_logits(0.0, 1.0, 1.5)]  # a different expert: difference 2 is not above the margin
    d = near_tie_divergence([2], [1], ref, ours)
    assert d is not None and d.step == 0 and not d.accepted
    assert "NOT" in d.describe()


def test_a_shorter_run_is_an_error() -> None:
    with pytest.raises(AssertionError, match="lengths differ"):
        near_tie_divergence([1], [1, 2], [_logits(0.0, 1.0)] * 2, [_logits(0.0, 1.0)] * 2)
