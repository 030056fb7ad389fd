"""The slot pool's prefill (experts/pool_compute.prefill_experts) with torch's grouped GEMM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vismmoe_edge.experts.pool_compute import grouped_mm_works, prefill_experts


@pytest.mark.skipif(not grouped_mm_works(torch.float32, torch.device("cpu")), reason="no torch._grouped_mm here")
def test_grouped_prefill_reads_a_run_of_slots_in_place_with_the_copys_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same experts in a run of slots (read as views of the pool, no gathered copy) and scattered over the
    pool (gathered first) give bit-identical outputs, and both equal the per-slot loop."""
    g = torch.Generator().manual_seed(3)
    experts, hidden, inter, tokens, k = 6, 16, 8, 20, 2
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g)
    down = torch.randn(experts, hidden, inter, generator=g)
    x = torch.randn(tokens, hidden, generator=g)
    routed = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    assert set(routed.flatten().tolist()) == set(range(experts))  # every expert in use: the run is whole

    def pool_with(at: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool_gate_up = torch.zeros(16, 2 * inter, hidden)
        pool_down = torch.zeros(16, hidden, inter)
        pool_gate_up[at], pool_down[at] = gate_up, down
        return pool_gate_up, pool_down

    run, scattered = list(range(5, 5 + experts)), [0, 2, 3, 9, 12, 15]
    outputs = []
    for at in (run, scattered):
        slots = torch.tensor(at)[routed]
        pool_gate_up, pool_down = pool_with(at)
        with monkeypatch.context() as m:
            if at == run:  # a gathered copy of the weights would be the cost this path avoids
                m.setattr(torch.Tensor, "index_select", lambda *a, **kw: pytest.fail("weights copied"))
            outputs.append(prefill_experts(x, slots, weights, pool_gate_up, pool_down, F.silu, grouped=True))
        loop = prefill_experts(x, slots, weights, pool_gate_up, pool_down, F.silu, grouped=False)
        torch.testing.assert_close(outputs[-1], loop, rtol=1e-5, atol=1e-5)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.skipif(not grouped_mm_works(torch.float32, torch.device("cpu")), reason="no torch._grouped_mm here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pinned_layers_prefill_groups_every_expert_with_the_same_result(dtype: torch.dtype) -> None:
    """`run`: one group per expert of a pinned layer, those no token routed to empty, offsets found on the device
    (no host sync): bit-identical to grouping the slots in use."""
    g = torch.Generator().manual_seed(5)
    experts, hidden, inter, tokens, k, first = 8, 16, 8, 5, 2, 3
    pool_gate_up = torch.randn(16, 2 * inter, hidden, generator=g).to(dtype)
    pool_down = torch.randn(16, hidden, inter, generator=g).to(dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routed = torch.tensor([[0, 6], [6, 2], [2, 0], [7, 6], [0, 7]])  # experts 1, 3, 4 and 5 unrouted
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    slots = routed + first
    used = prefill_experts(x, slots, weights, pool_gate_up, pool_down, F.silu, grouped=True)
    every = prefill_experts(x, slots, weights, pool_gate_up, pool_down, F.silu, grouped=True, run=(first, experts))
    assert torch.equal(used, every)
