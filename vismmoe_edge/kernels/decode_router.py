"""One decode token's router after its logits, in one Triton program: softmax, top-k, renormalisation.

transformers' Qwen3VLMoeTextTopKRouter takes softmax in float32, `torch.topk`, then divides the k weights by
their sum. On CUDA `torch.topk` of 8 out of 128 is two kernels (a radix select and a bitonic sort of the k), which
cost 8.5 us a layer on an H200 in the compiled decode token's profile: more than the router's GEMV, for 512 bytes
of logits. Here one program holds the logits in registers and picks the k largest by repeated maximum, one
reduction a pick over keys that order by weight and then by the lower expert id (the largest first, as
`torch.topk` sorts them; among equal weights the lowest expert id first: triton_decode.routed).

`route_topk` (its kernel in triton_decode.py) is a `torch.library.triton_op`, so torch.compile traces through it
and the compiled router of kernels/decode_layer.py calls it inside the token's graph. The CPU never takes it:
the eager router stays transformers' computation, exactly. `route_topk_reference` is the same contract in torch,
for the tests.

`route_and_lookup` is the whole router of a device token with compiled layers in one kernel: the GEMV, softmax, top-k,
renormalisation, the expert table's lookup and the token's routing and miss rows. In run 11's profile the router
was three kernels a layer (cuBLAS's GEMV 5.0 us for 0.5 MB, all latency; the top-k 3.7 us; the lookup 1.4 us)
with a gap after each. The GEMV needs many programs to be quick and the top-k needs every logit, so each program
computes a few logits and the last one to finish (a ticket from an atomic counter, which it resets) routes. It is
launched directly, outside torch.compile (as the expert GEMVs are), so the rows it writes in place are plain
stores, not mutations inductor would functionalize. `route_and_lookup_reference` is its contract in torch.
"""

from __future__ import annotations

import torch

from vismmoe_edge.kernels.dense_gemv import blocks
from vismmoe_edge.kernels.moe_decode import lookup, triton_op


def route_topk_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [1, E] -> (index [1, k] long, weights [1, k] in logits' dtype): transformers' router after its GEMV."""
    top, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    return index, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)


@triton_op("vismmoe_edge::route_topk")
def _route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.library import wrap_triton

    from vismmoe_edge.kernels import triton_decode

    experts = logits.shape[-1]
    index = torch.empty(1, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(1, top_k, dtype=logits.dtype, device=logits.device)
    block = 1 << (experts - 1).bit_length()
    wrap_triton(triton_decode._topk_kernel)[(1,)](logits.contiguous(), index, weights, experts, K=top_k, BLOCK=block,
                                    K_P2=1 << (top_k - 1).bit_length())  # fmt: skip
    return index, weights


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton program (CUDA, or the CPU under TRITON_INTERPRET=1); the contract of `route_topk_reference`."""
    if logits.dim() != 2 or logits.shape[0] != 1 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"route_topk: logits must be [1, E] with 0 < k <= E, got {tuple(logits.shape)}, k={top_k}")
    return _route_topk(logits, top_k)


def route_and_lookup_reference(
    x: torch.Tensor, weight: torch.Tensor, table_row: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, H], the router's weight [E, H], the table's row [E] -> (index [1, k] long, weights [1, k] in x's dtype,
    slots [1, k] long, missed: bool scalar): transformers' router, then moe_decode.lookup."""
    index, weights = route_topk_reference(torch.nn.functional.linear(x, weight), top_k)
    return index, weights, *lookup(index, table_row)


# Warps a program: Triton's default. Run 15's profile (an H100) put the kernel at 6.8 us a layer for 0.5 MB of
# weight; its last program's softmax, 8 picks and renormalisation were 19 reductions (11 since: one a pick), each
# a shared-memory round trip across warps at 4, shuffles alone at 1: decode_checks.py times 1, 2, 4 and 8 for the
# next GPU run to choose.
ROUTE_WARPS = 4


def route_and_lookup(
    x: torch.Tensor, weight: torch.Tensor, table_row: torch.Tensor, routing: torch.Tensor, missed: torch.Tensor,
    counter: torch.Tensor, *, num_warps: int = ROUTE_WARPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One Triton kernel (CUDA, or the CPU under TRITON_INTERPRET=1): (index, weights, slots) as
    `route_and_lookup_reference`, with index also written into `routing` [k] and the miss flag into `missed` [];
    `counter` [1] int32 holds 0 between calls (the kernel leaves it so)."""
    experts, hidden = weight.shape
    k = routing.shape[0]
    if x.shape != (1, hidden) or weight.stride(1) != 1 or table_row.shape != (experts,) or not 0 < k <= experts:
        raise ValueError(f"route_and_lookup: x [1, {hidden}], a row-contiguous weight and a table row of "
                         f"{experts} are needed, got {tuple(x.shape)}, {tuple(table_row.shape)}, k={k}")  # fmt: skip
    if counter.dtype != torch.int32 or missed.dtype != torch.bool or routing.dtype != torch.long:
        raise ValueError("route_and_lookup: counter int32, missed bool and routing long are needed")
    from vismmoe_edge.kernels import triton_decode

    logits = torch.empty(experts, dtype=torch.float32, device=x.device)
    index = torch.empty(1, k, dtype=torch.long, device=x.device)
    weights = torch.empty(1, k, dtype=x.dtype, device=x.device)
    slots = torch.empty(1, k, dtype=torch.long, device=x.device)
    rows, block_h = blocks(experts, hidden)
    triton_decode._route_kernel[(-(-experts // rows),)](
        x.contiguous(), weight, table_row, logits, counter, index, weights, slots, routing, missed, experts, hidden,
        weight.stride(0), K=k, K_P2=1 << (k - 1).bit_length(), BLOCK_E=1 << (experts - 1).bit_length(), ROWS=rows,
        BLOCK_H=block_h, num_warps=num_warps,
    )  # fmt: skip
    return index, weights, slots
