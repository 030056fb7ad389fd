"""DeepSeek-VL2 (Tiny / Small / Base): not in transformers, so assembled from its DeepSeek-V2 and SigLIP parts
(model.py), with the original config (config.py), the released variants (variants.py), the dynamic-tiling
processor (processor.py) and its prefill ops (ops.py)."""

from vismmoe_edge.models.deepseek_vl2.config import ARCHITECTURE, MODEL_TYPE, read_config
from vismmoe_edge.models.deepseek_vl2.model import build_model, catalogue_for, select_tensors
from vismmoe_edge.models.deepseek_vl2.ops import DeepseekVL2Ops
from vismmoe_edge.models.deepseek_vl2.processor import load_deepseek_vl2_processor
from vismmoe_edge.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    read_config=read_config,
    select_tensors=select_tensors,
    catalogue_for=catalogue_for,
    build_model=build_model,
    load_processor=load_deepseek_vl2_processor,
    shared_experts=lambda config: int(config.text_config.n_shared_experts),
    ops=DeepseekVL2Ops(),
)

__all__ = ["ARCHITECTURE", "FAMILY", "MODEL_TYPE", "build_model", "catalogue_for", "read_config", "select_tensors"]
