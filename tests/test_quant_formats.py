"""Readers of downloaded formats: dequantization equals each format's reference, and unknown schemes are refused.

Packing and reference dequantization come from tests/quant_sources.py (numpy loops in the order of each format's
source), independent of the code under test.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.quant_sources import (
    awq_pack,
    ct_pack,
    ct_quantize,
    ct_reference_dequant,
    fp8_quantize,
    fp8_reference_dequant,
    one_thread,  # noqa: F401 - autouse: one torch thread in this module
)
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.formats import awq, compressed_tensors, fp8


def one_line(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])  # one shape with partial edge blocks
def test_fp8_block_dequant_matches_reference(shape: tuple[int, int]) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    q, s = fp8_quantize(w)
    got = fp8.dequantize(q, s.to(torch.bfloat16).float(), (128, 128))
    assert torch.equal(got, fp8_reference_dequant(q, s.to(torch.bfloat16).float()))
    assert (got - w).abs().max() < 0.07 * w.abs().max()  # e4m3 keeps 3 mantissa bits: <= 6.25% of the block max


def test_fp8_fused_experts_keep_one_grid_per_expert() -> None:
    w = torch.randn(3, 256, 128, generator=torch.Generator().manual_seed(1))
    qs, ss = zip(*(fp8_quantize(x) for x in w), strict=True)
    q, s = torch.stack(qs), torch.stack(ss)
    got = fp8.dequantize(q, s, (128, 128))
    for e in range(3):
        assert torch.equal(got[e], fp8_reference_dequant(q[e], s[e]))
        assert torch.equal(fp8.dequantize(q[e], s[e], (128, 128)), got[e])


def test_fp8_config_refusals() -> None:
    assert fp8.parse_config({"quant_method": "fp8", "weight_block_size": [128, 128]}, "c") == (128, 128)
    with pytest.raises(VismmoeError) as e:
        fp8.parse_config({"quant_method": "fp8", "activation_scheme": "static"}, "c")
    assert "per-tensor FP8" in one_line(e)
    with pytest.raises(VismmoeError) as e:
        fp8.parse_config({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "c")
    assert "e5m2" in one_line(e)
    with pytest.raises(VismmoeError) as e:
        fp8.dequantize(torch.zeros(256, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2), (128, 128))
    assert "scale grid" in one_line(e)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,group", [((64, 256), 128), ((24, 200), 64)])  # 24 rows: padded zero-point words
def test_compressed_tensors_dequant_matches_reference(symmetric: bool, shape: tuple[int, int], group: int) -> None:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.02
    q, scale, zp = ct_quantize(w, group, symmetric, torch.bfloat16)
    parts = {
        "weight_packed": torch.from_numpy(ct_pack(q + 8, dim=1)),
        "weight_scale": scale,
        "weight_shape": torch.tensor(shape, dtype=torch.int32),
    }
    if not symmetric:
        parts["weight_zero_point"] = torch.from_numpy(ct_pack(zp + 8, dim=0))
    ref = ct_reference_dequant(q, scale, zp, group)
    assert torch.equal(compressed_tensors.dequantize(parts, shape, group, "x"), ref)
    if shape[1] % group == 0:  # whole groups: the int4 codes carry over as they are
        groups = compressed_tensors.int4_groups(parts, shape, group, "x")
        assert torch.equal(groups.codes.to(torch.int64), torch.from_numpy(q + 8))
        assert torch.equal(groups.dequantize(), ref)


def test_compressed_tensors_refuses_act_order_and_other_schemes() -> None:
    good = {"format": "pack-quantized", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
            "strategy": "group", "group_size": 128, "symmetric": True}}}}  # fmt: skip
    assert compressed_tensors.parse_config(good, "c").group_sizes == (128,)
    parts = {"weight_packed": torch.zeros(8, 16, dtype=torch.int32), "weight_scale": torch.ones(8, 1),
             "weight_g_idx": torch.zeros(128, dtype=torch.int32)}  # fmt: skip
    with pytest.raises(VismmoeError) as e:
        compressed_tensors.int4_groups(parts, (8, 128), 128, "layers.0.mlp.experts.0.up_proj")
    assert "act-order" in one_line(e) and "up_proj.weight_g_idx" in one_line(e)

    def variant(**weights) -> dict:
        g = {"weights": good["config_groups"]["g"]["weights"] | weights}
        return good | {"config_groups": {"g": g}}

    a8 = {"num_bits": 8, "type": "int"}
    cases = {
        "actorder": variant(actorder="group"),
        "8-bit": variant(num_bits=8),
        "strategy": variant(strategy="tensor"),
        "activations": good | {"config_groups": {"g": {**good["config_groups"]["g"], "input_activations": a8}}},
        "format": good | {"format": "float-quantized"},
        "status": good | {"quantization_status": "frozen"},
        "sparsity": good | {"sparsity_config": {"format": "sparse-24"}},
    }  # fmt: skip
    for what, qc in cases.items():
        with pytest.raises(VismmoeError) as e:
            compressed_tensors.parse_config(qc, "config.json")
        assert one_line(e).startswith("config.json:"), what


def test_awq_dequant_matches_autoawq_reference() -> None:
    g = torch.Generator().manual_seed(3)
    cols_in, out, group = 256, 64, 128
    iw = torch.randint(0, 16, (cols_in, out), generator=g).numpy()
    z = torch.randint(0, 16, (cols_in // group, out), generator=g).numpy()
    s = (torch.rand(cols_in // group, out, generator=g) * 0.01 + 1e-3).half()
    parts = {"qweight": torch.from_numpy(awq_pack(iw)), "qzeros": torch.from_numpy(awq_pack(z)), "scales": s}
    assert torch.equal(awq.unpack(parts["qweight"]), torch.from_numpy(iw).to(torch.uint8))
    ref = np.zeros((cols_in, out), dtype=np.float32)  # dequantize_gemm: (iweight - izeros) * scales, [in, out]
    for k in range(cols_in):
        ref[k] = (iw[k] - z[k // group]) * s.float().numpy()[k // group]
    got = awq.dequantize(parts, group, "x")
    assert got.shape == (out, cols_in)
    assert torch.allclose(got, torch.from_numpy(ref).t(), rtol=0, atol=1e-6)  # zero folded into the float domain


def test_awq_config_refusals() -> None:
    assert awq.parse_config({"bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}, "c") == 128
    for bad in ({"bits": 4, "group_size": 128, "version": "gemv"}, {"bits": 3, "group_size": 128},
                {"bits": 4, "group_size": 128, "zero_point": False}, {"bits": 4, "group_size": 0}):  # fmt: skip
        with pytest.raises(VismmoeError) as e:
            awq.parse_config(bad, "config.json")
        assert one_line(e).startswith("config.json: AWQ")
