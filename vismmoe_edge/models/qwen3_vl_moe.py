"""Qwen3-VL-MoE: build transformers' own model without its routed experts, and load everything else.

The skeleton is transformers' `Qwen3VLMoeForConditionalGeneration` with parameters on the meta device; each
MoE layer's `mlp.experts` is swapped for `OffloadedExperts`, so routed experts are never allocated.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo, build_expert_catalogue
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime, OffloadedExperts
from vismmoe_edge.experts.store import ShardFiles

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"
MODEL_TYPE = "qwen3_vl_moe"


def read_config(directory: Path) -> Qwen3VLMoeConfig:
    path = directory / "config.json"
    if not directory.is_dir():
        raise VismmoeError(f"{directory}: no such model directory")
    if not path.exists():
        raise VismmoeError(f"{directory}: no config.json; point --model at a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VismmoeError(f"{path}: not valid JSON ({e}); re-download it") from e
    architectures = raw.get("architectures") or []
    if raw.get("model_type") != MODEL_TYPE and ARCHITECTURE not in architectures:
        found = ", ".join(architectures) or raw.get("model_type", "unknown")
        raise VismmoeError(f"{directory}: unsupported architecture {found}; vismmoe-edge runs {ARCHITECTURE}")
    try:
        return Qwen3VLMoeConfig.from_dict(raw)
    except (TypeError, ValueError, KeyError) as e:
        raise VismmoeError(f"{path}: invalid {MODEL_TYPE} config ({e})") from e


def catalogue_for(config: Qwen3VLMoeConfig, table: dict[str, TensorInfo]) -> ExpertCatalogue:
    text = config.text_config
    catalogue = build_expert_catalogue(
        table, num_experts=text.num_experts, hidden=text.hidden_size, inter=text.moe_intermediate_size
    )
    expected = moe_layer_indices(config)
    if catalogue.moe_layers != expected:
        raise VismmoeError(f"checkpoint has experts for layers {catalogue.moe_layers}, config.json implies {expected}")
    return catalogue


def moe_layer_indices(config: Qwen3VLMoeConfig) -> list[int]:
    text = config.text_config
    return [
        i
        for i in range(text.num_hidden_layers)
        if i not in text.mlp_only_layers and text.num_experts > 0 and (i + 1) % text.decoder_sparse_step == 0
    ]


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


def build_model(
    config: Qwen3VLMoeConfig,
    table: dict[str, TensorInfo],
    catalogue: ExpertCatalogue,
    files: ShardFiles,
    runtime: ExpertRuntime,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> Qwen3VLMoeForConditionalGeneration:
    """The full model with every non-expert weight loaded and routed experts served by `runtime`."""
    with parameters_on_meta():
        model = Qwen3VLMoeForConditionalGeneration(config)
    layers = model.model.language_model.layers
    for layer in catalogue.moe_layers:
        experts = layers[layer].mlp.experts
        layers[layer].mlp.experts = OffloadedExperts(layer, runtime, experts.act_fn)

    wanted = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    resident = [info for name, info in table.items() if name not in catalogue.tensor_names]
    bar = tqdm(
        total=sum(i.nbytes for i in resident),
        desc="loading resident weights",
        unit="B",
        unit_scale=True,
        disable=None,
        leave=False,
    )
    for info in resident:
        name = info.name
        bar.update(info.nbytes)
        param = wanted.get(name)
        if param is None:
            if name == "lm_head.weight" and config.get_text_config().tie_word_embeddings:
                continue
            raise VismmoeError(f"{info.shard}: unexpected tensor {name}; the checkpoint does not match config.json")
        if tuple(param.shape) != info.shape:
            raise VismmoeError(
                f"{info.shard}: tensor {name} has shape {list(info.shape)}, config.json implies {list(param.shape)}"
            )
        target = dtype if info.torch_dtype.is_floating_point else info.torch_dtype
        out = torch.empty(info.shape, dtype=target, device=device)
        out.copy_(files.tensor(info))  # a copy: the model must not keep pages of the mapping alive
        state[name] = out
    bar.close()
    missing = [n for n in wanted if n not in state]
    if config.get_text_config().tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise VismmoeError(f"checkpoint is missing tensor {missing[0]} (and {len(missing) - 1} more); re-download it")
    model.load_state_dict(state, strict=False, assign=True)
    if config.get_text_config().tie_word_embeddings:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    model.to(device)  # buffers (RoPE frequencies) were built on the CPU
    model.eval()
    return model
