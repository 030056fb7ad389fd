"""One decode token's router after its logits, in one Triton program: softmax, top-k, renormalisation.

transformers' Qwen3VLMoeTextTopKRouter takes softmax in float32, `torch.topk`, then divides the k weights by
their sum. On CUDA `torch.topk` of 8 out of 128 is two kernels (a radix select and a bitonic sort of the k), which
cost 8.5 us a layer on an H200 in the compiled decode token's profile: more than the router's GEMV, for 512 bytes
of logits. Here one program holds the logits in registers and picks the k largest by repeated argmax (the
largest first, as `torch.topk` sorts them; among equal weights the lowest expert id first).

`route_topk` (its kernel in triton_decode.py) is a `torch.library.triton_op`, so torch.compile traces through it
and the compiled router of kernels/decode_layer.py calls it inside the token's graph. The CPU never takes it:
the eager router stays transformers' computation, exactly. `route_topk_reference` is the same contract in torch,
for the tests.
"""

from __future__ import annotations

import torch

from vismmoe_edge.kernels.moe_decode import triton_op


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
