"""Integer weight codes to float32 in Triton without an int-to-float conversion.

A quantized GEMV dequantizes every weight it reads, and the GPU issues int-to-float conversions (I2F) at a quarter
of its FP32 rate: at 30B-A3B shapes an int4 MoE layer converts ~38 M codes, ~290 K on each of an H200's SMs,
~10 us of conversion issue if nothing hides it, against the layer's 4.8 us byte bound (docs/decode-on-device.md).
A small unsigned integer c placed under the exponent bits of 2^23 (0x4B000000) is the float 2^23 + c, exactly, so
one OR and one subtraction give the same float as the conversion. Both helpers return exactly the values
`code.to(float32) - offset` would.
"""

import triton
import triton.language as tl


@triton.jit
def centered(code):
    """int4 codes (0..15, any unsigned integer type) -> code - 8 in float32."""
    return (code.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8


@triton.jit
def signed_byte(code):
    """int8 codes (-128..127) -> the same value in float32: the byte's bits with the sign flipped are code + 128."""
    biased = code.to(tl.uint8, bitcast=True) ^ 0x80
    return (biased.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
