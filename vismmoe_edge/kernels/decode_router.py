"""One decode token's router after its logits, in one Triton program: softmax, top-k, renormalisation.

transformers' Qwen3VLMoeTextTopKRouter takes softmax in float32, `torch.topk`, then divides the k weights by
their sum. On CUDA `torch.topk` of 8 out of 128 is two kernels (a radix select and a bitonic sort of the k), which
cost 8.5 us a layer on an H200 in the compiled decode token's profile: more than the router's GEMV, for 512 bytes
of logits. Here one program holds the logits in registers and picks the k largest by repeated argmax (the
largest first, as `torch.topk` sorts them; among equal weights the lowest expert id first).

`route_topk` is a `torch.library.triton_op`, so torch.compile traces through it and the compiled router of
kernels/decode_layer.py calls it inside the token's graph. The CPU never takes it: the eager router stays
transformers' computation, exactly. `route_topk_reference` is the same contract in torch, for the tests.
"""

from __future__ import annotations

import torch

from vismmoe_edge.kernels.moe_decode import HAS_TRITON


def route_topk_reference(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [1, E] -> (index [1, k] long, weights [1, k] in logits' dtype): transformers' router after its GEMV."""
    top, index = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    return index, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)


@torch.library.triton_op("vismmoe_edge::route_topk", mutates_args=())
def _route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from torch.library import wrap_triton

    experts = logits.shape[-1]
    index = torch.empty(1, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(1, top_k, dtype=logits.dtype, device=logits.device)
    block = 1 << (experts - 1).bit_length()
    wrap_triton(_topk_kernel)[(1,)](logits.contiguous(), index, weights, experts, K=top_k, BLOCK=block,
                                    K_P2=1 << (top_k - 1).bit_length())  # fmt: skip
    return index, weights


def route_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton program (CUDA, or the CPU under TRITON_INTERPRET=1); the contract of `route_topk_reference`."""
    if logits.dim() != 2 or logits.shape[0] != 1 or not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"route_topk: logits must be [1, E] with 0 < k <= E, got {tuple(logits.shape)}, k={top_k}")
    return _route_topk(logits, top_k)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _topk_kernel(logits, index_out, weight_out, experts, K: tl.constexpr, BLOCK: tl.constexpr,
                     K_P2: tl.constexpr):  # fmt: skip
        offs = tl.arange(0, BLOCK)
        valid = offs < experts
        z = tl.load(logits + offs, mask=valid, other=float("-inf")).to(tl.float32)
        e = tl.exp(z - tl.max(z, 0))
        p = e / tl.sum(e, 0)  # float32 softmax, as transformers' router takes it
        slots = tl.arange(0, K_P2)
        index = tl.zeros((K_P2,), dtype=tl.int64)
        top = tl.zeros((K_P2,), dtype=tl.float32)
        left = tl.where(valid, p, -1.0)  # probabilities are >= 0: -1 marks what is taken or padding
        for j in tl.static_range(K):
            best = tl.max(left, 0)
            at = tl.argmax(left, 0)  # the lowest index among equal maxima
            index = tl.where(slots == j, at.to(tl.int64), index)
            top = tl.where(slots == j, best, top)
            left = tl.where(offs == at, -1.0, left)
        weights = top / tl.sum(top, 0)  # slots past K hold 0
        tl.store(index_out + slots, index, mask=slots < K)
        tl.store(weight_out + slots, weights.to(weight_out.dtype.element_ty), mask=slots < K)
