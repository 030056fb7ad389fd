"""The compiled decode token's router after its GEMV (kernels/decode_router.py): softmax, top-k and
renormalisation in one Triton program, against transformers' router computation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.kernels.decode_router import route_topk, route_topk_reference


def test_reference_is_transformers_router() -> None:
    """The reference contract is transformers' router on the same weights, bit for bit."""
    config = type("C", (), {"num_experts_per_tok": 8, "num_experts": 128, "hidden_size": 64})()
    router = Qwen3VLMoeTextTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(1, 64)
    _, weights, index = router(x)
    ref_index, ref_weights = route_topk_reference(torch.nn.functional.linear(x, router.weight), 8)
    assert torch.equal(index, ref_index) and torch.equal(weights, ref_weights)


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    ("experts", "k", "dtype"), [(128, 8, torch.bfloat16), (16, 4, torch.float32), (60, 6, torch.float32)]
)
def test_triton_router_matches_the_reference_in_the_interpreter(experts: int, k: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(experts)
    for _ in range(5):
        logits = (torch.randn(1, experts, generator=g) * 3).to(dtype)
        index, weights = route_topk(logits, k)
        ref_index, ref_weights = route_topk_reference(logits, k)
        assert torch.equal(index, ref_index)  # the same experts in the same order (largest first)
        assert weights.dtype == dtype
        assert torch.allclose(weights.float(), ref_weights.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_triton_router_breaks_ties_by_the_lowest_expert() -> None:
    logits = torch.zeros(1, 16)
    logits[0, [3, 9, 12]] = 2.0
    index, weights = route_topk(logits, 4)
    assert index.tolist() == [[3, 9, 12, 0]]
    assert torch.allclose(weights.sum(), torch.tensor(1.0))


def test_route_topk_refuses_what_it_cannot_route() -> None:
    with pytest.raises(ValueError, match="route_topk"):
        route_topk(torch.zeros(2, 16), 4)
    with pytest.raises(ValueError, match="route_topk"):
        route_topk(torch.zeros(1, 4), 8)


def _route_case(g: torch.Generator, experts: int, hidden: int, k: int, dtype: torch.dtype) -> tuple:
    """A token's input, router weight and table row (a quarter of the experts absent), with the k + 1 largest
    logits distinct (a tie's order is torch.topk's to choose). bf16: sums exact in float32 (x in eighths, integer
    weights), so the one rounding to bf16 is the same whatever the order of the sums."""
    while True:
        if dtype == torch.bfloat16:
            x = (torch.randint(-8, 9, (1, hidden), generator=g) / 8).to(dtype)
            w = torch.randint(-3, 4, (experts, hidden), generator=g).to(dtype)
        else:
            x = torch.randn(1, hidden, generator=g, dtype=dtype)
            w = torch.randn(experts, hidden, generator=g, dtype=dtype) / hidden**0.5
        table = torch.randperm(4 * experts, generator=g)[:experts].to(torch.int32)
        table[torch.rand(experts, generator=g) < 0.25] = -1
        top = torch.nn.functional.linear(x, w).float().topk(k + 1).values
        if bool((top[0, :-1] > top[0, 1:]).all()):
            return x, w, table


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize(("experts", "hidden", "k", "dtype"), [(128, 64, 8, torch.bfloat16),
                                                              (60, 200, 6, torch.float32),
                                                              (128, 5000, 8, torch.float32)])  # fmt: skip
def test_one_kernel_router_routes_and_looks_up_as_transformers_in_the_interpreter(
    experts: int, hidden: int, k: int, dtype: torch.dtype
) -> None:
    from vismmoe_edge.kernels.decode_router import route_and_lookup, route_and_lookup_reference

    g = torch.Generator().manual_seed(experts + hidden)
    counter = torch.zeros(1, dtype=torch.int32)
    misses = 0
    for _ in range(4):  # one counter through consecutive calls: each leaves it at 0 for the next
        x, w, table = _route_case(g, experts, hidden, k, dtype)
        routing, missed = torch.full((k,), -7, dtype=torch.long), torch.tensor(False)
        index, weights, slots = route_and_lookup(x, w, table, routing, missed, counter)
        ref_index, ref_weights, ref_slots, ref_missed = route_and_lookup_reference(x, w, table, k)
        assert torch.equal(index, ref_index) and torch.equal(slots, ref_slots)
        assert torch.equal(routing, ref_index[0]) and bool(missed) == bool(ref_missed)
        assert weights.dtype == dtype
        assert torch.allclose(weights.float(), ref_weights.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        assert int(counter) == 0
        misses += bool(ref_missed)
    assert 0 < misses  # some calls looked up an absent expert


def test_one_kernel_router_refuses_what_it_cannot_route() -> None:
    from vismmoe_edge.kernels.decode_router import route_and_lookup

    x, w = torch.randn(1, 16), torch.randn(8, 16)
    rows = (torch.zeros(8, dtype=torch.int32), torch.zeros(2, dtype=torch.long), torch.tensor(False))
    with pytest.raises(ValueError, match="route_and_lookup: x"):
        route_and_lookup(torch.randn(2, 16), w, *rows, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="counter int32"):
        route_and_lookup(x, w, *rows, torch.zeros(1, dtype=torch.int64))


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_triton_router_picks_among_underflowed_probabilities_by_the_lowest_expert() -> None:
    """Probabilities that underflow to 0 (logits far below the largest) tie at +0.0: the picks after the real ones
    go to the lowest ids (torch.topk orders such ties as it likes), with the reference's weights (float32: the
    softmax's own rounding, as in the test above)."""
    logits = torch.full((1, 32), -200.0)
    logits[0, [5, 20]] = torch.tensor([10.0, 9.0])
    logits[0, 30] = -150.0  # exp(-160) in float32: 0 too
    index, weights = route_topk(logits, 6)
    ref_index, ref_weights = route_topk_reference(logits, 6)
    assert index.tolist() == [[5, 20, 0, 1, 2, 3]] and ref_index[0, :2].tolist() == [5, 20]
    assert torch.allclose(weights, ref_weights, rtol=1e-5) and not weights[0, 2:].any()
