"""Read a Hugging Face safetensors checkpoint without loading it: headers, validation, the expert catalogue.

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON (dtype, shape and
data_offsets per tensor, relative to the end of the header), then the data. Expert j of a fused
[E, a, b] tensor is one contiguous byte range, so every expert can be read with one or two preads.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vismmoe_edge.errors import VismmoeError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library refuses larger headers too

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

# Fused experts: "...layers.{L}.mlp.experts.gate_up_proj"; per-expert: "...layers.{L}.mlp.experts.{j}.up_proj.weight".
FUSED_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$"
)
PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>.*\.layers\.(?P<layer>\d+)\.mlp\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$"
)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: an absolute file offset, so a pread or an mmap slice finds them."""

    name: str
    shard: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]


@dataclass(frozen=True)
class ExpertPart:
    """One contiguous byte range of one expert's weights.

    `kind` is gate_up, gate, up or down. `shape` is the slice as stored; `transposed` says the stored
    slice is the transpose of the nn.Linear weight (the hub layout of Qwen3-VL-MoE).
    """

    kind: str
    shard: Path
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, int]
    transposed: bool


@dataclass(frozen=True)
class ExpertLocation:
    layer: int
    expert: int
    parts: tuple[ExpertPart, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


@dataclass
class ExpertCatalogue:
    """Every routed expert of every MoE layer, with its byte ranges in the shards."""

    layout: str  # "v5" ([E,2I,H]/[E,H,I]), "hub" ([E,H,2I]/[E,I,H]) or "per_expert"
    num_experts: int
    moe_layers: list[int]
    experts: dict[tuple[int, int], ExpertLocation]
    tensor_names: set[str] = field(default_factory=set)  # checkpoint keys that hold routed experts
    # Quantized checkpoints (layout "quantized"): the quant.record.ExpertSpec of every expert, whose one part is
    # its whole record (kind "record", U8); None for float experts.
    quant: Any = None

    def expert(self, layer: int, expert: int) -> ExpertLocation:
        return self.experts[(layer, expert)]

    def layer_bytes(self, layer: int) -> int:
        return sum(self.experts[(layer, e)].nbytes for e in range(self.num_experts))

    @property
    def total_bytes(self) -> int:
        return sum(loc.nbytes for loc in self.experts.values())

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert as stored (all experts of a model have the same size)."""
        return next(iter(self.experts.values())).nbytes

    @property
    def dtype(self) -> str:
        """The experts' safetensors dtype (one for the whole checkpoint: mixed dtypes are refused)."""
        return next(iter(self.experts.values())).parts[0].dtype


def read_shard_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one safetensors header against the file's real size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise VismmoeError(f"{path}: truncated safetensors file ({size} bytes); re-download this shard")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise VismmoeError(
                    f"{path}: corrupt safetensors header (claims {n} bytes, file has {size}); re-download this shard"
                )
            raw = f.read(n)
    except OSError as e:
        raise VismmoeError(f"{path}: cannot read shard ({e.strerror}); check the path and permissions") from e
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VismmoeError(f"{path}: corrupt safetensors header (not JSON); re-download this shard") from e
    if not isinstance(header, dict):
        raise VismmoeError(f"{path}: corrupt safetensors header (not a JSON object); re-download this shard")

    data_start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise VismmoeError(f"{path}: tensor {name} has a malformed header entry; re-download this shard") from e
        if dtype not in TORCH_DTYPES:
            raise VismmoeError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        itemsize = TORCH_DTYPES[dtype].itemsize
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise VismmoeError(f"{path}: tensor {name} byte range [{begin}, {end}) does not match shape {list(shape)}")
        if data_start + end > size:
            raise VismmoeError(
                f"{path}: tensor {name} ends at byte {data_start + end} past the file end ({size}): "
                "the shard is truncated; re-download it"
            )
        tensors[name] = TensorInfo(name, path, dtype, shape, data_start + begin, end - begin)
    return tensors


def find_shards(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files of a checkpoint directory, and the index's weight_map when there is one."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise VismmoeError(f"{index_path}: not a valid safetensors index (no weight_map); re-download it") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v and Path(v).name == v for k, v in weight_map.items()
        ):
            raise VismmoeError(
                f"{index_path}: weight_map must map tensor names to shard file names in the directory; re-download it"
            )
        shards = sorted({directory / f for f in weight_map.values()})
        missing = [s for s in shards if not s.exists()]
        if missing:
            raise VismmoeError(f"{directory}: shard {missing[0].name} listed in {INDEX_FILE} is missing; download it")
        return shards, weight_map
    if (directory / SINGLE_FILE).exists():
        return [directory / SINGLE_FILE], None
    shards = sorted(directory.glob("*.safetensors"))
    if shards:
        return shards, None
    raise VismmoeError(
        f"{directory}: no safetensors weights (no {INDEX_FILE} or *.safetensors); is it a model directory?"
    )


def read_tensor_table(directory: Path) -> dict[str, TensorInfo]:
    """All tensors of the checkpoint; duplicates and index/shard disagreements are errors."""
    shards, weight_map = find_shards(directory)
    table: dict[str, TensorInfo] = {}
    for shard in shards:
        for name, info in read_shard_header(shard).items():
            if name in table:
                raise VismmoeError(f"tensor {name} appears in both {table[name].shard.name} and {shard.name}")
            table[name] = info
    if weight_map is not None:
        for name, file in weight_map.items():
            if name not in table:
                raise VismmoeError(f"{directory / file}: tensor {name} listed in {INDEX_FILE} is not in the shard")
            if table[name].shard.name != file:
                raise VismmoeError(f"{INDEX_FILE} places tensor {name} in {file}, found in {table[name].shard.name}")
    return table


