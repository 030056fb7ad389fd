"""Our `quantization_config` (config.json): what it says, how it is written, and the one reader that checks it.

    "quantization_config": {
      "quant_method": "vismmoe",            # ours; anything else is another tool's format
      "format_version": 1,
      "bits": 4,                             # 4 or 8
      "group_size": 128,                     # int4: inputs per (scale, zero); int8: null (one scale per output)
      "symmetric": false,                    # int4 asymmetric (float zero), int8 symmetric
      "layout": "cpu_b64_split",             # int4 nibble layout (packing.INT4_LAYOUTS); int8: "rowmajor"
      "scale_dtype": "bfloat16",
      "quantized_modules": ["routed_experts"],  # everything else is kept at the source dtype
      "expert_record": ["gate_up_proj.qweight", "gate_up_proj.scales_zeros", "down_proj.qweight", ...],
      "source": {"quant_method": "fp8" | "compressed-tensors" | "awq" | null}   # informational
    }

With `quantize --dense-bits 8|4` the file is format_version 2: quantized_modules is ["routed_experts",
"dense_linear"] and `"dense": {"bits": 4, "group_size": 128, "vision_bits": 8}` says how the attention
projections, lm_head, dense/shared MLPs (dense_bits, int4 groups of at most group_size) and the vision tower's
linears (int8) were stored (quant/dense.py: each linear's own tensors say which it got). A version-1 reader
refuses version 2 in one line.

docs/quantization.md describes the tensors; record.py computes their shapes from this and the model geometry.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.packing import INT4_LAYOUTS, ROWMAJOR

QUANT_METHOD = "vismmoe"
FORMAT_VERSION = 1
DENSE_FORMAT_VERSION = 2  # files with quantized dense weights
QUANTIZED_MODULES = ("routed_experts",)
DENSE_MODULES = ("routed_experts", "dense_linear")
VISION_BITS = 8
KERNEL_GROUP_SIZES = (32, 64, 128, 256)  # what `_weight_int4pack_mm` (CPU and CUDA) accepts
DEFAULT_INT4_GROUP = 128
RECORD_FIELDS = {
    4: ("gate_up_proj.qweight", "gate_up_proj.scales_zeros", "down_proj.qweight", "down_proj.scales_zeros"),
    8: ("gate_up_proj.qweight", "gate_up_proj.scales", "down_proj.qweight", "down_proj.scales"),
}
_KEYS = {
    "quant_method", "format_version", "bits", "group_size", "symmetric", "layout", "scale_dtype",
    "quantized_modules", "expert_record", "source", "dense",
}  # fmt: skip


@dataclass(frozen=True)
class QuantConfig:
    bits: int
    group_size: int | None
    layout: str
    source: dict[str, Any] = field(default_factory=dict, compare=False)
    dense_bits: int | None = None  # attention, lm_head, dense MLPs: None = kept at the source dtype
    dense_group_size: int | None = None  # int4 dense only

    @property
    def record(self) -> tuple[str, ...]:
        return RECORD_FIELDS[self.bits]

    def to_dict(self) -> dict[str, Any]:
        out = {
            "quant_method": QUANT_METHOD,
            "format_version": FORMAT_VERSION if self.dense_bits is None else DENSE_FORMAT_VERSION,
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.bits == 8,
            "layout": self.layout,
            "scale_dtype": "bfloat16",
            "quantized_modules": list(QUANTIZED_MODULES if self.dense_bits is None else DENSE_MODULES),
            "expert_record": list(self.record),
            "source": dict(self.source),
        }
        if self.dense_bits is not None:
            out["dense"] = {"bits": self.dense_bits, "group_size": self.dense_group_size, "vision_bits": VISION_BITS}
        return out


def check_dense_bits(dense_bits: int | None, group_size: int | None) -> None:
    if dense_bits is None:
        return
    if dense_bits not in (4, 8):
        raise VismmoeError(f"--dense-bits {dense_bits}: use 4 or 8 (or leave it out to keep the dense weights)")
    if dense_bits == 4 and group_size not in KERNEL_GROUP_SIZES:
        raise VismmoeError(f"dense group size {group_size}: int4 dense weights use one of {KERNEL_GROUP_SIZES}")


def pick_group_size(hidden: int, inter: int) -> int:
    """The int4 group when --group-size is not given: it must divide both matrices' inputs (hidden for gate_up,
    moe_intermediate for down). 128 if it does, else the largest kernel group that does (the fast path), else
    the largest even divisor of both up to 128 (correct, through the dequantizing fallback)."""
    for g in (DEFAULT_INT4_GROUP, *sorted((g for g in KERNEL_GROUP_SIZES if g < DEFAULT_INT4_GROUP), reverse=True)):
        if hidden % g == 0 and inter % g == 0:
            return g
    common = math.gcd(hidden, inter)
    for g in range(min(common, DEFAULT_INT4_GROUP), 1, -1):
        if common % g == 0 and g % 2 == 0:
            return g
    raise VismmoeError(
        f"hidden {hidden} and moe_intermediate {inter} share no even divisor: int4 groups cannot fit (use --bits 8)"
    )


def make_config(bits: int, group_size: int | None, layout: str, source: dict[str, Any] | None = None) -> QuantConfig:
    """A checked QuantConfig from user choices (the converter's arguments)."""
    if bits == 4:
        if group_size is None or isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
            raise VismmoeError(f"--group-size {group_size}: int4 needs an even group size >= 2 (default 128)")
        if group_size % 2:
            raise VismmoeError(f"--group-size {group_size}: must be even (two int4 codes per byte)")
        if layout not in INT4_LAYOUTS:
            raise VismmoeError(f"--layout {layout}: int4 layouts are {', '.join(INT4_LAYOUTS)}")
    elif bits == 8:
        if group_size is not None:
            raise VismmoeError(
                f"--group-size {group_size}: int8 is per output channel (the int8 kernel has no groups); drop it"
            )
        if layout != ROWMAJOR:
            raise VismmoeError(f"--layout {layout}: int8 has one layout, {ROWMAJOR}")
    else:
        raise VismmoeError(f"--bits {bits}: use 4 or 8")
    return QuantConfig(bits, group_size, layout, dict(source or {}))


def parse_quant_config(raw: Any, where: str) -> QuantConfig:
    """Check a `quantization_config` dict of ours; every problem is one line naming `where` (a path)."""
    if not isinstance(raw, dict):
        raise VismmoeError(f"{where}: quantization_config is not a JSON object; re-run vismmoe-edge quantize")
    method = raw.get("quant_method")
    if method != QUANT_METHOD:
        raise VismmoeError(
            f"{where}: quantization_config.quant_method is {method!r}, not {QUANT_METHOD!r}; "
            "convert it with vismmoe-edge quantize first"
        )
    version = raw.get("format_version")
    if version not in (FORMAT_VERSION, DENSE_FORMAT_VERSION):
        raise VismmoeError(
            f"{where}: quantized format version {version!r}, this vismmoe-edge reads versions {FORMAT_VERSION} and "
            f"{DENSE_FORMAT_VERSION}; re-run vismmoe-edge quantize or upgrade"
        )
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise VismmoeError(f"{where}: unknown quantization_config field {unknown[0]!r}; not ours, or corrupt")
    bits, group, layout = raw.get("bits"), raw.get("group_size"), raw.get("layout")
    try:
        qc = make_config(bits, group, layout, raw.get("source") or {})
    except VismmoeError as e:
        raise VismmoeError(f"{where}: invalid quantization_config ({str(e).replace('--', '')})") from e
    dense = raw.get("dense")
    if (dense is not None) != (version == DENSE_FORMAT_VERSION):
        raise VismmoeError(f"{where}: quantization_config has 'dense' only in format version {DENSE_FORMAT_VERSION}")
    if dense is not None:
        if not isinstance(dense, dict) or set(dense) != {"bits", "group_size", "vision_bits"}:
            raise VismmoeError(f"{where}: quantization_config.dense must hold bits, group_size and vision_bits")
        try:
            check_dense_bits(dense["bits"], dense["group_size"])
        except VismmoeError as e:
            raise VismmoeError(f"{where}: invalid quantization_config.dense ({str(e).replace('--', '')})") from e
        qc = QuantConfig(qc.bits, qc.group_size, qc.layout, qc.source, dense["bits"], dense["group_size"])
    modules = QUANTIZED_MODULES if dense is None else DENSE_MODULES
    if raw.get("quantized_modules") != list(modules):
        raise VismmoeError(f"{where}: quantization_config.quantized_modules must be {list(modules)}")
    if raw.get("expert_record") != list(qc.record):
        raise VismmoeError(f"{where}: quantization_config.expert_record does not match {bits}-bit records")
    if raw.get("symmetric") != (bits == 8) or raw.get("scale_dtype") != "bfloat16":
        raise VismmoeError(f"{where}: quantization_config symmetric/scale_dtype do not match {bits}-bit records")
    return qc


def read_quant_config(directory: Path) -> QuantConfig:
    """The QuantConfig of a quantized checkpoint directory (config.json), or a one-line VismmoeError."""
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise VismmoeError(f"{directory}: no config.json; point at a quantized model directory") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VismmoeError(f"{path}: not valid JSON ({e}); re-run vismmoe-edge quantize") from e
    if not isinstance(raw, dict) or "quantization_config" not in raw:
        raise VismmoeError(f"{path}: no quantization_config; this checkpoint is not quantized")
    return parse_quant_config(raw["quantization_config"], str(path))
