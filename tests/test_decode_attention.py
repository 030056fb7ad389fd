"""The split-KV decode attention (kernels/decode_attention.py): its torch reference against SDPA always, the
Triton kernels under TRITON_INTERPRET=1 (the CPU has no other Triton)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.kernels.decode_attention import decode_attention, decode_attention_reference, num_splits

interpreter = pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")

# (heads, kv_heads, d, capacity): Qwen3-VL-30B-A3B's group of 8 at head_dim 128, and the tiny test model's
SHAPES = [(32, 4, 128, 256), (4, 2, 32, 96)]


def inputs(heads: int, kv_heads: int, d: int, capacity: int, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 1, d, generator=g).to(dtype)
    keys = torch.randn(1, kv_heads, capacity, d, generator=g).to(dtype)
    values = torch.randn(1, kv_heads, capacity, d, generator=g).to(dtype)
    return q, keys, values


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """decode_layer's compiled path before the kernel: K/V repeated per group, SDPA with the additive mask."""
    heads, kv_heads, capacity, d = q.shape[1], *keys.shape[1:]
    groups = heads // kv_heads
    mask = torch.zeros(capacity, dtype=q.dtype).masked_fill(torch.arange(capacity) > length, torch.finfo(q.dtype).min)
    kk = keys[:, :, None].expand(1, kv_heads, groups, capacity, d).reshape(1, heads, -1, d)
    vv = values[:, :, None].expand(1, kv_heads, groups, capacity, d).reshape(1, heads, -1, d)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask.view(1, 1, 1, -1), scale=scale)


def lengths(capacity: int, block: int) -> list[int]:
    """0, either side of a block boundary, and the last position."""
    return [0, block - 1, block, block + 1, capacity - 1]


@pytest.mark.parametrize("heads,kv_heads,d,capacity", SHAPES)
def test_reference_matches_sdpa(heads: int, kv_heads: int, d: int, capacity: int) -> None:
    q, keys, values = inputs(heads, kv_heads, d, capacity, torch.float32)
    for length in lengths(capacity, 64):
        ref = decode_attention_reference(q, keys, values, torch.tensor([length]), d**-0.5)
        assert ref.shape == (1, heads, 1, d)
        torch.testing.assert_close(ref, sdpa(q, keys, values, length, d**-0.5), rtol=1e-5, atol=1e-5)
    # position 0 alone: the output is its value row, per query head's KV head
    ref = decode_attention_reference(q, keys, values, torch.tensor([0]), d**-0.5)
    torch.testing.assert_close(ref[0, :, 0], values[0, :, 0].repeat_interleave(heads // kv_heads, 0))


def test_splits_give_every_capacity_enough_programs() -> None:
    for capacity in (512, 1536, 4096, 32768):
        splits = num_splits(capacity, 4)
        blocks = -(-capacity // 64)
        per_split = -(-blocks // splits)
        assert (splits - 1) * per_split < blocks <= splits * per_split  # every split holds at least one block
        assert 32 <= 4 * splits <= 256 or splits == blocks
    assert num_splits(100, 4, 16) == 7  # fewer blocks than programs wanted: one block a split


def test_preconditions_are_checked() -> None:
    q, keys, values = inputs(4, 2, 32, 64, torch.float32)
    length = torch.tensor([3])
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(q, keys.transpose(2, 3).contiguous().transpose(2, 3), values, length, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention(q[..., :24], keys[..., :24].contiguous(), values[..., :24].contiguous(), length, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q[:, :3], keys, values, length, 1.0)
    with pytest.raises(ValueError, match="long"):
        decode_attention(q, keys, values, length.int(), 1.0)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d,capacity", SHAPES)
def test_kernel_matches_sdpa_and_the_reference(heads: int, kv_heads: int, d: int, capacity: int,
                                               dtype: torch.dtype) -> None:  # fmt: skip
    q, keys, values = inputs(heads, kv_heads, d, capacity, dtype, seed=1)
    # small blocks keep the interpreter fast and give several splits of several blocks: 16 blocks in 8 splits,
    # or 6 in 3 for the tiny shape (so lengths past a split's start skip whole splits and blocks)
    block, splits = 16, capacity // 32
    for length in lengths(capacity, block):
        n = torch.tensor([length])
        out = decode_attention(q, keys, values, n, d**-0.5, block_n=block, splits=splits)
        assert out.shape == (1, heads, 1, d) and out.dtype == dtype
        ref = decode_attention_reference(q, keys, values, n, d**-0.5)
        base = sdpa(q.float(), keys.float(), values.float(), length, d**-0.5)
        if dtype == torch.float32:  # the same float32 math in another order
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out, sdpa(q, keys, values, length, d**-0.5), rtol=1e-5, atol=1e-5)
        else:
            # bf16: P is rounded to bf16 (8 bits) before P @ V, as flash attention does, and the output is
            # rounded to bf16: a few bf16 ulps of outputs of magnitude <~ 1 (values ~ N(0, 1), softmax-weighted).
            # The reference and SDPA run in float32 on the same bf16 inputs.
            assert (out.float() - ref.float()).abs().max() <= 2e-2
            assert (out.float() - base).abs().max() <= 2e-2
        if length == 0:  # one visible position: its value row, exactly
            assert torch.equal(out[0, :, 0], values[0, :, 0].repeat_interleave(heads // kv_heads, 0))


@interpreter
def test_kernel_default_splits() -> None:
    q, keys, values = inputs(4, 2, 32, 128, torch.float32, seed=2)
    for length in (77, 5):  # the length is read on the device: one launch shape serves every length
        n = torch.tensor([length])
        ref = decode_attention_reference(q, keys, values, n, 0.2)
        torch.testing.assert_close(decode_attention(q, keys, values, n, 0.2), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not md.HAS_TRITON or md.INTERPRET, reason="needs Triton compiled (the interpreter's kernels "
                    "are not traceable)")  # fmt: skip
def test_the_op_traces_whole() -> None:
    """torch.export traces the triton_op as one opaque op through its fake implementation (the op's body run on
    fake tensors, the kernels' launches traced, not run), as torch.compile(fullgraph=True) does; inductor then
    decomposes it into the two kernels (the GPU check tools/device/decode_checks.py runs that)."""

    class Attend(torch.nn.Module):
        def forward(self, q, keys, values, n):  # type: ignore[no-untyped-def]
            return decode_attention(q, keys, values, n, 0.2)

    q, keys, values = inputs(4, 2, 32, 128, torch.bfloat16)
    graph = torch.export.export(Attend(), (q, keys, values, torch.tensor([7]))).graph
    calls = [node.target for node in graph.nodes if node.op == "call_function"]
    assert calls == [torch.ops.vismmoe_edge.decode_attention.default]
    assert list(graph.nodes)[-1].args[0][0].meta["val"].shape == (1, 4, 1, 32)
