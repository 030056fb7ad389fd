"""int4 nibble layouts: round trips, and our tile packing equals torch's own CPU repack on every x86 build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from vismmoe_edge.quant.packing import (
    CPU_LAYOUTS,
    ROWMAJOR,
    cuda_kernel_input,
    native_cpu_layout,
    pack_cpu_tiles,
    pack_int4,
    pack_rowmajor,
    unpack_int4,
)

ROOT = Path(__file__).resolve().parents[1]
# 16-row blocks only, 64-row blocks, 64 + 32 (demo gate_up 96), 64 + 16 tails, and a 30B-A3B-sized N
ROWS = [16, 64, 96, 80, 1536]


def codes(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("layout", [ROWMAJOR, *CPU_LAYOUTS])
@pytest.mark.parametrize("n", ROWS)
def test_round_trip(layout: str, n: int) -> None:
    c = codes(n, 64, n)
    packed = pack_int4(c, layout)
    assert packed.shape == (n, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, layout), c)


def test_rowmajor_is_low_nibble_first_and_cuda_input_high_nibble_first() -> None:
    c = torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8)
    assert pack_rowmajor(c).tolist() == [[0x21, 0x43]]  # compressed-tensors: value i at bits 4i
    assert cuda_kernel_input(c).tolist() == [[0x12, 0x34]]  # gpt-fast / torchao: even column in the high nibble


def test_native_layout_equals_torch_repack() -> None:
    layout = native_cpu_layout()
    assert layout in CPU_LAYOUTS
    for n in ROWS:
        c = codes(n, 256, n)
        native = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.to(torch.int32), 8)
        assert torch.equal(pack_cpu_tiles(c, layout), native), n


_PROBE = """
import torch
from vismmoe_edge.quant.packing import native_cpu_layout, pack_cpu_tiles
c = torch.randint(0, 16, (96, 64), dtype=torch.uint8)
layout = native_cpu_layout()
assert torch.equal(pack_cpu_tiles(c, layout), torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.int(), 8))
print(layout)
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512", reason="needs an AVX-512 host to try all")
def test_other_x86_builds_pack_as_documented() -> None:
    """ATEN_CPU_CAPABILITY picks torch's AVX2 and scalar kernels on this host: each matches its layout."""
    env = os.environ | {"PYTHONPATH": str(ROOT), "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}
    found = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "cpu_b32_split"
    env["ATEN_CPU_CAPABILITY"] = "default"
    found = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "cpu_b32_pairs"
