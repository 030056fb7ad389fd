"""Visual-token compression: drop most of an image's LLM tokens before the language model sees them.

Saliency is the attention each token receives in the vision tower's last block (per tile view for DeepSeek-VL2's
SigLIP tower); the keep set is its top tokens, plus (VisMMOE) the tokens whose routing in the pinned MoE prefix
layers stays on the salient core's experts.
"""

from vismmoe_edge.compress.saliency import VisionSaliency, attention_received, merge_to_llm_tokens, normalize01
from vismmoe_edge.compress.select import (
    affinity_keep,
    affinity_keep_reference,
    keep_count,
    random_keep,
    saliency_keep,
    zip_keep,
)
from vismmoe_edge.compress.tile_saliency import TileSaliency, pool_to_tokens

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
