"""A prefill's popularity weighs its last tokens most (experts/recency.py): the shares, the eviction they decide,
the engine passing them on, VISMMOE_PROMPT_HALF_LIFE."""

from __future__ import annotations

import pytest
import torch

import vismmoe_edge
from tests.test_pipeline import RecordingTier
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.pipeline import ExpertPipeline
from vismmoe_edge.experts.recency import PROMPT_HALF_LIFE_TOKENS, prompt_half_life, prompt_shares
from vismmoe_edge.sampling import SamplingConfig


def test_shares_weigh_a_token_half_a_half_life_before_the_last() -> None:
    index = torch.tensor([[0, 1], [0, 2], [3, 2]])  # 3 tokens, top-2
    experts, shares = prompt_shares(index, half_life=1.0)
    w = torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64) / 1.75  # ages 2, 1, 0 tokens
    assert experts.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(shares, torch.stack([w[0] + w[1], w[0], w[1] + w[2], w[2]]), rtol=0, atol=1e-15)
    assert float(shares.sum()) == pytest.approx(2.0)  # k experts a token, as plain fractions sum to


def test_half_life_zero_is_the_plain_fraction_and_one_token_shares_one() -> None:
    index = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:4] for i in range(50)])
    experts, shares = prompt_shares(index, half_life=0.0)
    plain_experts, counts = torch.unique(index, return_counts=True)
    assert experts.tolist() == plain_experts.tolist()
    torch.testing.assert_close(shares, counts.double() / 50, rtol=0, atol=1e-15)
    experts, shares = prompt_shares(torch.tensor([[5, 9]]), half_life=PROMPT_HALF_LIFE_TOKENS)  # a decode token
    assert experts.tolist() == [5, 9] and shares.tolist() == [1.0, 1.0]


def test_the_last_tokens_expert_outlives_the_first_tokens_one() -> None:
    # expert 1 of layer 0 routed by the first three of four tokens, expert 2 by the last one only; expert 7 of
    # layer 1 then needs a slot, and the pool holds two: which of layer 0's experts leaves?
    index = torch.tensor([[1], [1], [1], [2]])

    def resident(half_life: float) -> set[tuple[int, int]]:
        pipeline = ExpertPipeline(RecordingTier(), capacity=2, policy="popularity")
        experts, shares = prompt_shares(index, half_life)
        steps = [(0, experts.tolist(), shares.tolist()), (1, [7], [1.0])]
        for layer, routed, share in steps:
            for e in pipeline.begin_layer(layer, routed, shares=share):
                pipeline.acquire(layer, e)
                pipeline.finish(layer, e)
        keys = pipeline.resident_keys()
        pipeline.close()
        return keys

    assert resident(0.0) == {(0, 1), (1, 7)}  # plain counts: 3/4 of the tokens beat 1/4
    assert resident(1.0) == {(0, 2), (1, 7)}  # the last token weighs 1 against 1/8 + 1/4 + 1/2


def test_the_engine_passes_a_prefills_weighted_shares_to_the_pipeline(checkpoints, monkeypatch) -> None:
    for value, half_life in (("", PROMPT_HALF_LIFE_TOKENS), ("4", 4.0), ("0", 0.0)):
        monkeypatch.setenv("VISMMOE_PROMPT_HALF_LIFE", value)
        engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="host")
        assert engine.experts.prompt_half_life == half_life
        routed: dict[int, torch.Tensor] = {}
        engine.experts.route_hooks.append(lambda layer, h, index, w, seen=routed: seen.setdefault(layer, index.clone()))
        engine.generate_from_inputs(engine.encode("A long enough prompt to weigh its tokens", []),
                                    SamplingConfig(max_new_tokens=1))  # fmt: skip
        pipeline = engine.experts.pipeline
        streamed = {layer: index for layer, index in routed.items() if (layer, 0) not in pipeline.pinned}
        assert streamed and all(index.shape[0] > 8 for index in streamed.values())  # the prefill's routing
        for layer, index in streamed.items():
            experts, shares = prompt_shares(index, half_life)
            for e, share in zip(experts.tolist(), shares.tolist(), strict=True):
                assert pipeline._popularity[(layer, e)] == pytest.approx(share, rel=1e-12)
        engine.close()


def test_a_bad_half_life_is_one_line(checkpoints, monkeypatch) -> None:
    assert prompt_half_life(None) == PROMPT_HALF_LIFE_TOKENS and prompt_half_life("0") == 0.0
    assert prompt_half_life("64.5") == 64.5
    for bad in ("-1", "soon", "inf", "nan"):
        with pytest.raises(VismmoeError, match=f"VISMMOE_PROMPT_HALF_LIFE={bad!r}: use a number of tokens >= 0"):
            prompt_half_life(bad)
    monkeypatch.setenv("VISMMOE_PROMPT_HALF_LIFE", "-3")
    with pytest.raises(VismmoeError, match="VISMMOE_PROMPT_HALF_LIFE='-3'"):  # at load, before the experts
        vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="host")
