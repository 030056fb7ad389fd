"""Load every non-expert tensor of a checkpoint into a model built on the meta device.

Resident means parameters and persistent buffers (GLM's router `e_score_correction_bias` is a buffer, not a
parameter), each copied out of the shard mapping into memory of our own.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from tqdm.auto import tqdm

from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.store import ShardFiles

TIED_HEAD = "lm_head.weight"


def target_dtype(name: str, stored: torch.dtype, dtype: torch.dtype, keep_fp32: Collection[str]) -> torch.dtype:
    """The compute dtype, except integers and what transformers keeps in fp32 whatever the dtype (routers)."""
    if not stored.is_floating_point:
        return stored
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
) -> None:
    """Fill every parameter and persistent buffer from `table` (routed-expert tensors excluded); the checkpoint
    must hold exactly what the model expects, apart from a tied lm_head."""
    wanted = model.state_dict()  # meta tensors for parameters, real ones for persistent buffers
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
    missing = [n for n in wanted if n not in state and not (n == TIED_HEAD and tied_head)]
    if missing:
        raise VismmoeError(f"checkpoint is missing tensor {missing[0]} (and {len(missing) - 1} more); re-download it")
    model.load_state_dict(state, strict=False, assign=True)
