"""One token's routed experts, read through the expert table (experts/table.py) with no host in the loop.

`moe_decode(x, index, weights, table_row, pool, act)` looks the router's top-k up in the table on the device,
computes the experts from their slots and flags a miss (an expert the table says is absent). Everything is device
ops of fixed shape, so a CUDA graph replays it; on a miss the output is garbage and the caller redoes the token.

- bf16 / fp16 slot pools on CUDA with Triton: a fused gather + GEMV (`_gemv_kernel`, then `_gemv_silu_kernel`
  for the down projection with the activation and the routing weight folded in): each program reads its
  expert's slot id from the device, then streams a block of that expert's rows straight from the pool. No
  gathered copy of the k experts is made, which the torch path's `index_select` does (it writes and rereads
  k * 9.4 MB per layer at 30B-A3B shapes), and a GEMV at batch 1 reads memory at a far larger fraction of
  its bandwidth than cuBLAS's batched GEMM (the issue's probe: ~610 GB/s of 4.3 TB/s).
- everything else (the CPU, float32 pools, quantized records, no Triton): the pool's own decode functions on the
  looked-up slots (pool_compute.decode_experts, quant_pool.decode_quantized); on the CPU this is exactly the
  computation of the per-layer path, so the CPU stays exact against transformers.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vismmoe_edge.experts.pool_compute import decode_experts
from vismmoe_edge.experts.quant_pool import decode_quantized

Act = Callable[[torch.Tensor], torch.Tensor]
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def moe_decode(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    table_row: torch.Tensor,
    pool: Any,
    act: Act,
    host_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H], index and weights [1, k] (device), table_row [E] int32 -> (out [1, H], missed: bool scalar).
    `host_row` [E, 2] int64 (ExpertTable.host_addrs[layer]): experts not in a slot are read in place from pinned
    host memory where mapped (the Triton path only)."""
    if host_row is not None:
        slots = table_row.index_select(0, index.view(-1)).view(index.shape)
        return mapped_decode(x, index, slots, weights, host_row, pool, act)
    slots, missed = lookup(index, table_row)
    return pool_decode(x, slots, weights, pool, act), missed


