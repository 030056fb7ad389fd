"""A checkpoint directory read once: its family, config, tensor table and expert catalogue.

The planner, `info` and the loader all start from this, so config.json and every shard header are parsed a
single time per command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.registry import model_family

if TYPE_CHECKING:  # torch (2+ s to import) loads once the directory is known to hold a model of a known family
    import torch

    from vismmoe_edge.checkpoint import ExpertCatalogue, TensorInfo
    from vismmoe_edge.models.family import ModelFamily


@dataclass(frozen=True)
class CheckpointInfo:
    model_dir: Path
    family: ModelFamily
    config: Any
    table: dict[str, TensorInfo]  # the tensors the model uses (the family's selection)
    catalogue: ExpertCatalogue
    is_demo: bool = False  # the built-in demo model, chosen because no model was named

    @property
    def top_k(self) -> int:
        return int(self.config.text_config.num_experts_per_tok)

    @property
    def resident_tensors(self) -> dict[str, TensorInfo]:
        """Every tensor that is not a routed expert: loaded once and kept in memory."""
        return {name: info for name, info in self.table.items() if name not in self.catalogue.tensor_names}

    @property
    def stored_dtype(self) -> torch.dtype:
        """The weights' float dtype as stored: the experts', or for quantized experts the resident weights' (the
        dtype with the most bytes), which is what `--dtype auto` computes in."""
        import torch

        from vismmoe_edge.checkpoint import TORCH_DTYPES

        if self.catalogue.quant is None:
            return TORCH_DTYPES[self.catalogue.dtype]
        sizes: dict[str, int] = {}
        for info in self.resident_tensors.values():
            if info.torch_dtype.is_floating_point:
                sizes[info.dtype] = sizes.get(info.dtype, 0) + info.nbytes
        return TORCH_DTYPES[max(sizes, key=sizes.__getitem__)] if sizes else torch.bfloat16


def inspect_checkpoint(model_dir: str | Path | None) -> CheckpointInfo:
    """Read `model_dir` (None: the built-in demo model); anything malformed is one-line refused."""
    is_demo = model_dir is None
    if model_dir is None:
        from vismmoe_edge.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    model_dir = Path(model_dir).expanduser()
    family = model_family(model_dir)  # by config.json's model_type; anything else is one-line refused
    try:
        config = family.read_config(model_dir)
    except VismmoeError:
        raise
    except Exception as e:  # transformers' config classes raise many types for a field of the wrong type or shape
        reason = " ".join(str(e).split())[:200]
        raise VismmoeError(f"{model_dir / 'config.json'}: malformed ({reason}); re-download it") from e
    from vismmoe_edge.checkpoint import read_tensor_table  # lazy: with torch, once the family is known
    from vismmoe_edge.quant.catalogue import checkpoint_catalogue

    table = family.select_tensors(config, read_tensor_table(model_dir))
    catalogue = checkpoint_catalogue(family, config, table, model_dir)  # float experts, or our quantized records
    return CheckpointInfo(model_dir, family, config, table, catalogue, is_demo)


def as_checkpoint_info(model: str | Path | CheckpointInfo | None) -> CheckpointInfo:
    return model if isinstance(model, CheckpointInfo) else inspect_checkpoint(model)
