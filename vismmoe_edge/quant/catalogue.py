"""Where each quantized expert is: one (shard, offset, nbytes) range per (layer, expert), checked against config.

The engine sees these ranges as an ExpertCatalogue whose experts have one part each, the whole record
(`expert_catalogue`, `checkpoint_catalogue`): one pread (or one mmap view) per miss, then
kernels.expert_views(buf, catalogue.quant) over the bytes. Budgets, telemetry and the oracle count those bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vismmoe_edge.checkpoint import (
    FUSED_EXPERT_KEY,
    PER_EXPERT_KEY,
    ExpertCatalogue,
    ExpertLocation,
    ExpertPart,
    TensorInfo,
)
from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import QUANT_METHOD, QuantConfig, parse_quant_config
from vismmoe_edge.quant.record import RECORD_PART, ExpertSpec

RECORD_KEY = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\."
    r"(?P<field>(?:gate_up|down)_proj\.(?:qweight|scales_zeros|scales))$"
)
CONVERTIBLE = ("fp8", "compressed-tensors", "awq")  # what `vismmoe-edge quantize` reads (quant/source.py)


@dataclass(frozen=True)
class ExpertRange:
    layer: int
    expert: int
    shard: Path
    offset: int  # absolute file offset of the record's first byte
    nbytes: int


@dataclass
class QuantizedCatalogue:
    spec: ExpertSpec
    num_experts: int
    moe_layers: list[int]
    experts: dict[tuple[int, int], ExpertRange]
    tensor_names: set[str] = field(default_factory=set)  # the record tensors (not to load as plain weights)

    def expert(self, layer: int, expert: int) -> ExpertRange:
        return self.experts[(layer, expert)]

    @property
    def expert_bytes(self) -> int:
        return self.spec.nbytes

    @property
    def total_bytes(self) -> int:
        return self.spec.nbytes * len(self.experts)

    def expert_catalogue(self) -> ExpertCatalogue:
        """The engine's catalogue: each expert one part, its whole record (U8 [nbytes]), and `quant` = the spec."""
        experts = {
            key: ExpertLocation(r.layer, r.expert, (ExpertPart(RECORD_PART, r.shard, r.offset, r.nbytes, "U8",
                                                               (r.nbytes,), False),))  # fmt: skip
            for key, r in self.experts.items()
        }
        return ExpertCatalogue("quantized", self.num_experts, self.moe_layers, experts, set(self.tensor_names),
                               quant=self.spec)  # fmt: skip


def quantized_expert_ranges(
    table: dict[str, TensorInfo],
    quant: QuantConfig,
    *,
    hidden: int,
    inter: int,
    num_experts: int,
    moe_layers: list[int] | None = None,
) -> QuantizedCatalogue:
    """Every expert's record as one byte range; each field's dtype, shape and position are checked."""
    spec = ExpertSpec(quant, hidden, inter)
    found: dict[tuple[int, int], dict[str, TensorInfo]] = {}
    for name, info in table.items():
        if m := RECORD_KEY.match(name):
            found.setdefault((int(m["layer"]), int(m["expert"])), {})[m["field"]] = info
        elif FUSED_EXPERT_KEY.match(name) or PER_EXPERT_KEY.match(name):
            raise VismmoeError(f"{info.shard}: {name} is a dense expert in a quantized checkpoint; re-run quantize")
    if not found:
        raise VismmoeError("quantized checkpoint has no expert records (mlp.experts.{j}.*.qweight); re-run quantize")
    layers = sorted({layer for layer, _ in found})
    if moe_layers is not None and layers != list(moe_layers):
        raise VismmoeError(f"quantized checkpoint has experts for layers {layers}, config.json implies {moe_layers}")
    wanted = {f.name: f for f in spec.fields}
    experts: dict[tuple[int, int], ExpertRange] = {}
    names: set[str] = set()
    for (layer, e), fields in sorted(found.items()):
        if e >= num_experts:
            raise VismmoeError(f"layer {layer}: expert {e} found, config.json has {num_experts} experts")
        first = None
        for fname, want in wanted.items():
            info = fields.get(fname)
            if info is None:
                raise VismmoeError(f"layer {layer}: expert {e} has no {fname}; the checkpoint is incomplete")
            if info.dtype != want.dtype or info.shape != want.shape:
                raise VismmoeError(
                    f"{info.shard}: {info.name} is {info.dtype} {list(info.shape)}, config.json implies "
                    f"{want.dtype} {list(want.shape)} (hidden {hidden}, moe_intermediate {inter}, "
                    f"{quant.bits}-bit, group {quant.group_size})"
                )
            if first is None:
                first = info
            if info.shard != first.shard or info.offset != first.offset + want.offset:
                raise VismmoeError(
                    f"{info.shard}: {info.name} is not stored right after the rest of its expert; "
                    "the record is not contiguous (re-run quantize)"
                )
            names.add(info.name)
        extra = sorted(set(fields) - set(wanted))
        if extra:
            raise VismmoeError(f"layer {layer}: expert {e} has {extra[0]}, not part of {quant.bits}-bit records")
        experts[(layer, e)] = ExpertRange(layer, e, first.shard, first.offset, spec.nbytes)
    for layer in layers:
        for e in range(num_experts):
            if (layer, e) not in experts:
                raise VismmoeError(f"layer {layer}: expert {e} is missing from the quantized checkpoint")
    return QuantizedCatalogue(spec, num_experts, layers, experts, names)


def _check_groups(spec: ExpertSpec, where: str) -> None:
    for matrix, (_, k) in spec.matrices.items():
        if spec.quant.bits == 4 and k % spec.quant.group_size:  # type: ignore[operator]
            raise VismmoeError(
                f"{where}: group_size {spec.quant.group_size} does not divide {matrix}'s {k} inputs (hidden "
                f"{spec.hidden}, moe_intermediate {spec.inter}); the checkpoint is inconsistent, re-run quantize"
            )


def checkpoint_catalogue(family: Any, config: Any, table: dict[str, TensorInfo], directory: Path) -> ExpertCatalogue:
    """The expert catalogue of any checkpoint directory: the family's for float experts, one record per expert for
    ours (config.json's quantization_config), and a one-line refusal for another tool's quantization."""
    raw = read_config_json(Path(directory)).get("quantization_config")
    if raw is None:
        return family.catalogue_for(config, table)
    where = str(Path(directory) / "config.json")
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method != QUANT_METHOD:
        if method in CONVERTIBLE:
            raise VismmoeError(
                f"{where}: a {method} checkpoint; convert it first: vismmoe-edge quantize {directory} OUT --bits 4"
            )
        raise VismmoeError(
            f"{where}: quantization {method!r} is not supported; run a bf16, FP8, compressed-tensors W4A16 or AWQ "
            "checkpoint through vismmoe-edge quantize"
        )
    quant = parse_quant_config(raw, where)
    text = config.text_config
    spec = ExpertSpec(quant, int(text.hidden_size), int(text.moe_intermediate_size))
    _check_groups(spec, where)
    return quantized_expert_ranges(
        table, quant, hidden=spec.hidden, inter=spec.inter, num_experts=family.routed_experts(config),
        moe_layers=family.moe_layers(config),
    ).expert_catalogue()  # fmt: skip
