"""One decode token's attention over a static KV cache, split over the positions (flash-decoding).

With one query at batch 1, attention has almost no parallelism across queries: the mem-efficient SDPA kernel
that the compiled decode layer used (`fmha_cutlassF_bf16_aligned_64x128_rf_sm80`) ran 61 us per layer on an H200
at Qwen3-VL-30B-A3B shapes (32 query heads, 4 KV heads, d 128, capacity 1536, bf16) for ~3 MB of K/V: <1 us
at HBM speed. Here the positions are cut into splits, one program per (KV head, split), so a few hundred
programs share the cache's bytes:

1. `_split_kernel` (in triton_decode.py): each program takes its KV head's group of query heads (padded to 16
   rows for tl.dot), walks its split's blocks of positions up to `length` (read on the device: no host sync, and
   the grid is fixed, so a CUDA graph captures it), with an online softmax in float32, P cast to V's dtype for
   P @ V as flash attention does, and writes its partial max, sum and accumulator in float32;
2. `_combine_kernel`: one program per query head rescales the splits' partials to their common max and sums.

Measured on an H200 (tools/device/decode_checks.py, one layer in a CUDA graph, length capacity // 2): 7.0 us
against 23.7 us for the compiled SDPA path at capacity 1536, 7.9 us against 50.4 us at 4096; max abs error
against SDPA 1e-3 (bf16). The K/V byte bound is 0.4 / 1.0 us; the rest is likely the two kernels' fixed
latency (not profiled).

`decode_attention` is a `torch.library.triton_op`, so torch.compile(fullgraph=True) traces through it and
inductor calls the two kernels inside the compiled graph (kernels/decode_layer.py uses it there).
`decode_attention_reference` is the same contract in plain float32 torch, for the tests.
"""

from __future__ import annotations

import math

import torch

from vismmoe_edge.kernels.moe_decode import INTERPRET, triton_op

BLOCK_N = 64  # positions per block
TARGET_PROGRAMS = 128  # (KV head, split) programs aimed at: an H200 has 132 SMs
MIN_ROWS = 16  # tl.dot's smallest M
# Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits (triton 3.9): under it both dots
# take float32 operands, the bf16/fp16 ones exact in float32 and P rounded to V's dtype first, so the products
# are those of the half-precision dot (its accumulation is float32 too).


def num_splits(capacity: int, kv_heads: int, block_n: int = BLOCK_N) -> int:
    """Splits of a cache of `capacity` positions (fixed per capacity): ~TARGET_PROGRAMS programs, each at least
    one block, and no split left empty."""
    blocks = -(-capacity // block_n)
    per_split = -(-blocks // max(1, min(blocks, TARGET_PROGRAMS // kv_heads)))
    return -(-blocks // per_split)


def check(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor) -> None:
    """The shapes the kernels handle (Qwen3-VL's decode token), with a clear error otherwise."""
    if q.dim() != 4 or q.shape[0] != 1 or q.shape[2] != 1:
        raise ValueError(f"decode_attention: q must be [1, heads, 1, d], got {tuple(q.shape)}")
    if keys.shape != values.shape or keys.dim() != 4 or keys.shape[0] != 1 or keys.shape[3] != q.shape[3]:
        raise ValueError(f"decode_attention: keys and values must be [1, kv_heads, capacity, {q.shape[3]}], got "
                         f"{tuple(keys.shape)} and {tuple(values.shape)}")  # fmt: skip
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("decode_attention: keys and values must be contiguous (the static cache's buffers)")
    d = q.shape[3]
    if d & (d - 1) or not 16 <= d <= 256:
        raise ValueError(f"decode_attention: head_dim must be a power of two in [16, 256], got {d}")
    if q.shape[1] % keys.shape[1]:
        raise ValueError(f"decode_attention: {q.shape[1]} query heads are not a multiple of {keys.shape[1]} KV heads")
    if length.shape != (1,) or length.dtype != torch.long:
        raise ValueError("decode_attention: length must be a [1] long tensor")
    if not (q.dtype == keys.dtype == values.dtype):
        raise ValueError(f"decode_attention: dtypes differ ({q.dtype}, {keys.dtype}, {values.dtype})")


def decode_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [1, heads, 1, d], keys/values [1, kv_heads, capacity, d], positions 0..length visible -> [1, heads, 1, d]
    in q's dtype; float32 math throughout."""
    check(q, keys, values, length)
    heads, kv_heads = q.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(heads // kv_heads, dim=1)  # query head h reads KV head h // groups
    v = values.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # [1, heads, 1, capacity]
    visible = torch.arange(keys.shape[2], device=q.device) <= length
    scores = scores.masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


@triton_op("vismmoe_edge::decode_attention")
def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, scale: float, block_n: int,
    splits: int,
) -> torch.Tensor:  # fmt: skip
    from torch.library import wrap_triton

    from vismmoe_edge.kernels import triton_decode

    heads, kv_heads, capacity, d = q.shape[1], keys.shape[1], keys.shape[2], q.shape[3]
    group = heads // kv_heads
    split = -(-capacity // (splits * block_n)) * block_n  # positions per split, whole blocks
    m = torch.empty(heads, splits, dtype=torch.float32, device=q.device)
    s = torch.empty(heads, splits, dtype=torch.float32, device=q.device)
    acc = torch.empty(heads, splits, d, dtype=torch.float32, device=q.device)
    out = torch.empty(1, heads, 1, d, dtype=q.dtype, device=q.device)
    rows = max(MIN_ROWS, 1 << (group - 1).bit_length())
    wrap_triton(triton_decode._split_kernel)[(kv_heads, splits)](
        q.contiguous(), keys, values, length, m, s, acc, capacity, split, SCALE_LOG2=scale * math.log2(math.e),
        GROUP=group, BLOCK_M=rows, BLOCK_N=block_n, D=d, IEEE=q.dtype == torch.float32 or INTERPRET,
    )  # fmt: skip
    wrap_triton(triton_decode._combine_kernel)[(heads,)](
        m, s, acc, out, splits, SPLITS_P2=1 << (splits - 1).bit_length(), D=d
    )
    return out


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor, scale: float, *,
    block_n: int = BLOCK_N, splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """The split-KV Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1); the contract of
    `decode_attention_reference`. `block_n` and `splits` are for tests; the defaults serve decoding."""
    check(q, keys, values, length)
    if splits is None:
        splits = num_splits(keys.shape[2], keys.shape[1], block_n)
    return _decode_attention(q, keys, values, length, scale, block_n, splits)
