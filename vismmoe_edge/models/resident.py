"""Build transformers' own model without its routed experts, and load every other tensor of the checkpoint.

Resident means parameters and persistent buffers (GLM's router `e_score_correction_bias` is a buffer, not a
parameter), each copied out of the shard mapping into memory of our own. A checkpoint quantized with
`--dense-bits` gets QuantizedLinear modules for its int4/int8 linears and a RowEmbedding that reads the token
embedding's rows from the shard instead of holding it (quant/dense.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime, OffloadedExperts
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.models.host_embedding import HostEmbedding
from vismmoe_edge.quant.dense import (
    QUANT_SUFFIXES,
    RowEmbedding,
    prepare_quantized_linears,
    stored_matrices,
    swap_quantized_linears,
)

TIED_HEAD = "lm_head.weight"


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every nn.Parameter on the meta device; buffers (RoPE inv_freq) stay real, as they are computed."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_offloaded(
    model_class: type[nn.Module],
    config: Any,
    table: dict[str, TensorInfo],
    catalogue: ExpertCatalogue,
    files: ShardFiles,
    runtime: ExpertRuntime,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tied_head: bool,
    host_embedding: bool = False,
) -> Any:
    """`model_class(config)` with each MoE layer's routed experts swapped for OffloadedExperts (served by
    `runtime`) and every other weight loaded: what every family's build_model is. `host_embedding`: the token
    embedding goes to mapped host memory (models/host_embedding.py) instead of `device`, unless lm_head is tied to
    it or a quantized file already reads it by row."""
    with parameters_on_meta():
        model = model_class(config)
    language_model = model.model.language_model
    layers = language_model.layers
    for layer in catalogue.moe_layers:
        act = layers[layer].mlp.experts.act_fn
        layers[layer].mlp.experts = OffloadedExperts(layer, runtime, act, catalogue.num_experts)
    quant = None if catalogue.quant is None else catalogue.quant.quant
    choices = stored_matrices(table, quant.layout) if quant is not None and quant.dense_bits is not None else {}
    swap_quantized_linears(model, choices, quant.layout if quant is not None else "")
    # a file quantized for small memory also leaves its embedding on disk (tied to lm_head, it must stay)
    embedding_name = _module_name(model, language_model.embed_tokens) + ".weight"
    embedding = embedding_name if choices and not tied_head else None
    in_host = embedding_name if host_embedding and embedding is None and not tied_head else None
    load_resident_weights(
        model, table, catalogue, files, dtype=dtype, device=device, tied_head=tied_head,
        # e.g. GLM's router: transformers keeps its weight and bias fp32 under bf16/fp16
        keep_fp32=getattr(model, "_keep_in_fp32_modules_strict", None) or (),
        read_later=tuple(name for name in (embedding, in_host) if name is not None),
    )  # fmt: skip
    if embedding is not None:
        language_model.embed_tokens = RowEmbedding(table[embedding], dtype, device)
    if in_host is not None:  # straight from the shard into host memory: it never takes GPU memory, even at load
        language_model.embed_tokens = HostEmbedding(files.tensor(table[in_host]).to(dtype), device)
    if tied_head:
        model.lm_head.weight = language_model.embed_tokens.weight
    model.to(device)  # buffers (RoPE frequencies) were built on the CPU
    prepare_quantized_linears(model, device)
    return model.eval()


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def target_dtype(name: str, stored: torch.dtype, dtype: torch.dtype, keep_fp32: Collection[str]) -> torch.dtype:
    """The compute dtype, except integers and what transformers keeps in fp32 whatever the dtype (routers)."""
    if not stored.is_floating_point or name.endswith(QUANT_SUFFIXES):
        return stored  # integers, and the bf16 scales the int4/int8 kernels read
    if dtype in (torch.float16, torch.bfloat16) and any(pattern in name for pattern in keep_fp32):
        return torch.float32  # transformers' `_keep_in_fp32_modules_strict` matches by substring
    return dtype


def load_resident_weights(
    model: nn.Module,
    table: dict[str, TensorInfo],
    catalogue: ExpertCatalogue,
    files: ShardFiles,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tied_head: bool,
    keep_fp32: Collection[str] = (),
    read_later: Collection[str] = (),
) -> None:
    """Fill every parameter and persistent buffer from `table` (routed-expert tensors excluded); the checkpoint
    must hold exactly what the model expects, apart from a tied lm_head and the `read_later` tensors (read by row
    from the shard)."""
    wanted = model.state_dict()  # meta tensors for parameters, real ones for persistent buffers
    state: dict[str, torch.Tensor] = {}
    resident = [info for name, info in table.items() if name not in catalogue.tensor_names and name not in read_later]
    bar = tqdm(
        total=sum(i.nbytes for i in resident),
        desc="loading resident weights",
        unit="B",
        unit_scale=True,
        disable=None,
        leave=False,
    )
    for info in resident:
        bar.update(info.nbytes)
        expected = wanted.get(info.name)
        if expected is None:
            if info.name == TIED_HEAD and tied_head:
                continue
            raise VismmoeError(
                f"{info.shard}: unexpected tensor {info.name}; the checkpoint does not match config.json"
            )
        if tuple(expected.shape) != info.shape:
            raise VismmoeError(
                f"{info.shard}: tensor {info.name} has shape {list(info.shape)}, "
                f"config.json implies {list(expected.shape)}"
            )
        out = torch.empty(info.shape, dtype=target_dtype(info.name, info.torch_dtype, dtype, keep_fp32), device=device)
        out.copy_(files.tensor(info))  # a copy: the model must not keep pages of the mapping alive
        state[info.name] = out
    bar.close()
    missing = [n for n in wanted if n not in state and n not in read_later and not (n == TIED_HEAD and tied_head)]
    if missing:
        raise VismmoeError(f"checkpoint is missing tensor {missing[0]} (and {len(missing) - 1} more); re-download it")
    model.load_state_dict(state, strict=False, assign=True)
