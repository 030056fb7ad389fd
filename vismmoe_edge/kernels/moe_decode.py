"""One token's routed experts, read through the expert table (experts/table.py) with no host in the loop.

`moe_decode(x, index, weights, table_row, pool, act)` looks the router's top-k up in the table on the device,
computes the experts from their slots and flags a miss (an expert the table says is absent). Everything is device
ops of fixed shape, so a CUDA graph replays it; on a miss the output is garbage and the caller redoes the token.

- bf16 / fp16 slot pools, int8 records and int4 records in row-major nibbles on CUDA with Triton: a fused
  gather + GEMV (`_gemv_kernel`, moe_int4.py for int4; for the down projection with the activation and the
  routing weight folded in): each program reads its expert's slot id from the device, then streams a block of
  that expert's rows straight from the pool (int8: codes and row scales, int4: nibbles and group scales and
  zeros, read in place from the slot's record and dequantized in registers). No
  gathered copy of the k experts is made, which the torch path's `index_select` does (it writes and rereads
  k * 9.4 MB per layer at 30B-A3B shapes), and a GEMV at batch 1 reads memory at a far larger fraction of
  its bandwidth than cuBLAS's batched GEMM (the issue's probe: ~610 GB/s of 4.3 TB/s).
- everything else (the CPU, float32 pools, int4 records in tinygemm's tiles, no Triton): the pool's own decode
  functions on the
  looked-up slots (pool_compute.decode_experts, quant_pool.decode_quantized); on the CPU this is exactly the
  computation of the per-layer path, so the CPU stays exact against transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vismmoe_edge.experts.pool_compute import decode_experts
from vismmoe_edge.experts.quant_pool import decode_quantized
from vismmoe_edge.kernels.moe_int4 import HAS_TRITON, INTERPRET, ROUNDING, blocks, gated_int4, gemv_int4, grid
from vismmoe_edge.kernels.slot_matrix import SlotMatrix, record_matrix, use_triton_int4

Act = Callable[[torch.Tensor], torch.Tensor]


def triton_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """`torch.library.triton_op(name)` where Triton is installed. Without it the plain function: torch's decorator
    would log "Triton not available" on every import (stderr a CLI's one-line errors must not carry), and every
    caller checks HAS_TRITON first."""
    if HAS_TRITON:
        return torch.library.triton_op(name, mutates_args=())
    return lambda fn: fn


def moe_decode(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    table_row: torch.Tensor,
    pool: Any,
    act: Act,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H], index and weights [1, k] (device), table_row [E] int32 -> (out [1, H], missed: bool scalar).
    (Experts not in a slot read in place from pinned host memory: `mapped_decode`.)"""
    slots, missed = lookup(index, table_row)
    return pool_decode(x, slots, weights, pool, act), missed


def lookup(index: torch.Tensor, table_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """index [1, k] -> (slots [1, k] long, missed: bool scalar) through the expert table's row. An absent expert
    reads slot 0: the caller discards the token."""
    slots = table_row.index_select(0, index.view(-1)).view(index.shape)
    return slots.clamp_min(0).long(), (slots < 0).any()


def pool_decode(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, pool: Any, act: Act, *, summed: bool = True
) -> torch.Tensor:
    """x [1, H], slots and weights [1, k] -> [1, H] from `pool` (a SlotPoolTier or QuantSlotPoolTier). Not
    `summed`: the Triton paths return each expert's weighted output [k, H] in float32, for the caller to sum
    where it can fuse the sum (kernels/decode_layer.py); the others [1, H] as ever."""
    form = getattr(pool, "form", None)
    if form is not None:
        if use_triton_int8(pool.records, form) or use_triton_int4(pool.records, form):
            return fused_decode_records(x, slots, weights, pool.records, form, act, summed=summed)
        return decode_quantized(x, slots, weights, pool.records, form, act)
    if use_triton(pool.gate_up):
        return fused_decode(x, slots, weights, pool.gate_up, pool.down, act, summed=summed)
    return decode_experts(x, slots, weights, pool.gate_up, pool.down, act)


def mapped_decode(
    x: torch.Tensor,
    index: torch.Tensor,
    table_row: torch.Tensor,
    weights: torch.Tensor,
    host_row: torch.Tensor,
    pool: Any,
    act: Act,
    *,
    summed: bool = True,
    missed: torch.Tensor | None = None,
    staged: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each routed expert read where it is: its slot in the pool, else its copy staged in HBM by the lookahead
    (`staged`: ids [P] int32, records [P, expert elements], where a record's down part starts:
    kernels/mapped_prefetch.py), else its slot-shaped copy in mapped pinned host memory. Two kernels
    (`_gemv_mapped_kernel`): each program looks its expert up in the table and the host row itself, so no address
    tensor is built between them (run 17's profile: the lookup and the sum in torch were ~15 small kernels a layer,
    ~1.9 ms of a 30B-A3B token's GPU time against the resident token's fused layer). For SiLU experts the down GEMV
    computes silu(gate) * up as it loads its input and scales each expert's rows by its routing weight, as the slot
    GEMVs do. Not `summed`: each expert's weighted output [k, H] in float32, for the caller to sum where it fuses
    the sum (kernels/decode_layer.py). The miss flag (an expert in no slot and not mapped: the token is garbage and
    is redone) is written into `missed` [] bool where given (the token's row), by the gate_up kernel's first
    program."""
    import triton

    gate_up, down = pool.gate_up, pool.down
    if gate_up.stride(1) != gate_up.shape[2] or down.stride(1) != down.shape[2]:
        raise ValueError("mapped_decode reads slots of row-major [N, K] matrices, as the host copies are laid out")
    k = index.shape[1]
    ids = index.view(-1)
    mix = weights.view(-1)
    flag = torch.empty((), dtype=torch.bool, device=x.device) if missed is None else missed
    silu = is_silu(act)
    h = torch.empty(k, gate_up.shape[1], dtype=torch.float32, device=x.device)
    staged_ids, records, down_at = staged if staged is not None else (ids, gate_up, 0)  # (unread: STAGED 0)
    count = staged_ids.shape[0] if staged is not None else 0
    common = dict(IS_BF16=gate_up.dtype == torch.bfloat16, TOP_K=k, K_P2=triton.next_power_of_2(k), STAGED=count,
                  STAGED_P2=triton.next_power_of_2(max(count, 1)), **MAPPED_BLOCKS)  # fmt: skip
    stage = (staged_ids, records, records.stride(0) if staged is not None else 0)
    _kernels()[2][(k, triton.cdiv(h.shape[1], MAPPED_BLOCKS["BLOCK_N"]))](
        gate_up, table_row, ids, host_row, x.view(-1), mix, h, flag, h.shape[1], gate_up.shape[2], 0,
        gate_up.stride(0), 0, *stage, 0, SILU=False, ROUND=0, WRITE_MISSED=True, **common,
    )  # fmt: skip
    if not silu:
        gate, up = h.chunk(2, dim=-1)
        h = (act(gate) * up).to(x.dtype)
    y = torch.empty(k, down.shape[1], dtype=torch.float32, device=x.device)
    _kernels()[2][(k, triton.cdiv(y.shape[1], MAPPED_BLOCKS["BLOCK_N"]))](
        down, table_row, ids, host_row, h, mix, y, flag, y.shape[1], down.shape[2], h.stride(0), down.stride(0), 1,
        *stage, down_at, SILU=silu, ROUND=ROUNDING.get(x.dtype, 0), WRITE_MISSED=False, **common,
    )  # fmt: skip
    if not silu:
        y = y * mix[:, None].float()
    return (y.sum(0, keepdim=True).to(x.dtype) if summed else y), flag


# The mapped GEMVs' fixed blocks: run 16's sweep over the bus (tools/device/kernel_sweep.py) found every block shape
# within 4% of 48-50 GB/s, and an autotuner's timing on a first call could fall inside a graph's capture.
MAPPED_BLOCKS = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4}


def gemv_at(
    addrs: torch.Tensor, v: torch.Tensor, n: int, dtype: torch.dtype, *, block_n: int = 32, block_k: int = 256,
    num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """addrs [k] int64: the address of a row-major [n, K] matrix of `dtype` each (device memory or mapped pinned
    host memory); v [k, K] -> [k, n] float32. Fixed blocks (an autotuner's timing on the first call could fall
    inside a graph's capture): run 16's sweep over the bus (tools/device/kernel_sweep.py) found every block shape
    within 4% of 48-50 GB/s, the shipped one among them."""
    import triton

    k, kk = v.shape
    v = v if v.stride(-1) == 1 else v.contiguous()  # an input shared by the k experts keeps stride 0: no copy
    out = torch.empty(k, n, dtype=torch.float32, device=v.device)
    block_k = min(block_k, triton.next_power_of_2(kk))
    grid = (k, triton.cdiv(n, block_n))
    _kernels()[1][grid](addrs, v, out, n, kk, v.stride(0), IS_BF16=dtype == torch.bfloat16, BLOCK_N=block_n,
                        BLOCK_K=block_k, num_warps=num_warps)  # fmt: skip
    return out


def use_triton(w: torch.Tensor) -> bool:
    """The kernels read rows of contiguous columns: a transposed pool view (hub-layout unified slots) cannot."""
    dtype_ok = w.dtype in (torch.bfloat16, torch.float16) and w.stride(-1) == 1
    return HAS_TRITON and (w.is_cuda or INTERPRET) and dtype_ok


def use_triton_int8(records: torch.Tensor, form: Any) -> bool:
    """int8 records (row-major codes, one bf16 scale per row: quant/record.py) on CUDA with Triton."""
    return HAS_TRITON and (records.is_cuda or INTERPRET) and form.spec.quant.bits == 8


def fused_decode(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Act,
    *,
    summed: bool = True,
) -> torch.Tensor:
    """The Triton path over float pools [S, 2I, H] and [S, H, I]."""
    y = _two_gemvs(x, slots, weights, act, SlotMatrix.of_pool(gate_up), SlotMatrix.of_pool(down))
    return y.sum(0, keepdim=True).to(x.dtype) if summed else y


def fused_decode_records(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    records: torch.Tensor,
    form: Any,
    act: Act,
    *,
    summed: bool = True,
) -> torch.Tensor:
    """The Triton path over quantized records [S, nbytes] (use_triton_int8, use_triton_int4): codes and scales
    read in place from each slot's record and dequantized in registers, summed in float32 (int8: w = code *
    scale; int4 in row-major nibbles: w = (code - 8) * scale + zero per group)."""
    matrices = [record_matrix(records, form, m) for m in ("gate_up_proj", "down_proj")]
    y = _two_gemvs(x, slots, weights, act, *matrices)
    return y.sum(0, keepdim=True).to(x.dtype) if summed else y


def _two_gemvs(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, act: Act, gate_up: SlotMatrix,
               down: SlotMatrix) -> torch.Tensor:  # fmt: skip
    """gate_up GEMV over the k slots; for SiLU experts (every family we run) the down GEMV computes
    silu(gate) * up as it loads its input and scales each expert's rows by its routing weight, so a layer is two
    kernels (int4: the gate_up GEMV ends in the activation, moe_int4.gated_int4, and the down GEMV loads it);
    other activations run in torch between the GEMVs. Returns each expert's weighted output [k, H] in float32; the
    inner activation is rounded to the compute dtype, as transformers' bf16 experts do."""
    k = slots.shape[1]
    # As the router returns them (slots int64, weights in the compute dtype): the kernels widen both as they load,
    # where a cast here was two copy kernels a layer outside the compiled regions (run 10's profile).
    slot_ids = slots.view(-1)
    mix = weights.view(-1)
    if gate_up.group and is_silu(act):
        a = gated_int4(gate_up, slot_ids, x.view(1, -1).expand(k, -1), x.dtype)  # [k, I] in x's dtype
        return gemv_int4(down, slot_ids, a, mix, weigh=True)  # [k, H] float32, weighted
    h = gemv(gate_up, slot_ids, x.view(1, -1).expand(k, -1), mix)  # [k, 2I] float32
    if is_silu(act):
        return gemv(down, slot_ids, h, mix, silu_of=x.dtype)  # [k, H] float32, weighted
    gate, up = h.chunk(2, dim=-1)
    return gemv(down, slot_ids, (act(gate) * up).to(x.dtype), mix) * mix[:, None]


def is_silu(act: Act) -> bool:
    """SiLU as torch or transformers spell it (ACT2FN["silu"] is transformers' SiLUActivation: F.silu)."""
    return act is F.silu or isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def gemv(
    w: SlotMatrix, slot_ids: torch.Tensor, v: torch.Tensor, mix: torch.Tensor, *, silu_of: torch.dtype | None = None
) -> torch.Tensor:
    """slot_ids [k] (int32 or int64) -> [k, N] float32: out[e] = W[slot_ids[e]] @ v[e]. `silu_of` (the down
    projection of SiLU experts): v [k, 2K] holds gate | up in float32, the input is silu(gate) * up rounded to that
    dtype, and out[e] is scaled by mix[e] (any float dtype, widened to float32)."""
    if w.group:
        return gemv_int4(w, slot_ids, v, mix, silu_of=silu_of)
    k = slot_ids.shape[0]
    v = v if v.stride(-1) == 1 else v.contiguous()  # an input shared by the k experts keeps stride 0: no copy
    out = torch.empty(k, w.n, dtype=torch.float32, device=w.base.device)
    _kernels()[0][grid(k, w.n)](
        w.base, slot_ids, v, mix, out, w.n, w.k, v.stride(0), w.stride_slot, w.stride_row, w.q_off, w.s_off,
        SILU=silu_of is not None, ROUND=ROUNDING.get(silu_of, 0), INT8=w.int8, **blocks(w.k),
    )  # fmt: skip
    return out


_compiled: tuple | None = None
signed_byte: Any = None  # triton_codes.signed_byte, bound by _kernels() (which imports Triton)
expert_input: Any = None  # triton_inputs.expert_input, likewise


def _kernels():  # type: ignore[no-untyped-def]
    """The Triton kernels, defined on first use (importing triton costs ~1 s, and CPU hosts have none)."""
    global _compiled, signed_byte, expert_input  # (module globals: Triton resolves a kernel's helpers there)
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    from vismmoe_edge.kernels.triton_codes import signed_byte
    from vismmoe_edge.kernels.triton_inputs import expert_input

    def tuned(fn):  # type: ignore[no-untyped-def]
        """GEMV blocks chosen per (N, K) by timing on the first call, which the decoder makes before capture. The
        picks are kept in Triton's cache directory (`cache_results`): a later process on the same GPU (a CLI run, a
        daemon's restart) reads them instead of timing every config again."""
        if INTERPRET:
            return fn
        configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "ACC2D": acc2d}, num_warps=w)
                   for n, k, w, acc2d in ((8, 256, 4, False), (8, 512, 4, False), (16, 256, 4, False),
                                          (16, 512, 8, False), (32, 128, 4, False), (32, 256, 4, False),
                                          (32, 256, 8, False), (64, 128, 4, False), (64, 128, 8, False),
                                          (16, 1024, 8, False),
                                          # few rows, long blocks: more programs, each with fewer dependent loads
                                          (4, 1024, 4, False), (4, 2048, 4, False), (8, 1024, 4, False),
                                          (8, 2048, 8, False),
                                          # products kept per column, reduced across the row once at the end
                                          (8, 256, 4, True), (16, 256, 4, True), (32, 128, 4, True),
                                          (8, 512, 8, True))]  # fmt: skip
        return triton.autotune(configs=configs, key=["N", "K", "INT8"], cache_results=True)(fn)

    # fmt: off
    @tuned
    @triton.jit
    def _gemv_kernel(w, slot_ids, v, mix, out, N, K, stride_v, stride_slot, stride_row, q_off, s_off,
                     SILU: tl.constexpr, ROUND: tl.constexpr, INT8: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, ACC2D: tl.constexpr = False):
        # fmt: on
        # ACC2D: each column's products summed over the blocks, the row's reduction (a shuffle across threads)
        # made once after the loop instead of once per block; which is faster is the autotuner's call
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ids + e).to(tl.int64)
        if INT8:  # w is the uint8 records: this slot's codes (int8, row-major) and row scales (bf16)
            record = w + slot * stride_slot
            base = (record + q_off).to(tl.pointer_type(tl.int8))
        else:
            base = w + slot * stride_slot
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            a = expert_input(v, e, stride_v, cols, K, SILU, ROUND)  # SILU: silu(gate) * up from [gate | up]
            ptrs = base + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
            b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0)
            if INT8:  # the same values as an int-to-float conversion, without one per weight (triton_codes.py)
                b = signed_byte(b)
            else:
                b = b.to(tl.float32)
            if ACC2D:
                acc2 += b * a[None, :]
            else:
                acc += tl.sum(b * a[None, :], axis=1)
        if ACC2D:
            acc = tl.sum(acc2, axis=1)
        if INT8:
            scales = (record + s_off).to(tl.pointer_type(tl.bfloat16))
            acc = acc * tl.load(scales + rows, mask=rows < N, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.load(mix + e).to(tl.float32)
        tl.store(out + e * N + rows, acc, mask=rows < N)

    @triton.jit
    def _gemv_at_kernel(addrs, v, out, N, K, stride_v, IS_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
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
            a = tl.load(v + e * stride_v + cols, mask=cols < K, other=0.0).to(tl.float32)
            ptrs = base + rows[:, None].to(tl.int64) * K + cols[None, :]
            b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        tl.store(out + e * N + rows, acc, mask=rows < N)

    @triton.jit
    def _gemv_mapped_kernel(pool, table_row, ids, host_row, v, mix, out, missed, N, K, stride_v, stride_slot, part,
                            staged_ids, records, stride_record, record_at, SILU: tl.constexpr, ROUND: tl.constexpr,
                            IS_BF16: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr, STAGED: tl.constexpr,
                            STAGED_P2: tl.constexpr, WRITE_MISSED: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):  # fmt: skip
        # one program: expert e's rows [BLOCK_N] of matrix `part` (0 gate_up, 1 down), from its slot; absent from
        # the slots, from its staged record (STAGED > 0: the lookahead's copies, `record_at` elements into the
        # record), else from the host address the host row gives (0: unmapped, slot 0 is read and the token is
        # redone)
        e = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        expert = tl.load(ids + e).to(tl.int64)
        slot = tl.load(table_row + expert).to(tl.int64)
        host = tl.load(host_row + expert * 2 + part)
        in_pool = pool.to(tl.int64) + tl.maximum(slot, 0) * stride_slot * 2  # bf16 or fp16: 2 bytes an element
        address = tl.where((slot >= 0) | (host == 0), in_pool, host)
        if STAGED > 0:
            s = tl.arange(0, STAGED_P2)
            staged = tl.load(staged_ids + s, mask=s < STAGED, other=-1) == expert
            at = tl.max(tl.where(staged & (s < STAGED), s, -1), axis=0)
            in_record = records.to(tl.int64) + (tl.maximum(at, 0).to(tl.int64) * stride_record + record_at) * 2
            address = tl.where((slot < 0) & (at >= 0), in_record, address)
        if IS_BF16:
            base = address.to(tl.pointer_type(tl.bfloat16))
        else:
            base = address.to(tl.pointer_type(tl.float16))
        if WRITE_MISSED:
            if (e == 0) & (tl.program_id(1) == 0):
                j = tl.arange(0, K_P2)
                routed = tl.load(ids + j, mask=j < TOP_K, other=0).to(tl.int64)
                absent = tl.load(table_row + routed, mask=j < TOP_K, other=0) < 0
                unmapped = tl.load(host_row + routed * 2, mask=j < TOP_K, other=1) == 0
                tl.store(missed, tl.max(tl.where(absent & unmapped & (j < TOP_K), 1, 0), 0).to(tl.int1))
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            a = expert_input(v, e, stride_v, cols, K, SILU, ROUND)  # SILU: silu(gate) * up from [gate | up]
            ptrs = base + rows[:, None].to(tl.int64) * K + cols[None, :]
            b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
            acc += tl.sum(b * a[None, :], axis=1)
        if SILU:
            acc = acc * tl.load(mix + e).to(tl.float32)
        tl.store(out + e * N + rows, acc, mask=rows < N)

    _compiled = (_gemv_kernel, _gemv_at_kernel, _gemv_mapped_kernel)
    return _compiled
