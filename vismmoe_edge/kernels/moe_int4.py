"""The Triton GEMV over int4 expert records, read in place from the slot pool (moe_decode.fused_decode_records).

A slot holds the record of quant/record.py with its codes in row-major nibbles (packing.ROWMAJOR: byte j of
row n = code[n, 2j] | code[n, 2j+1] << 4; slot_form.SlotForm.for_device(..., triton=True)) and the scales as
stored, `scales_zeros` bf16 [K/g, N, 2], so W[n, c] = (code - 8) * scale + zero for c's group. Each program
reads its expert's slot id on the device and streams a block of rows: per block of bytes, the low nibbles meet
the even inputs and the high nibbles the odd ones (no interleave in registers), the products are summed per
group, and each group's sum is scaled once: sum_c W[n, c] a[c] = sum_groups scale * sum (code - 8) a + zero *
sum a. Accumulation is float32. Groups are powers of two (slot_form.triton_group_ok), so a block of codes
covers whole groups or lies inside one.

Half the bytes of int8 and a quarter of bf16 per weight: at 30B-A3B shapes a layer's 8 records are 20.1 MB.

WORDS (configs the autotuner may pick): run 16 (docs/benchmarks.md) found this GEMV at 3.4x its bytes inside a
token, and the same loop with no input at all nearly as slow: the cost is in turning codes into floats (~5
instructions a code in the byte loop: at 30B-A3B shapes about as long to issue as the codes take to arrive). With
WORDS a program reads its codes as 32-bit words of 8 codes and makes each code's float with one shift and one
mask-and-or: the code under the mantissa of 1.0, f = 1 + code / 16, exactly; each nibble position meets its own
inputs (column 8t + i for nibble i of word t), and since code - 8 = 16 f - 24, a group's sum (code - 8) a = 16 sum f
a - 24 sum a, the second sum being the one the zero point needs anyway. Three instructions a code (shift, LOP3,
FMA). It needs 4-byte aligned rows (`words_fit`); f * a stays within 2|a|, so float32 keeps ~21 bits of the result
after the subtraction. Alone with L2 evicted on an H100 (tools/device/kernel_sweep.py), gate_up at 30B-A3B shapes
took 14.4 us with WORDS against 17.1 reading bytes; the down projection, whose SiLU input the word loop gathers per
nibble position, was slower with it (13.4 against 12.6): the autotuner picks per shape.

GATED (`gated_int4`, the gate_up projection of SiLU experts): a program takes BLOCK_N / 2 gate rows and the same
up rows and writes silu(gate) * up, so the down GEMV loads its input as it is instead of computing it from
[gate | up] in every one of its programs (and in WORDS, once per nibble position). Run 17 (docs/benchmarks.md): the
down GEMV alone 11.0 us against 12.6; the int4 GEMVs of a token 19.2 us a layer against 23.1, int4 1.16x bf16. Nsight
Compute found the gate_up kernel bound by issuing instructions (~9.8 a code), not by its bytes.

DOT (configs the autotuner takes only with VISMMOE_INT4_DOT=1, and then where a group is 128 codes or more and the
input is bf16, `dot_fit`): the products are summed by tensor cores. A step takes one group: each 32-bit word's
nibbles i and i + 4 are moved to bits 3-6 of the word's two halves with one shift and put under bf16 16.0's exponent
with one mask-and-or (`codes_bf16`: two exact bf16 values 16 + code), the eight such halves are joined into a [rows,
group] tile whose inner order keeps each word's pair side by side (position 8t + 2i + h holds column 8t + i + 4h, so
a word's halves are the register pair a tensor core takes), and one dot multiplies it by the group's inputs, gathered
in that order, in column 0 of 16 (a dot is at least 16 wide; the other columns are zero). A group's sum of (code - 8)
a is then the dot's minus 24 sum a, scaled once, as WORDS does; bf16 products are exact and the dot sums them in
float32. Compiled for sm_90 on the CPU (tools/int4_sass.py) the step is 3.8 thread instructions a code at 128 rows
and 4 warps (wgmma; 4.3 with the group's columns in order) against 10.1 for the byte loop the autotuner picked in run
17 and 5.4-7.1 for WORDS. Run 18 (an H100, docs/benchmarks.md) measured it slower: alone with L2 evicted every DOT
config took longer than the six fastest WORDS and byte configs (> 17.5 us for gate_up ending in the activation, WORDS
14.1), and Nsight Compute timed the picks at 27.5 us (32 rows, 2 warps) and 27.7 us (128 rows, 4 warps; 2.4x fewer
instructions than the byte loop, 3.19 M) with one or two warps a scheduler: each warp issues one instruction every ~5
cycles and has ~8 K of them, so the loop waits on its own dependency chains, not on bytes or issue slots. So DOT
configs now take SPLIT: a row block's groups are shared by SPLIT programs, each storing its float32 sums
(`split_scratch`) and counting itself with an atomic add; the last adds the parts in part order (the same bits every
launch), applies the activation or routing weight and resets the count. Run 19 (an H100) timed SPLIT 4 at 21.6 us
for gate_up alone and cold, SPLIT 2-3 at 14.9 for down, against WORDS's 14.2 and 10.9: DOT stays off by default.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DOT_VARIABLE = "VISMMOE_INT4_DOT"  # "1": the autotuner may pick DOT configs too (the module's docstring)
ROUNDING = {torch.bfloat16: 1, torch.float16: 2}  # the inner activation's rounding; float32 keeps it (0)


def gemv_int4(
    w: Any,
    slot_ids: torch.Tensor,
    v: torch.Tensor,
    mix: torch.Tensor,
    *,
    silu_of: torch.dtype | None = None,
    weigh: bool = False,
) -> torch.Tensor:
    """w: a slot_matrix.SlotMatrix of int4 records (`group` > 0). slot_ids [k] (int32 or int64) -> [k, N] float32:
    out[e] = W[slot_ids[e]] @ v[e]; `silu_of` as moe_decode.gemv (v [k, 2K] gate | up in float32, the input
    silu(gate) * up rounded to that dtype (float32: not rounded), out[e] scaled by mix[e]); `weigh`: out[e] scaled
    by mix[e] with v the input as it is (the down projection after `gated_int4`)."""
    return _launch(w, slot_ids, v, mix, w.n, SILU=silu_of is not None, ROUND=ROUNDING.get(silu_of, 0),
                   WEIGH=weigh or silu_of is not None)  # fmt: skip


def gated_int4(w: Any, slot_ids: torch.Tensor, x: torch.Tensor, act_of: torch.dtype) -> torch.Tensor:
    """The gate_up projection of SiLU experts ending in their activation: w [2I, K] int4 records (gate rows, then
    up rows), x [k, K] -> [k, I] silu(W_gate x) * (W_up x) rounded to `act_of` and held in it (float32: not
    rounded), the values the down GEMV's SILU input computes; a bf16 result lets the down GEMV take DOT configs.
    A program takes a block of gate rows and the same up rows, so the down GEMV loads its input instead of
    computing it in every one of its programs (run 16's sweep: ~2 us of the down GEMV's ~12 us alone; and WORDS,
    which gathers the input per nibble position, paid it eight times)."""
    dtype = act_of if act_of in ROUNDING else torch.float32  # the values are act_of's: kept in it, exactly
    return _launch(w, slot_ids, x, slot_ids, w.n // 2, dtype, GATED=True, ROUND=ROUNDING.get(act_of, 0))


def _launch(
    w: Any, slot_ids: torch.Tensor, v: torch.Tensor, mix: torch.Tensor, width: int,
    dtype: torch.dtype = torch.float32, **flags: Any,
) -> torch.Tensor:  # fmt: skip
    """[k, width] of `dtype` from the kernel over `w`'s N rows; flags: the kernel's SILU, GATED, WEIGH, ROUND."""
    k = slot_ids.shape[0]
    v = v if v.stride(-1) == 1 else v.contiguous()  # an input shared by the k experts keeps stride 0: no copy
    out = torch.empty(k, width, dtype=dtype, device=w.base.device)
    flags = {"SILU": False, "GATED": False, "WEIGH": False, "ROUND": 0, "IEEE": INTERPRET, **flags}
    partials, counters = split_scratch(w.base.device, k, w.n)
    _kernel()[grid(k, w.n)](
        w.base, slot_ids, v, mix, out, w.n, w.k, v.stride(0), w.stride_slot, w.q_off, w.s_off, partials, counters,
        GROUP=w.group, **flags, **blocks(w.k),
    )  # fmt: skip
    return out


_scratch: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def split_scratch(device: torch.device, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where SPLIT programs leave their partial sums ([k, blocks, SPLIT, BLOCK_N] float32, at most k * (n + 256)
    * MAX_SPLIT) and count themselves (one int32 a row block, zero between launches: the last program of a block
    resets it). One pair per device and shape, made on the first call, before any graph capture; launches on one
    stream are ordered, and a process decodes a token at a time, so they never overlap."""
    key = (device, k, n)
    if key not in _scratch:
        _scratch[key] = (
            torch.empty(k * (n + 256) * MAX_SPLIT, dtype=torch.float32, device=device),
            torch.zeros(k * -(-n // 8), dtype=torch.int32, device=device),
        )
    return _scratch[key]


def grid(k: int, n: int) -> Callable[[dict], tuple[int, int]]:
    """One program per (expert, block of rows, SPLIT part of the row's groups): the grid of every slot GEMV here and
    in moe_decode.py (a GATED program's block is half gate rows, half up rows: as many programs as over all 2I
    rows; SPLIT is 1 but in DOT configs)."""
    return lambda meta: (k, -(-n // meta["BLOCK_N"]), meta.get("SPLIT", 1))


def blocks(kk: int) -> dict[str, int]:
    """Fixed blocks in the interpreter (the CPU tests); on the GPU the autotuner picks them per shape."""
    if not INTERPRET:
        return {}
    import triton

    return {"BLOCK_N": 32, "BLOCK_K": 256 if kk >= 256 else max(2, triton.next_power_of_2(kk))}


# (BLOCK_N, BLOCK_K in codes, warps) of the autotuner's WORDS configs
WORDS_CONFIGS = ((8, 1024, 4), (8, 2048, 4), (16, 512, 4), (16, 1024, 4), (32, 256, 4), (32, 512, 8),
                 (64, 256, 8), (16, 2048, 8))  # fmt: skip

# (BLOCK_N, warps, pipeline stages, SPLIT) of the DOT configs (the autotuner's with VISMMOE_INT4_DOT=1). Triton's
# SASS for sm_90 (tools/int4_sass.py) has a group's step at 3.8 thread instructions a code for 128 rows and 4 warps
# (wgmma), 5.4 for 64 rows, more for 16-32 rows (the input's tile costs the same for any rows). SPLIT programs
# share a row block's groups: run 18 timed one program a block (SPLIT 1, no longer tried) at twice WORDS's time,
# one warp a scheduler (the module's docstring); a SPLIT that does not divide a matrix's groups is pruned (dot_fit),
# which leaves each 30B-A3B kernel six configs to tune
DOT_CONFIGS = tuple((n, 4, 3, split) for n in (64, 128) for split in (2, 3, 4, 6, 8))
MAX_SPLIT = 8

_compiled: Any = None
centered: Any = None  # triton_codes.centered, bound by _kernel() (which imports Triton)
input_at: Any = None  # the GEMV's input at some columns, bound by _kernel()
silu_mul: Any = None  # silu(gate) * up, rounded: bound by _kernel()
codes_bf16: Any = None  # two nibbles of a word of codes as bf16 16 + code: bound by _kernel()


def dot_configs() -> list:
    """The autotune configs of DOT, the products summed by tensor cores (a group a step, so BLOCK_K is unused)."""
    import triton

    return [triton.Config({"BLOCK_N": n, "BLOCK_K": 128, "DOT": True, "SPLIT": split}, num_warps=w, num_stages=st)
            for n, w, st, split in DOT_CONFIGS]  # fmt: skip


def words_fit(configs: list, named_args: dict, **kwargs: Any) -> list:
    """The autotuner's pruning: WORDS configs only where every row of codes starts on a 4-byte boundary and a
    group is whole words (the record's codes offset, a slot's stride, K / 2 bytes a row all multiples of 4)."""
    if words_aligned(named_args, kwargs.get("GROUP", 0)):
        return configs
    return [c for c in configs if not c.kwargs.get("WORDS", False)]


def words_aligned(named_args: dict, group: int) -> bool:
    """Every row of codes starts on a 4-byte boundary and a group is whole 32-bit words."""
    aligned = named_args["q_off"] % 4 == 0 and named_args["stride_slot"] % 4 == 0 and named_args["K"] % 8 == 0
    return aligned and group % 8 == 0


def dot_fit(configs: list, named_args: dict, **kwargs: Any) -> list:
    """DOT configs only where a group is at least 16 words (a dot's inner size is at least 16), rows are whole
    words, and the input is bf16 exactly (a bf16 tensor, or the SiLU input rounded to bf16): the tensor cores
    multiply bf16 values; and only those whose SPLIT divides a row's groups."""
    group = kwargs.get("GROUP", 0)
    exact = named_args["v"].dtype == torch.bfloat16 or (kwargs.get("SILU", False) and kwargs.get("ROUND", 0) == 1)
    if group >= 128 and words_aligned(named_args, group) and exact:
        groups = named_args["K"] // group
        return [c for c in configs if groups % c.kwargs.get("SPLIT", 1) == 0]
    return [c for c in configs if not c.kwargs.get("DOT", False)]


def configs_fit(configs: list, named_args: dict, **kwargs: Any) -> list:
    """The autotuner's pruning: words_fit, then dot_fit."""
    return dot_fit(words_fit(configs, named_args, **kwargs), named_args, **kwargs)


def _kernel():  # type: ignore[no-untyped-def]
    """Defined on first use (importing triton costs ~1 s, and CPU hosts have none)."""
    global _compiled
    if _compiled is not None:
        return _compiled
    import triton
    import triton.language as tl

    global centered, codes_bf16, input_at, silu_mul  # module globals: Triton resolves a kernel's helpers there
    from vismmoe_edge.kernels.triton_codes import centered

    @triton.jit
    def silu_mul(gate, up, ROUND: tl.constexpr):  # type: ignore[no-redef]
        """silu(gate) * up in float32, rounded to the compute dtype as the torch path rounds it."""
        a = gate * tl.sigmoid(gate) * up
        if ROUND == 1:
            a = a.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            a = a.to(tl.float16).to(tl.float32)
        return a

    @triton.jit
    def codes_bf16(word, NI: tl.constexpr):  # type: ignore[no-redef]
        """Nibbles NI and NI + 4 of 32-bit words of codes as bf16 16 + code, exactly: both moved to bits 3-6 of
        their half with one shift, masked and put under 16.0's exponent (0x4180) with one LOP3."""
        if NI == 0:
            bits = (word << 3) & 0x00780078
        else:
            bits = (word >> (4 * NI - 3)) & 0x00780078
        pair = bits | 0x41804180
        lo = (pair & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        hi = (pair >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return lo, hi

    @triton.jit
    def input_at(v_row, K, cols, SILU: tl.constexpr, ROUND: tl.constexpr):  # type: ignore[no-redef]
        """The GEMV's input at `cols` in float32 (0 past K): v's row, or for the down projection of SiLU experts
        silu(gate) * up from v's [gate (K) | up (K)]."""
        ok = cols < K
        if SILU:
            gate = tl.load(v_row + cols, mask=ok, other=0.0)
            up = tl.load(v_row + K + cols, mask=ok, other=0.0)
            a = silu_mul(gate, up, ROUND)
        else:  # (a row of stride 0: one input for every expert)
            a = tl.load(v_row + cols, mask=ok, other=0.0).to(tl.float32)
        return a

    def tuned(fn):  # type: ignore[no-untyped-def]
        """Blocks (BLOCK_K in codes: half as many bytes) chosen per (N, K, group) by timing on the first call,
        which the decoder makes before capture."""
        if INTERPRET:
            return fn
        # BLOCK_K 128 at g128 keeps a block inside one group (no reshape); the others sum several groups
        configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w)
                   for n, k, w in ((8, 1024, 4), (16, 512, 4), (16, 1024, 4), (16, 1024, 8), (32, 256, 4),
                                   (32, 512, 4), (32, 512, 8), (32, 1024, 8), (64, 256, 4), (64, 256, 8),
                                   (64, 512, 8), (128, 256, 8), (32, 128, 4), (64, 128, 4), (128, 128, 8),
                                   # few rows, a whole 30B-A3B row a block: run 5 measured the kernel latency-bound
                                   # (6.2x its byte bound), so more programs with one load each
                                   (4, 2048, 4), (8, 2048, 4), (8, 2048, 8), (4, 1024, 2), (8, 512, 2))]  # fmt: skip
        # one group a block (g128), its products kept per column and reduced once at the end (ACC2D)
        configs += [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "ACC2D": True}, num_warps=w)
                    for n, k, w in ((32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8))]  # fmt: skip
        # codes read as words (the module's docstring)
        configs += [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "WORDS": True}, num_warps=w)
                    for n, k, w in WORDS_CONFIGS]  # fmt: skip
        if os.environ.get(DOT_VARIABLE) == "1":
            configs += dot_configs()
        return triton.autotune(configs=configs, key=["N", "K", "GROUP", "SILU", "GATED"], cache_results=True,
                               prune_configs_by={"early_config_prune": configs_fit})(fn)  # fmt: skip

    # fmt: off
    @tuned
    @triton.jit
    def _gemv_int4_kernel(w, slot_ids, v, mix, out, N, K, stride_v, stride_slot, q_off, s_off, partials, counters,
                          GROUP: tl.constexpr, SILU: tl.constexpr, GATED: tl.constexpr, WEIGH: tl.constexpr,
                          ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          ACC2D: tl.constexpr = False, WORDS: tl.constexpr = False, DOT: tl.constexpr = False,
                          SPLIT: tl.constexpr = 1, IEEE: tl.constexpr = False):
        # fmt: on
        tl.static_assert(SPLIT == 1 or DOT, "only the DOT loop splits a row's groups")
        HALF: tl.constexpr = BLOCK_K // 2  # bytes of a row per block
        GB: tl.constexpr = GROUP // 2  # bytes of a row per group
        e = tl.program_id(0)
        if GATED:  # BLOCK_N // 2 gate rows, then the same up rows (N // 2 further on)
            R: tl.constexpr = BLOCK_N // 2
            lane = tl.arange(0, BLOCK_N)
            unit = tl.program_id(1) * R + lane % R  # the output's index: gate row `unit`, up row N // 2 + `unit`
            rows = unit + (lane // R) * (N // 2)
            row_ok = unit < N // 2
        else:
            rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < N
        slot = tl.load(slot_ids + e).to(tl.int64)
        record = w + slot * stride_slot  # this slot's record (uint8)
        codes = record + q_off  # [N, K/2] row-major nibbles
        sz = (record + s_off).to(tl.pointer_type(tl.bfloat16))  # [K/GROUP, N, 2]: (scale, zero)
        kb = K // 2
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_N, HALF), dtype=tl.float32)  # ACC2D: per column, reduced once after the loop
        if DOT:  # the products summed by tensor cores, a group a step (the module's docstring)
            DW: tl.constexpr = GROUP // 8  # words of a row per group
            dot_words = (codes + rows[:, None].to(tl.int64) * kb).to(tl.pointer_type(tl.uint32))
            dt = tl.arange(0, DW)
            dk = tl.arange(0, GROUP)
            dk_cols = 8 * (dk // 8) + (dk % 8) // 2 + 4 * (dk % 2)  # the column at each of the tile's positions
            column0 = (tl.arange(0, 16) == 0).to(tl.float32)[None, :]  # the input in column 0 of a dot's 16
            per_part = (K // GROUP) // SPLIT  # this program's share of the groups (dot_fit: SPLIT divides them)
            first = tl.program_id(2) * per_part
            for gi in range(first, first + per_part):
                dword = tl.load(dot_words + gi * DW + dt[None, :], mask=row_ok[:, None], other=0)
                # nibbles i and i + 4 of each word (columns 8t + i, 8t + i + 4) as two bf16s 16 + code, kept side
                # by side in the dot's inner order (position 8t + 2i + h holds column 8t + i + 4h): a word's 16-bit
                # halves are the pair a tensor-core register takes, with no repacking (run 17's SASS: the group's
                # order cost 85 PRMT a step); the input is gathered in the same order
                n0, n4 = codes_bf16(dword, 0)
                n1, n5 = codes_bf16(dword, 1)
                n2, n6 = codes_bf16(dword, 2)
                n3, n7 = codes_bf16(dword, 3)
                i0, i1, i2, i3 = tl.join(n0, n4), tl.join(n1, n5), tl.join(n2, n6), tl.join(n3, n7)  # [.., h]
                wt = tl.permute(tl.join(tl.join(i0, i2), tl.join(i1, i3)), (0, 1, 3, 4, 2))  # [.., t, s, u, h]
                wt = tl.reshape(wt, (BLOCK_N, GROUP))
                xg = input_at(v + e * stride_v, K, gi * GROUP + dk_cols, SILU, ROUND)  # [GROUP] float32, bf16 values
                xb = (xg[:, None] * column0).to(tl.bfloat16)  # exact: the input is bf16 (dot_fit)
                if IEEE:  # the interpreter, whose dot multiplies bf16's stored bits: float32, exact
                    dsum = tl.dot(wt.to(tl.float32), xb.to(tl.float32), input_precision="ieee")
                else:
                    dsum = tl.dot(wt, xb)
                xsum = tl.sum(xg, axis=0)
                at = (gi * N + rows) * 2
                scale = tl.load(sz + at, mask=row_ok, other=0.0).to(tl.float32)
                zero = tl.load(sz + at + 1, mask=row_ok, other=0.0).to(tl.float32)
                acc += scale * (tl.sum(dsum, axis=1) - 24.0 * xsum) + zero * xsum  # (16 + c) - 24 = c - 8
        elif WORDS:
            WB: tl.constexpr = HALF // 4  # words of a row per block
            GW: tl.constexpr = GROUP // 8  # words of a row per group
            kw = kb // 4
            words_of = (codes + rows[:, None].to(tl.int64) * kb).to(tl.pointer_type(tl.uint32))
            for start in range(0, kw, WB):
                jw = start + tl.arange(0, WB)
                word = tl.load(words_of + jw[None, :], mask=row_ok[:, None] & (jw < kw)[None, :], other=0)
                part = tl.zeros((BLOCK_N, WB), dtype=tl.float32)  # sum f a per word
                a_sum = tl.zeros((WB,), dtype=tl.float32)
                for i in tl.static_range(8):  # nibble i of word t is the code of column 8t + i
                    a_i = input_at(v + e * stride_v, K, 8 * jw + i, SILU, ROUND)  # 0 past K
                    if 4 * i <= 19:  # the nibble to bits 19-22, under the exponent of 1.0
                        bits = (word << (19 - 4 * i)) & 0x780000
                    else:
                        bits = (word >> (4 * i - 19)) & 0x780000
                    f = (bits | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + code / 16, exactly
                    part += f * a_i[None, :]
                    a_sum += a_i
                if WB <= GW:  # the block lies inside one group
                    at = (start // GW * N + rows) * 2
                    scale = tl.load(sz + at, mask=row_ok, other=0.0).to(tl.float32)
                    zero = tl.load(sz + at + 1, mask=row_ok, other=0.0).to(tl.float32)
                    total = tl.sum(a_sum, axis=0)
                    acc += scale * (16.0 * tl.sum(part, axis=1) - 24.0 * total) + zero * total
                else:  # WB // GW whole groups
                    NGW: tl.constexpr = WB // GW
                    groups = start // GW + tl.arange(0, NGW)
                    fa = tl.sum(tl.reshape(part, (BLOCK_N, NGW, GW)), axis=2)  # [BLOCK_N, NGW]
                    a_group = tl.sum(tl.reshape(a_sum, (NGW, GW)), axis=1)
                    at = (groups[None, :] * N + rows[:, None]) * 2
                    m = row_ok[:, None] & (groups[None, :] < K // GROUP)
                    scale = tl.load(sz + at, mask=m, other=0.0).to(tl.float32)
                    zero = tl.load(sz + at + 1, mask=m, other=0.0).to(tl.float32)
                    code_sum = 16.0 * fa - 24.0 * a_group[None, :]  # sum (code - 8) a per group
                    acc += tl.sum(scale * code_sum + zero * a_group[None, :], axis=1)
        else:
            for start in range(0, kb, HALF):
                jb = start + tl.arange(0, HALF)
                ok = jb < kb
                # the step's 2 * HALF inputs in one contiguous load, then split: the byte's low nibble meets the even
                # ones, the high nibble the odd ones (two loads at a stride of two elements each before)
                cols = 2 * start + tl.arange(0, 2 * HALF)
                act = input_at(v + e * stride_v, K, cols, SILU, ROUND)
                a0, a1 = tl.split(tl.reshape(act, (HALF, 2)))
                ptrs = codes + rows[:, None].to(tl.int64) * kb + jb[None, :]
                byte = tl.load(ptrs, mask=row_ok[:, None] & ok[None, :], other=0)
                lo = centered(byte & 15)  # code - 8, exactly, with no int-to-float conversion (triton_codes.py)
                hi = centered(byte >> 4)
                part = lo * a0[None, :] + hi * a1[None, :]  # [BLOCK_N, HALF]; masked bytes meet zero inputs
                a = a0 + a1
                if HALF <= GB:  # the block lies inside one group: one (scale, zero) per row
                    at = (start // GB * N + rows) * 2
                    scale = tl.load(sz + at, mask=row_ok, other=0.0).to(tl.float32)
                    zero = tl.load(sz + at + 1, mask=row_ok, other=0.0).to(tl.float32)
                    if ACC2D:  # no reduction across threads inside the loop
                        acc2 += part * scale[:, None] + zero[:, None] * a[None, :]
                    else:
                        acc += scale * tl.sum(part, axis=1) + zero * tl.sum(a, axis=0)
                else:  # HALF // GB whole groups: sum each, then scale it
                    NG: tl.constexpr = HALF // GB
                    groups = start // GB + tl.arange(0, NG)
                    per_group = tl.sum(tl.reshape(part, (BLOCK_N, NG, GB)), axis=2)  # [BLOCK_N, NG]
                    a_group = tl.sum(tl.reshape(a, (NG, GB)), axis=1)  # [NG]
                    at = (groups[None, :] * N + rows[:, None]) * 2
                    m = row_ok[:, None] & (groups[None, :] < K // GROUP)
                    scale = tl.load(sz + at, mask=m, other=0.0).to(tl.float32)
                    zero = tl.load(sz + at + 1, mask=m, other=0.0).to(tl.float32)
                    acc += tl.sum(per_group * scale + a_group[None, :] * zero, axis=1)
        if ACC2D:  # (zero where the blocks span several groups, which reduce per block)
            acc += tl.sum(acc2, axis=1)
        last = True
        if SPLIT > 1:  # each part stores its sums; the last part of the block to finish adds them, in part order
            block = e * tl.num_programs(1) + tl.program_id(1)
            lane = tl.arange(0, BLOCK_N)
            tl.store(partials + (block * SPLIT + tl.program_id(2)) * BLOCK_N + lane, acc)
            tl.debug_barrier()  # every thread's sums stored before the count that publishes them (release)
            last = tl.atomic_add(counters + block, 1, sem="acq_rel") == SPLIT - 1
            if last:
                acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for part in tl.static_range(SPLIT):  # a fixed order: the same sums whichever part came last
                    acc += tl.load(partials + (block * SPLIT + part) * BLOCK_N + lane, volatile=True)
                tl.atomic_xchg(counters + block, 0)  # ready for the next launch
        if last:
            if GATED:  # acc holds the gate rows, then the up rows: [2, R] -> [R, 2] -> gate, up
                gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N // 2)), (1, 0)))
                outs = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                tl.store(out + e * (N // 2) + outs, silu_mul(gate, up, ROUND), mask=outs < N // 2)
            else:
                if WEIGH:
                    acc = acc * tl.load(mix + e).to(tl.float32)
                tl.store(out + e * N + rows, acc, mask=row_ok)

    _compiled = _gemv_int4_kernel
    return _compiled