def _fused_part(info: TensorInfo, expert: int, kind: str, hidden: int, inter: int) -> ExpertPart:
    """One expert's slice of a fused [E, a, b] tensor; `transposed` marks the hub layout."""
    _, a, b = info.shape
    v5_shape = (2 * inter, hidden) if kind == "gate_up_proj" else (hidden, inter)
    hub_shape = (v5_shape[1], v5_shape[0])
    if (a, b) == v5_shape:
        transposed = False
    elif (a, b) == hub_shape:
        transposed = True
    else:
        raise VismmoeError(
            f"{info.shard}: tensor {info.name} has shape {list(info.shape)}, expected "
            f"[E, {v5_shape[0]}, {v5_shape[1]}] or [E, {hub_shape[0]}, {hub_shape[1]}] from config.json"
        )
    per = a * b * TORCH_DTYPES[info.dtype].itemsize
    part = ExpertPart(
        kind="gate_up" if kind == "gate_up_proj" else "down",
        shard=info.shard,
        offset=info.offset + expert * per,
        nbytes=per,
        dtype=info.dtype,
        shape=(a, b),
        transposed=transposed,
    )
    return part


def build_expert_catalogue(
    table: dict[str, TensorInfo], *, num_experts: int, hidden: int, inter: int, expected_layers: list[int] | None = None
) -> ExpertCatalogue:
    """Locate every routed expert, in the fused (either orientation) or the per-expert layout; with
    `expected_layers` (what config.json implies), the checkpoint must hold experts for exactly those layers."""
    fused: dict[int, dict[str, TensorInfo]] = {}
    per_expert: dict[tuple[int, int], dict[str, TensorInfo]] = {}
    for name, info in table.items():
        if m := FUSED_EXPERT_KEY.match(name):
            fused.setdefault(int(m["layer"]), {})[m["kind"]] = info
        elif m := PER_EXPERT_KEY.match(name):
            per_expert.setdefault((int(m["layer"]), int(m["expert"])), {})[m["kind"]] = info
    if fused and per_expert:
        raise VismmoeError("checkpoint mixes fused and per-expert expert tensors; it is not a supported layout")
    if not fused and not per_expert:
        raise VismmoeError("checkpoint has no routed-expert tensors (mlp.experts.*); is it a MoE model?")
    if fused and hidden == 2 * inter:
        # Both layouts give the same shapes: transformers itself silently loads the hub layout untransposed.
        raise VismmoeError(f"hidden_size == 2 * moe_intermediate_size ({hidden}): the expert layout is ambiguous")

    experts: dict[tuple[int, int], ExpertLocation] = {}
    layouts: set[str] = set()
    names: set[str] = set()
    for layer, kinds in sorted(fused.items()):
        for kind in ("gate_up_proj", "down_proj"):
            if kind not in kinds:
                raise VismmoeError(f"layer {layer}: missing tensor mlp.experts.{kind} in the checkpoint")
            info = kinds[kind]
            if len(info.shape) != 3 or info.shape[0] != num_experts:
                raise VismmoeError(
                    f"{info.shard}: tensor {info.name} has shape {list(info.shape)}, expected {num_experts} experts"
                )
            names.add(info.name)
        for e in range(num_experts):
            gate_up = _fused_part(kinds["gate_up_proj"], e, "gate_up_proj", hidden, inter)
            down = _fused_part(kinds["down_proj"], e, "down_proj", hidden, inter)
            if gate_up.transposed != down.transposed:
                raise VismmoeError(f"layer {layer}: gate_up_proj and down_proj are stored in different layouts")
            layouts.add("hub" if gate_up.transposed else "v5")
            experts[(layer, e)] = ExpertLocation(layer, e, (gate_up, down))

    want = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    for (layer, e), kinds in sorted(per_expert.items()):
        parts = []
        for kind, shape in want.items():
            info = kinds.get(kind)
            if info is None:
                raise VismmoeError(f"layer {layer}: missing tensor mlp.experts.{e}.{kind}.weight in the checkpoint")
            if info.shape != shape:
                raise VismmoeError(
                    f"{info.shard}: tensor {info.name} has shape {list(info.shape)},"
                    f" expected {list(shape)} from config.json"
                )
            names.add(info.name)
            parts.append(
                ExpertPart(kind.removesuffix("_proj"), info.shard, info.offset, info.nbytes, info.dtype, shape, False)
            )
        experts[(layer, e)] = ExpertLocation(layer, e, tuple(parts))
        layouts.add("per_expert")

    dtypes = {(p.dtype, p.shard.name) for loc in experts.values() for p in loc.parts}
    if len({d for d, _ in dtypes}) > 1:
        found = ", ".join(sorted(f"{d} in {s}" for d, s in dtypes)[:4])
        raise VismmoeError(f"expert tensors mix dtypes ({found}); the checkpoint is inconsistent")
    if not TORCH_DTYPES[next(iter(dtypes))[0]].is_floating_point:
        raise VismmoeError(
            f"expert tensors have dtype {next(iter(dtypes))[0]}; quantised experts are not supported yet"
        )
    moe_layers = sorted({layer for layer, _ in experts})
    if expected_layers is not None and moe_layers != expected_layers:
        raise VismmoeError(f"checkpoint has experts for layers {moe_layers}, config.json implies {expected_layers}")
    for layer in moe_layers:
        for e in range(num_experts):
            if (layer, e) not in experts:
                raise VismmoeError(f"layer {layer}: expert {e} is missing from the checkpoint")
    if len(layouts) != 1:
        raise VismmoeError(f"checkpoint mixes expert layouts {sorted(layouts)}; it is not a supported layout")
    return ExpertCatalogue(layouts.pop(), num_experts, moe_layers, experts, names)
