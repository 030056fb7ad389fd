"""The Triton kernels of the compiled decode token's attention (decode_attention.py), router (decode_router.py)
and dense projections (dense_gemv.py), in a module of their own so that importing the engine does not import
Triton (~1 s, and CPU hosts have none): the ops import it on their first call."""

import triton
import triton.language as tl


# fmt: off
@triton.jit
def _split_kernel(q, k, v, length, m_out, s_out, acc_out, capacity, split, SCALE_LOG2: tl.constexpr,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  IEEE: tl.constexpr):
    # fmt: on
    # (the scale is a constant: inductor would pass a float argument as fp64, and the math would follow)
    kv = tl.program_id(0)
    sp = tl.program_id(1)
    splits = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    head = kv * GROUP + rows  # this KV head's query heads; rows >= GROUP are padding
    qt = tl.load(q + head[:, None] * D + dims[None, :], mask=rows[:, None] < GROUP, other=0.0)
    lo = sp * split
    hi = tl.minimum(tl.minimum(lo + split, tl.load(length) + 1), capacity)  # blocks past `length`: not visited
    base = kv.to(tl.int64) * capacity * D
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        visible = pos < hi
        offs = base + pos[:, None].to(tl.int64) * D + dims[None, :]
        kt = tl.load(k + offs, mask=visible[:, None], other=0.0)
        if IEEE:  # float32 caches (no TF32 rounding), and the interpreter (its bf16 dot: above)
            qk = tl.dot(qt.to(tl.float32), tl.trans(kt.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(qt, tl.trans(kt))
        qk = tl.where(visible[None, :], qk * SCALE_LOG2, float("-inf"))  # log2 units: exp2 below
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        s_i = s_i * alpha + tl.sum(p, 1)
        vt = tl.load(v + offs, mask=visible[:, None], other=0.0)
        if IEEE:  # p rounded to V's dtype first, as the half-precision dot takes it
            pv = tl.dot(p.to(vt.dtype).to(tl.float32), vt.to(tl.float32), input_precision="ieee")
            acc = acc * alpha[:, None] + pv
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    # a split wholly past `length` leaves max -inf, sum 0 and accumulator 0: weight 0 in the combine
    part = head * splits + sp
    tl.store(m_out + part, m_i, mask=rows < GROUP)
    tl.store(s_out + part, s_i, mask=rows < GROUP)
    tl.store(acc_out + part[:, None] * D + dims[None, :], acc, mask=rows[:, None] < GROUP)

@triton.jit
def _combine_kernel(m_in, s_in, acc_in, out, splits, SPLITS_P2: tl.constexpr, D: tl.constexpr):
    head = tl.program_id(0)
    sp = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, D)
    real = sp < splits
    m = tl.load(m_in + head * splits + sp, mask=real, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, 0))  # split 0 always holds position 0, so the max is finite
    total = tl.sum(tl.load(s_in + head * splits + sp, mask=real, other=0.0) * w, 0)
    acc = tl.load(acc_in + (head * splits + sp)[:, None] * D + dims[None, :], mask=real[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / total
    tl.store(out + head * D + dims, o.to(out.dtype.element_ty))


@triton.jit
def routed(z, valid, K: tl.constexpr, K_P2: tl.constexpr):
    """Logits z [BLOCK] (float32; -inf where not `valid`) -> (index [K_P2] int64, weights [K_P2] float32, the first
    K real): transformers' router after its GEMV. The float32 softmax, then the K largest by repeated maximum (the
    largest first, as torch.topk sorts them; among equal weights the lowest expert id), renormalised.

    Each pick is one reduction, not a max and an argmax: a probability is >= 0, so its float32 bits order as its
    value, and a key of (bits << 32) | (BLOCK - 1 - expert) orders by value and then by the lower expert id; the
    largest key gives both, its weight's bits exactly."""
    BLOCK: tl.constexpr = z.shape[0]
    offs = tl.arange(0, BLOCK)
    e = tl.exp(z - tl.max(z, 0))
    p = e / tl.sum(e, 0)
    picks = tl.arange(0, K_P2)
    index = tl.zeros((K_P2,), dtype=tl.int64)
    top = tl.zeros((K_P2,), dtype=tl.float32)
    bits = p.to(tl.int32, bitcast=True).to(tl.int64)
    # larger for a lower expert id; the tensor on the left (a constexpr on the left of a tensor stays a constexpr
    # under Triton 3.6's interpreter, which has no .to)
    lower_first = offs.to(tl.int64) * -1 + (BLOCK - 1)
    key = tl.where(valid, (bits << 32) | lower_first, -1)  # -1: taken, or padding
    for j in tl.static_range(K):
        best = tl.max(key, 0)
        at = (best & 0xFFFFFFFF) * -1 + (BLOCK - 1)
        weight = (best >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        index = tl.where(picks == j, at, index)
        top = tl.where(picks == j, weight, top)
        key = tl.where(offs == at, -1, key)
    return index, top / tl.sum(top, 0)  # picks past K hold 0


@triton.jit
def _topk_kernel(logits, index_out, weight_out, experts, K: tl.constexpr, BLOCK: tl.constexpr,
                 K_P2: tl.constexpr):  # fmt: skip
    offs = tl.arange(0, BLOCK)
    valid = offs < experts
    z = tl.load(logits + offs, mask=valid, other=float("-inf")).to(tl.float32)
    index, weights = routed(z, valid, K, K_P2)
    picks = tl.arange(0, K_P2)
    tl.store(index_out + picks, index, mask=picks < K)
    tl.store(weight_out + picks, weights.to(weight_out.dtype.element_ty), mask=picks < K)


@triton.jit
def row_dots(x, w, rows, N, K, stride_row, BLOCK_K: tl.constexpr):
    """W[rows] @ x in float32 for one block of rows of W [N, K]: the products kept per column over the blocks of K,
    each row reduced once after the loop."""
    acc = tl.zeros((rows.shape[0], BLOCK_K), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        a = tl.load(x + cols, mask=cols < K, other=0.0).to(tl.float32)
        ptrs = w + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
        b = tl.load(ptrs, mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0).to(tl.float32)
        acc += b * a[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _dense_gemv_kernel(x, w, out, N, K, stride_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = row_dots(x, w, rows, N, K, stride_row, BLOCK_K)
    tl.store(out + rows, y.to(out.dtype.element_ty), mask=rows < N)


@triton.jit
def _route_kernel(x, w, table, logits, counter, index_out, weight_out, slot_out, routing, missed, E, H, stride_w,
                  K: tl.constexpr, K_P2: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_H: tl.constexpr):  # fmt: skip
    # 1. every program: its ROWS logits, rounded to x's dtype as F.linear's output is
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    z = row_dots(x, w, rows, E, H, stride_w, BLOCK_H).to(x.dtype.element_ty).to(tl.float32)
    tl.store(logits + rows, z, mask=rows < E)
    # 2. the last program to finish (a ticket from the counter, acquire-release at GPU scope, after every thread
    # of this program has stored) reads all logits and routes; it leaves the counter at 0 for the next call
    tl.debug_barrier()
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK_E)
        valid = offs < E
        # past L1: other programs' stores (a new name: Triton keeps a variable's shape across an `if`)
        every_logit = tl.load(logits + offs, mask=valid, other=float("-inf"), volatile=True)
        index, weights = routed(every_logit, valid, K, K_P2)
        picks = tl.arange(0, K_P2)
        real = picks < K
        slot = tl.load(table + index, mask=real, other=0).to(tl.int64)  # the expert table's row (int32, -1 absent)
        tl.store(index_out + picks, index, mask=real)
        tl.store(weight_out + picks, weights.to(weight_out.dtype.element_ty), mask=real)
        tl.store(slot_out + picks, tl.maximum(slot, 0), mask=real)  # an absent expert reads slot 0: token redone
        tl.store(routing + picks, index, mask=real)
        tl.store(missed, tl.max(tl.where(real & (slot < 0), 1, 0), 0).to(tl.int1))
        tl.atomic_xchg(counter, 0)
