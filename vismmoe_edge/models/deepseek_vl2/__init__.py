"""DeepSeek-VL2 (Tiny / Small / Base): not in transformers, so assembled from its DeepSeek-V2 and SigLIP parts
(model.py), with the original config (config.py), the released variants (variants.py), the dynamic-tiling
processor (processor.py) and its prefill ops (ops.py)."""

from vismmoe_edge.models.deepseek_vl2.config import ARCHITECTURE, MODEL_TYPE, read_config
from vismmoe_edge.models.deepseek_vl2.model import DeepseekVL2ForCausalLM, moe_layer_indices, select_tensors
from vismmoe_edge.models.deepseek_vl2.ops import DeepseekVL2Ops
from vismmoe_edge.models.deepseek_vl2.processor import load_deepseek_vl2_processor
from vismmoe_edge.models.family import ModelFamily

FAMILY = ModelFamily(
    model_type=MODEL_TYPE,
    architecture=ARCHITECTURE,
    model_class=DeepseekVL2ForCausalLM,
    read_config=read_config,
    moe_layers=moe_layer_indices,
    routed_experts=lambda config: int(config.text_config.n_routed_experts),
    shared_experts=lambda config: int(config.text_config.n_shared_experts),
    tied_head=lambda config: False,
    load_processor=load_deepseek_vl2_processor,
    ops=DeepseekVL2Ops(),
    select_tensors=select_tensors,
)

__all__ = ["ARCHITECTURE", "FAMILY", "MODEL_TYPE", "read_config", "select_tensors"]
