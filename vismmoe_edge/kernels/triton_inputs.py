"""The input block an expert GEMV program multiplies its weight rows by, in Triton.

For the down projection of SiLU experts the input is silu(gate) * up, made from the gate_up GEMV's float32 output
[gate (K) | up (K)] as it is loaded, and rounded to the compute dtype as transformers' bf16/fp16 experts round the
inner activation; otherwise it is the input as given, widened to float32 (stride_v 0: one input for every expert).
Shared by the slot GEMV and the read-in-place GEMV (kernels/moe_decode.py).
"""

import triton
import triton.language as tl


@triton.jit
def expert_input(v, e, stride_v, cols, K, SILU: tl.constexpr, ROUND: tl.constexpr):
    """Columns `cols` of expert e's input, float32. ROUND 1: through bf16, 2: through fp16, 0: kept."""
    if SILU:
        gate = tl.load(v + e * stride_v + cols, mask=cols < K, other=0.0)
        up = tl.load(v + e * stride_v + K + cols, mask=cols < K, other=0.0)
        a = gate * tl.sigmoid(gate) * up
        if ROUND == 1:
            a = a.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            a = a.to(tl.float16).to(tl.float32)
    else:
        a = tl.load(v + e * stride_v + cols, mask=cols < K, other=0.0).to(tl.float32)
    return a
