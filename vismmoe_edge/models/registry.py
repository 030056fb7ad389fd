"""Which model family a checkpoint is, by config.json's model_type (or its architectures): one registry.

A family module is imported only when its checkpoint is opened, so that transformers' model classes of the
other families never load.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.errors import VismmoeError

if TYPE_CHECKING:  # torch and transformers come with a family module, not with the dispatch (a refused directory)
    from vismmoe_edge.models.family import ModelFamily

# model_type -> (architecture in config.json, the module whose FAMILY serves it)
FAMILIES: dict[str, tuple[str, str]] = {
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "vismmoe_edge.models.qwen3_vl_moe"),
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", "vismmoe_edge.models.glm4v_moe"),
    "deepseek_vl_v2": ("DeepseekVLV2ForCausalLM", "vismmoe_edge.models.deepseek_vl2"),
}


def register_family(model_type: str, architecture: str, module: str) -> None:
    """Serve checkpoints of `model_type` (or `architecture`) with `module`'s FAMILY: a family added from outside
    the package (a plugin, a test) needs nothing else changed."""
    FAMILIES[model_type] = (architecture, module)


def family_of(model_type: str) -> ModelFamily:
    return importlib.import_module(FAMILIES[model_type][1]).FAMILY


def model_family(directory: Path) -> ModelFamily:
    """The family of the checkpoint in `directory`, from config.json's model_type (or its architectures)."""
    raw = read_config_json(directory)
    architectures = raw.get("architectures") or []
    for model_type, (architecture, _) in FAMILIES.items():
        if raw.get("model_type") == model_type or architecture in architectures:
            return family_of(model_type)
    found = ", ".join(architectures) or raw.get("model_type", "unknown")
    supported = " or ".join(architecture for architecture, _ in FAMILIES.values())
    raise VismmoeError(f"{directory}: unsupported architecture {found}; vismmoe-edge runs {supported}")
