"""Visual-token compression: drop most of an image's LLM tokens before the language model sees them.

Saliency is the attention each token receives in the vision tower's last block (per tile view for DeepSeek-VL2's
SigLIP tower); the keep set is its top tokens, plus (VisMMOE) the tokens whose routing in the pinned MoE prefix
layers stays on the salient core's experts.
"""

from importlib import import_module
from typing import Any

# name -> the submodule that defines it; imported on first use, so that `vismmoe_edge.compress.config` (torch-free)
# can be imported without the torch-using rest.
_HOMES = {
    "VisionSaliency": "saliency",
    "attention_received": "saliency",
    "merge_to_llm_tokens": "saliency",
    "normalize01": "saliency",
    "affinity_keep": "select",
    "affinity_keep_reference": "select",
    "keep_count": "select",
    "random_keep": "select",
    "saliency_keep": "select",
    "zip_keep": "select",
    "TileSaliency": "tile_saliency",
    "pool_to_tokens": "tile_saliency",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'vismmoe_edge.compress' has no attribute {name!r}")
    return getattr(import_module(f"vismmoe_edge.compress.{_HOMES[name]}"), name)


__all__ = [
    "TileSaliency",
    "VisionSaliency",
    "affinity_keep",
    "affinity_keep_reference",
    "attention_received",
    "keep_count",
    "merge_to_llm_tokens",
    "normalize01",
    "pool_to_tokens",
    "random_keep",
    "saliency_keep",
    "zip_keep",
]
