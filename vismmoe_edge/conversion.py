"""A checkpoint directory to int4/int8 experts and back, by path: the model family (found from config.json) says
which tensors are routed experts, their geometry and how transformers lays them out; quant/ does the rest."""

from __future__ import annotations

from pathlib import Path

import torch

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo, read_tensor_table
from vismmoe_edge.models.registry import model_family
from vismmoe_edge.quant import convert, dequantize
from vismmoe_edge.quant.catalogue import QuantizedCatalogue, quantized_expert_ranges
from vismmoe_edge.quant.config import read_quant_config
from vismmoe_edge.quant.source import SourceCheckpoint


def float_catalogue(directory: Path, table: dict[str, TensorInfo]) -> ExpertCatalogue:
    """The family's catalogue of a dense (or FP8/W4A16/AWQ, read as dense) checkpoint's experts."""
    family = model_family(directory)
    config = family.read_config(directory)
    return family.catalogue_for(config, family.select_tensors(config, table))


def linear_weights(directory: Path) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the family model's nn.Linear weights, routed experts and routers left out: what
    `--dense-bits` quantizes. The model is built on the meta device (no memory)."""
    from vismmoe_edge.models.resident import parameters_on_meta
    from vismmoe_edge.quant.dense import linear_weights as linears

    family = model_family(directory)
    config = family.read_config(directory)
    with parameters_on_meta():
        model = family.model_class(config)
    return {n: shape for n, shape in linears(model).items() if ".experts." not in n}


def quantize_checkpoint(
    src: Path,
    out: Path,
    bits: int,
    group_size: int | None = None,
    progress: bool = True,
    *,
    layout: str = "auto",
    max_shard_size: int | str = convert.DEFAULT_MAX_SHARD,
    dense_bits: int | None = None,
    source: SourceCheckpoint | None = None,
) -> Path:
    """quant.convert.quantize_checkpoint for the checkpoint's own family: see there. Returns `out`."""
    return convert.quantize_checkpoint(src, out, bits, group_size, progress, catalogue_of=float_catalogue,
                                       layout=layout, max_shard_size=max_shard_size, dense_bits=dense_bits,
                                       linears_of=linear_weights, source=source)  # fmt: skip


def read_quantized_catalogue(directory: Path) -> QuantizedCatalogue:
    """The checked record ranges of a quantized model directory (config.json, index and shards)."""
    directory = Path(directory)
    quant = read_quant_config(directory)
    family = model_family(directory)
    config = family.read_config(directory)
    text = config.get_text_config()
    table = family.select_tensors(config, read_tensor_table(directory))
    return quantized_expert_ranges(
        table, quant, hidden=int(text.hidden_size), inter=int(text.moe_intermediate_size),
        num_experts=family.routed_experts(config), moe_layers=family.moe_layers(config),
    )  # fmt: skip


def dequantize_checkpoint(src: Path, out: Path, dtype: torch.dtype | None = None, *, progress: bool = False) -> Path:
    """The float checkpoint our quantized `src` stands for, written to `out` (quant.dequantize). Returns `out`."""
    catalogue = read_quantized_catalogue(src)
    fused = model_family(Path(src)).fused_experts
    return dequantize.dequantize_checkpoint(src, out, catalogue, fused=fused, dtype=dtype, progress=progress)