def lookup(index: torch.Tensor, table_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """index [1, k] -> (slots [1, k] long, missed: bool scalar) through the expert table's row. An absent expert
    reads slot 0: the caller discards the token."""
    slots = table_row.index_select(0, index.view(-1)).view(index.shape)
    return slots.clamp_min(0).long(), (slots < 0).any()


def pool_decode(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pool: Any, act: Act) -> torch.Tensor:
    """x [1, H], slots and weights [1, k] -> [1, H] from `pool` (a SlotPoolTier or QuantSlotPoolTier)."""
    form = getattr(pool, "form", None)
    if form is not None:
        return decode_quantized(x, slots, weights, pool.records, form, act)
    if use_triton(pool.gate_up):
        return fused_decode(x, slots, weights, pool.gate_up, pool.down, act)
    return decode_experts(x, slots, weights, pool.gate_up, pool.down, act)


def mapped_decode(
    x: torch.Tensor,
    index: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    host_row: torch.Tensor,
    pool: Any,
    act: Act,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' weight addresses, each in its slot or else in mapped host memory, then the address GEMVs."""
    slots = slots.view(-1)
    host = host_row.index_select(0, index.view(-1))  # [k, 2]
    in_slot = slots >= 0
    missed = (~in_slot & (host[:, 0] == 0)).any()
    rows = slots.clamp_min(0).long()
    gate_up, down = pool.gate_up, pool.down
    gu = torch.where(in_slot, gate_up.data_ptr() + rows * gate_up[0].nbytes, host[:, 0])
    dn = torch.where(in_slot, down.data_ptr() + rows * down[0].nbytes, host[:, 1])
    gu = torch.where(gu == 0, gate_up.data_ptr(), gu)  # an unmapped absent expert reads slot 0: the token is redone
    dn = torch.where(dn == 0, down.data_ptr(), dn)
    k = slots.shape[0]
    h = gemv_at(gu, x.view(1, -1).expand(k, -1), gate_up.shape[1], gate_up.dtype)  # [k, 2I] float32
    gate, up = h.chunk(2, dim=-1)
    y = gemv_at(dn, (act(gate) * up).to(x.dtype), down.shape[1], down.dtype)  # [k, H] float32
    return (y * weights[0, :, None].float()).sum(0, keepdim=True).to(x.dtype), missed


def gemv_at(addrs: torch.Tensor, v: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """addrs [k] int64: the address of a row-major [n, K] matrix of `dtype` each (device memory or mapped pinned
    host memory); v [k, K] -> [k, n] float32."""
    import triton

    k, kk = v.shape
    out = torch.empty(k, n, dtype=torch.float32, device=v.device)
    block_n, block_k = 32, 256 if kk >= 256 else triton.next_power_of_2(kk)
    grid = (k, triton.cdiv(n, block_n))
    _kernels()[1][grid](addrs, v.contiguous(), out, n, kk, IS_BF16=dtype == torch.bfloat16, BLOCK_N=block_n,
                        BLOCK_K=block_k)  # fmt: skip
    return out


def use_triton(w: torch.Tensor) -> bool:
    """The kernels read rows of contiguous columns: a transposed pool view (hub-layout unified slots) cannot."""
    dtype_ok = w.dtype in (torch.bfloat16, torch.float16) and w.stride(-1) == 1
    return HAS_TRITON and (w.is_cuda or INTERPRET) and dtype_ok


def fused_decode(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act
) -> torch.Tensor:
    """The Triton path: gate_up GEMV over the k slots; for SiLU experts (every family we run) the down GEMV
    computes silu(gate) * up as it loads its input and scales each expert's rows by its weight, so a layer is two
    kernels and a sum; other activations take the activation in torch between the GEMVs. Accumulates in
    float32; the inner activation is rounded to the weights' dtype, as transformers' bf16 experts do."""
    k = slots.shape[1]
    slot_ids = slots.view(-1).to(torch.int32)
    h = gemv(gate_up, slot_ids, x.view(1, -1).expand(k, -1))  # [k, 2I] float32
    if is_silu(act):
        y = gemv_silu(down, slot_ids, h, weights.view(-1).float(), x.dtype)  # [k, H] float32, weighted
        return y.sum(0, keepdim=True).to(x.dtype)
    gate, up = h.chunk(2, dim=-1)
    inner = (act(gate) * up).to(x.dtype)
    y = gemv(down, slot_ids, inner)  # [k, H] float32
    return (y * weights[0, :, None].float()).sum(0, keepdim=True).to(x.dtype)


def is_silu(act: Act) -> bool:
    """SiLU as torch or transformers spell it (ACT2FN["silu"] is transformers' SiLUActivation: F.silu)."""
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def gemv(w: torch.Tensor, slot_ids: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """w [S, N, K] (a pool), slot_ids [k] int32, v [k, K] -> [k, N] float32: out[e] = w[slot_ids[e]] @ v[e]."""
    k = slot_ids.shape[0]
    _, n, kk = w.shape
    out = torch.empty(k, n, dtype=torch.float32, device=w.device)
    kernel = _kernels()[0]
    kernel[_grid(k, n)](w, slot_ids, v.contiguous(), out, n, kk, w.stride(0), w.stride(1), **_blocks(kk))
    return out


def gemv_silu(
    w: torch.Tensor, slot_ids: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """w [S, N, I] (the down pool), h [k, 2I] float32 (gate | up), scale [k] float32 ->
    [k, N] float32: out[e] = scale[e] * w[slot_ids[e]] @ round(silu(gate[e]) * up[e])."""
    k = slot_ids.shape[0]
    _, n, kk = w.shape
    out = torch.empty(k, n, dtype=torch.float32, device=w.device)
    kernel = _kernels()[2]
    kernel[_grid(k, n)](w, slot_ids, h.contiguous(), scale.contiguous(), out, n, kk, w.stride(0), w.stride(1),
                        ROUND_BF16=dtype == torch.bfloat16, **_blocks(kk))  # fmt: skip
    return out


def _grid(k: int, n: int) -> Callable[[dict], tuple[int, int]]:
    return lambda meta: (k, -(-n // meta["BLOCK_N"]))


def _blocks(kk: int) -> dict[str, int]:
    """Fixed blocks in the interpreter (the CPU tests); on the GPU the autotuner picks them per shape."""
    if not INTERPRET:
        return {}
    import triton

    return {"BLOCK_N": 32, "BLOCK_K": 256 if kk >= 256 else triton.next_power_of_2(kk)}


_compiled: tuple | None = None


def _kernels():  # type: ignore[no-untyped-def]
    """The Triton kernels, defined on first use (importing triton costs ~1 s, and CPU hosts have none)."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    def tuned(fn):  # type: ignore[no-untyped-def]
        """GEMV blocks chosen per (N, K) by timing on the first call, which the decoder makes before capture."""
        if INTERPRET:
            return fn
        configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                   for n, k, w in ((8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 128, 4),
                                   (32, 256, 4), (32, 256, 8), (64, 128, 4), (64, 128, 8), (16, 1024, 8))]  # fmt: skip
        return triton.autotune(configs=configs, key=["N", "K"])(fn)

    @tuned
    @triton.jit
    def _gemv_kernel(w, slot_ids, v, out, N, K, stride_slot, stride_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ids + e).to(tl.int64)
        base = w + slot * stride_slot
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            a = tl.load(v + e * K + cols, mask=cols < K, other=0.0).to(tl.float32)
            ptrs = base + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
            b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        tl.store(out + e * N + rows, acc, mask=rows < N)

    @tuned
    @triton.jit
    def _gemv_silu_kernel(w, slot_ids, h, scale, out, N, K, stride_slot, stride_row, ROUND_BF16: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        # K is the inner size I; h holds [gate (I) | up (I)] per expert, float32
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ids + e).to(tl.int64)
        base = w + slot * stride_slot
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            gate = tl.load(h + e * 2 * K + cols, mask=cols < K, other=0.0)
            up = tl.load(h + e * 2 * K + K + cols, mask=cols < K, other=0.0)
            a = gate * tl.sigmoid(gate) * up
            if ROUND_BF16:  # the inner activation in the weights' dtype, as the torch path rounds it
                a = a.to(tl.bfloat16).to(tl.float32)
            else:
                a = a.to(tl.float16).to(tl.float32)
            ptrs = base + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
            b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        tl.store(out + e * N + rows, acc * tl.load(scale + e), mask=rows < N)

    @triton.jit
    def _gemv_at_kernel(addrs, v, out, N, K, IS_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        address = tl.load(addrs + e)
        if IS_BF16:
            base = address.to(tl.pointer_type(tl.bfloat16))
        else:
            base = address.to(tl.pointer_type(tl.float16))
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            a = tl.load(v + e * K + cols, mask=cols < K, other=0.0).to(tl.float32)
            ptrs = base + rows[:, None].to(tl.int64) * K + cols[None, :]
            b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        tl.store(out + e * N + rows, acc, mask=rows < N)

    _compiled = (_gemv_kernel, _gemv_at_kernel, _gemv_silu_kernel)
    return _compiled
