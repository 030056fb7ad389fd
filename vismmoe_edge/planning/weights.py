"""The bytes of each part of a checkpoint as the loaded model holds them, now or after a planned conversion.

`info` and `plan` read this: the token embedding, lm_head, attention, dense/shared MLPs, routers and norms, the
vision tower, and the routed experts. With `bits` / `dense_bits` the numbers are those `vismmoe-edge quantize
--bits B --dense-bits D` would write (record.py's expert record, dense.py's matrices), so a user picks the format
before an hour of quantizing. A file with quantized dense weights reads its token embedding by row from disk:
its bytes are on disk, not held.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from vismmoe_edge.checkpoint import TensorInfo
from vismmoe_edge.checkpoint_info import CheckpointInfo
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant import dense
from vismmoe_edge.quant.config import check_dense_bits, make_config
from vismmoe_edge.quant.convert import DEFAULT_INT4_GROUP as DEFAULT_GROUP_SIZE
from vismmoe_edge.quant.packing import ROWMAJOR
from vismmoe_edge.quant.record import ExpertSpec

EMBEDDING_KEY = re.compile(r"(^|\.)embed_tokens\.weight$")
LM_HEAD_KEY = re.compile(r"(^|\.)lm_head\.")
ATTENTION_KEY = re.compile(r"\.(self_attn|attn|attention)\.")
MLP_KEY = re.compile(r"\.mlp\.(?!gate\.)")  # dense and shared MLPs; the router (mlp.gate) is "other"
PARTS = ("embedding", "lm_head", "attention", "mlp", "other_language", "vision")


@dataclass(frozen=True)
class WeightBytes:
    """Held bytes of each non-expert part, the embedding's bytes on disk when it is read by row, and the experts."""

    embedding_bytes: int
    lm_head_bytes: int
    attention_bytes: int
    mlp_bytes: int
    other_language_bytes: int  # routers, norms, anything else of the language model
    vision_bytes: int
    embedding_on_disk_bytes: int  # read by row, not held
    bytes_per_expert: int
    expert_count: int
    bits: int | None  # the experts' (None: the checkpoint's float dtype)
    dense_bits: int | None  # attention / lm_head / MLPs (None: float); the vision tower is then int8
    planned: bool  # numbers for a conversion not done yet

    @property
    def language_bytes(self) -> int:
        return (
            self.embedding_bytes + self.lm_head_bytes + self.attention_bytes + self.mlp_bytes
            + self.other_language_bytes
        )  # fmt: skip

    @property
    def resident_bytes(self) -> int:
        return self.language_bytes + self.vision_bytes

    @property
    def expert_bytes(self) -> int:
        return self.bytes_per_expert * self.expert_count

    def as_dict(self) -> dict[str, int | bool | None]:
        return asdict(self) | {
            "language_bytes": self.language_bytes,
            "resident_bytes": self.resident_bytes,
            "expert_bytes": self.expert_bytes,
        }


def _part(name: str) -> str:
    if dense.VISION_KEY.search(name):
        return "vision"
    if EMBEDDING_KEY.search(name):
        return "embedding"
    if LM_HEAD_KEY.search(name):
        return "lm_head"
    if ATTENTION_KEY.search(name):
        return "attention"
    if MLP_KEY.search(name):
        return "mlp"
    return "other_language"


def _float_scale(info: TensorInfo, scale: float) -> int:
    return int(info.nbytes * scale) if info.torch_dtype.is_floating_point and not info.name.endswith(
        dense.QUANT_SUFFIXES
    ) else info.nbytes  # fmt: skip


def weight_bytes(
    checkpoint: CheckpointInfo,
    *,
    bits: int | None = None,
    dense_bits: int | None = None,
    group_size: int | None = None,
    float_scale: float = 1.0,
) -> WeightBytes:
    """Each part's bytes; `bits`/`dense_bits` plan a conversion of a float checkpoint (or restate what a quantized
    one already is). `float_scale` scales float tensors to the compute dtype (2.0: float16 computed in float32)."""
    catalogue = checkpoint.catalogue
    stored = None if catalogue.quant is None else catalogue.quant.quant
    if stored is not None:
        if bits not in (None, stored.bits) or dense_bits not in (None, stored.dense_bits):
            now = f"int{stored.bits} experts" + (f", int{stored.dense_bits} dense" if stored.dense_bits else "")
            raise VismmoeError(
                f"{checkpoint.model_dir} is already quantized ({now}): plan it as it is, or pass the float "
                "checkpoint it came from with --bits/--dense-bits"
            )
        bits, dense_bits = stored.bits, stored.dense_bits
    if bits is not None and bits not in (4, 8):
        raise VismmoeError(f"--bits {bits}: use 4 or 8")
    if dense_bits is not None and bits is None:
        raise VismmoeError("--dense-bits needs --bits: quantize converts the experts too")
    group = group_size if group_size is not None else (DEFAULT_GROUP_SIZE if bits == 4 else None)
    dense_group = DEFAULT_GROUP_SIZE  # at most (dense.choose)
    if stored is None:
        check_dense_bits(dense_bits, dense_group)
    planned = stored is None and bits is not None

    sizes = dict.fromkeys(PARTS, 0)
    linears: dict[str, tuple[int, int]] = {}
    if planned and dense_bits is not None:
        from vismmoe_edge.conversion import linear_weights

        linears = linear_weights(checkpoint.model_dir)
    tied = checkpoint.family.tied_head(checkpoint.config)
    rows_on_disk = dense_bits is not None and not tied
    on_disk = 0
    for name, info in checkpoint.resident_tensors.items():
        part = _part(name)
        if name in linears and info.torch_dtype.is_floating_point:
            nbytes = dense.choose(name, *linears[name], dense_bits, dense_group).nbytes  # type: ignore[arg-type]
        else:
            nbytes = _float_scale(info, float_scale)
        if part == "embedding" and rows_on_disk:
            on_disk += info.nbytes
            continue
        sizes[part] += nbytes

    if planned:
        text = checkpoint.config.text_config
        quant = make_config(bits, group, ROWMAJOR)  # type: ignore[arg-type]  (the layout does not change the size)
        spec = ExpertSpec(quant, int(text.hidden_size), int(text.moe_intermediate_size))
        spec.check_geometry()
        per_expert = spec.nbytes
    else:
        per_expert = catalogue.expert_bytes
    return WeightBytes(
        embedding_bytes=sizes["embedding"],
        lm_head_bytes=sizes["lm_head"],
        attention_bytes=sizes["attention"],
        mlp_bytes=sizes["mlp"],
        other_language_bytes=sizes["other_language"],
        vision_bytes=sizes["vision"],
        embedding_on_disk_bytes=on_disk,
        bytes_per_expert=per_expert,
        expert_count=len(catalogue.experts),
        bits=bits,
        dense_bits=dense_bits,
        planned=planned,
    )


def bf16_resident_bytes(checkpoint: CheckpointInfo) -> int:
    """The non-expert weights at bf16 (2 bytes per float parameter as the source stores them; integers as is)."""
    total = 0
    for info in checkpoint.resident_tensors.values():
        if info.torch_dtype.is_floating_point and not info.name.endswith(dense.QUANT_SUFFIXES):
            total += info.nbytes // info.torch_dtype.itemsize * 2
        else:
            total += info.nbytes
    return total
