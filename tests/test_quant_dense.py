"""quant/dense.py's pieces on their own: which bits and group each linear gets, the embedding read by row, the
format-version-2 config and its one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.cli import app
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import make_config, parse_quant_config
from vismmoe_edge.quant.dense import QuantizedLinear, RowEmbedding, choose, encode
from vismmoe_edge.quant.kernels import dequantize_matrix


def test_choose_bits_and_groups() -> None:
    text = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert choose(text, 4096, 2048, 4, 128).group_size == 128
    assert choose(text, 192, 192, 4, 128).group_size == 64  # the largest kernel group dividing 192
    assert choose("lm_head.weight", 472, 192, 4, 128).bits == 8  # 472 rows: no int4 tiles
    vision = choose("model.visual.blocks.0.mlp.linear_fc2.weight", 1152, 4304, 4, 128)
    assert vision.bits == 8 and vision.nbytes == 1152 * 4304 + 2 * 1152


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_is_the_dequantized_matrix(bits: int) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(64, 128), torch.randn(64), torch.randn(2, 3, 128)
    choice = choose("model.language_model.layers.0.self_attn.o_proj.weight", 64, 128, bits, 32)
    tensors = encode(choice, w, "rowmajor")
    module = QuantizedLinear(choice, "rowmajor", b)
    module.load_state_dict({"qweight": tensors[0], module.scale_name: tensors[1], "bias": b}, assign=True)
    module.prepare(torch.device("cpu"))
    reference = torch.nn.functional.linear(x, dequantize_matrix(module.matrix()), b)
    torch.testing.assert_close(module(x), reference, atol=1e-4, rtol=1e-4)
    exact = torch.nn.functional.linear(x, w, b)
    assert (module(x) - exact).norm() / exact.norm() < (0.15 if bits == 4 else 0.02)  # the format's own error


def test_row_embedding_reads_the_rows_it_is_asked(tmp_path: Path) -> None:
    table = torch.arange(40, dtype=torch.float32).view(10, 4)
    path = tmp_path / "emb.bin"
    path.write_bytes(b"\0" * 16 + table.numpy().tobytes())
    info = TensorInfo("embed_tokens.weight", path, "F32", (10, 4), 16, table.nbytes)
    rows = RowEmbedding(info, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[3, 0, 9]])
    assert torch.equal(rows(ids), table[ids])
    with pytest.raises(IndexError, match="outside the vocabulary"):
        rows(torch.tensor([10]))


def test_format_version_2_config() -> None:
    q = make_config(4, 128, "rowmajor")
    from dataclasses import replace

    raw = replace(q, dense_bits=4, dense_group_size=128).to_dict()
    assert raw["format_version"] == 2 and raw["quantized_modules"] == ["routed_experts", "dense_linear"]
    assert parse_quant_config(raw, "x").dense_bits == 4
    for change, needle in (
        ({"dense": None}, "only in format version 2"),
        ({"format_version": 1}, "only in format version 2"),
        ({"dense": {"bits": 5, "group_size": 128, "vision_bits": 8}}, "use 4 or 8"),
        ({"format_version": 3}, "reads versions 1 and 2"),
    ):
        bad = {k: v for k, v in (raw | change).items() if v is not None}
        with pytest.raises(VismmoeError, match=needle):
            parse_quant_config(json.loads(json.dumps(bad)), "x")


def test_quantize_refuses_other_dense_bits_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["quantize", str(tmp_path), str(tmp_path / "out"), "--bits", "4",
                                      "--dense-bits", "2"])  # fmt: skip
    assert result.exit_code != 0 and "--dense-bits 2: use 4 or 8" in result.output
