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
