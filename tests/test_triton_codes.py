"""kernels/triton_codes.py: integer codes to float32 by exponent bits give exactly what a conversion gives."""

from __future__ import annotations

import pytest
import torch

from vismmoe_edge.kernels import moe_decode as md

triton = pytest.importorskip("triton")  # (the kernel below is defined at import: Triton resolves globals)
tl = triton.language

from vismmoe_edge.kernels.triton_codes import centered, signed_byte  # noqa: E402


@triton.jit
def _convert(nibbles, codes, out4, out8):
    i = tl.arange(0, 256)
    tl.store(out4 + i, centered(tl.load(nibbles + i) & 15))
    tl.store(out8 + i, signed_byte(tl.load(codes + i)))


@pytest.mark.skipif(not md.INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_every_int4_and_int8_code_converts_exactly() -> None:
    nibbles = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # every byte: its low nibble is 0..15
    codes = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8)
    out4, out8 = torch.empty(256), torch.empty(256)
    _convert[(1,)](nibbles, codes, out4, out8)
    assert torch.equal(out4, (nibbles & 15).float() - 8)
    assert torch.equal(out8, codes.float())
