"""A source checkpoint seen as logical weights, whatever it was saved as: dense, FP8, compressed-tensors or AWQ.

Each logical weight keeps its name (`x.weight` for quantized linears), its shape, and where its parts are;
`read` dequantizes on demand, reading one tensor (or one expert's slice) at a time with pread (reader.py), so
the converter never holds more than that in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vismmoe_edge.checkpoint import TORCH_DTYPES, TensorInfo, read_tensor_table
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant.config import QUANT_METHOD
from vismmoe_edge.quant.formats import awq, compressed_tensors, fp8
from vismmoe_edge.quant.quantize import Int4Groups
from vismmoe_edge.quant.reader import PreadFiles

DEQUANTIZED_DTYPE = "BF16"  # what non-expert weights of a quantized source become
METHODS = ("fp8", "compressed-tensors", "awq")
_FP8_DROPPED = ("input_scale", "activation_scale")  # static activation scales: we compute activations in bf16


@dataclass(frozen=True)
class Logical:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype it is written in when kept (the source's, or BF16 once dequantized)
    kind: str  # "raw", "fp8", "compressed-tensors" or "awq"
    parts: dict[str, TensorInfo]
    group_size: int | None = None  # int4 sources


def _suffix_split(name: str, suffixes: tuple[str, ...]) -> tuple[str, str] | None:
    for s in suffixes:
        if name.endswith("." + s):
            return name[: -len(s) - 1], s
    return None


class SourceCheckpoint:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        path = self.directory / "config.json"
        try:
            self.config: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise VismmoeError(f"{self.directory}: no config.json; point at a Hugging Face model directory") from e
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise VismmoeError(f"{path}: not valid JSON ({e}); re-download it") from e
        if not isinstance(self.config, dict):
            raise VismmoeError(f"{path}: not a JSON object; re-download it")
        qc = self.config.get("quantization_config")
        self.method: str | None = None if qc is None else self._method(qc, str(path))
        self.quant_config: dict[str, Any] = qc or {}
        self.table = read_tensor_table(self.directory)
        self.files = PreadFiles()
        self.logical: dict[str, Logical] = self._logical(str(path))

    @staticmethod
    def _method(qc: Any, where: str) -> str:
        if not isinstance(qc, dict):
            raise VismmoeError(f"{where}: quantization_config is not a JSON object; re-download config.json")
        method = qc.get("quant_method")
        if method == QUANT_METHOD:
            raise VismmoeError(f"{where}: already quantized by vismmoe-edge; convert the original checkpoint instead")
        if method not in METHODS:
            raise VismmoeError(
                f"{where}: quantization {method!r} is not supported; convert from bf16, FP8 (block-128), "
                "compressed-tensors W4A16 or AWQ GEMM"
            )
        return method

    def _logical(self, where: str) -> dict[str, Logical]:
        if self.method == "fp8":
            return self._fp8(fp8.parse_config(self.quant_config, where))
        if self.method == "compressed-tensors":
            return self._grouped(compressed_tensors.SUFFIXES, "compressed-tensors", where)
        if self.method == "awq":
            return self._grouped(awq.SUFFIXES, "awq", where)
        out = {}
        for name, info in self.table.items():
            if info.dtype.startswith("F8") or _suffix_split(name, ("weight_packed", "qweight")):
                raise VismmoeError(
                    f"{self.directory}: tensor {name} is quantized but config.json has no quantization_config"
                )
            out[name] = Logical(name, info.shape, info.dtype, "raw", {"": info})
        return out

    def _fp8(self, block: tuple[int, int]) -> dict[str, Logical]:
        self.fp8_block = block
        out: dict[str, Logical] = {}
        scales = {n for n in self.table if n.endswith(fp8.SCALE_SUFFIX)}
        for name, info in self.table.items():
            if name in scales or _suffix_split(name, _FP8_DROPPED):
                continue
            if info.dtype != "F8_E4M3":
                out[name] = Logical(name, info.shape, info.dtype, "raw", {"": info})
                continue
            scale = self.table.get(fp8.scale_name(name))
            if scale is None:
                raise VismmoeError(f"{info.shard}: FP8 tensor {name} has no {fp8.scale_name(name)}; re-download it")
            scales.discard(scale.name)
            out[name] = Logical(name, info.shape, DEQUANTIZED_DTYPE, "fp8", {"weight": info, "scale": scale})
        for orphan in sorted(scales):
            if orphan.removesuffix(fp8.SCALE_SUFFIX) not in self.table:
                raise VismmoeError(f"{self.table[orphan].shard}: {orphan} has no FP8 weight; the checkpoint is broken")
        return out

    def _grouped(self, suffixes: tuple[str, ...], kind: str, where: str) -> dict[str, Logical]:
        groups: dict[str, dict[str, TensorInfo]] = {}
        out: dict[str, Logical] = {}
        for name, info in self.table.items():
            split = _suffix_split(name, suffixes)
            if split is None:
                out[name] = Logical(name, info.shape, info.dtype, "raw", {"": info})
            else:
                groups.setdefault(split[0], {})[split[1]] = info
        if kind == "awq":
            group = awq.parse_config(self.quant_config, where)
        else:
            scheme = compressed_tensors.parse_config(self.quant_config, where)
        for base, parts in sorted(groups.items()):
            required = ("qweight", "qzeros", "scales") if kind == "awq" else ("weight_packed", "weight_scale")
            missing = [s for s in required if s not in parts]
            if missing:
                shard = next(iter(parts.values())).shard
                raise VismmoeError(f"{shard}: {base}.{missing[0]} is missing; the checkpoint is incomplete")
            if kind == "awq":
                q = parts["qweight"]
                shape = (q.shape[1] * 8, q.shape[0])
                g = shape[1] if group == -1 else group
            else:
                if "weight_g_idx" in parts:
                    raise VismmoeError(
                        f"{parts['weight_g_idx'].shard}: {base}.weight_g_idx: activation-ordered (act-order) "
                        "weights are not supported; use a checkpoint quantized without act-order"
                    )
                shape = self._ct_shape(base, parts)
                g = compressed_tensors.group_size_for(scheme, shape, parts["weight_scale"].shape, base)
            name = base + ".weight"
            if name in out:
                raise VismmoeError(f"{where}: {name} is stored both dense and quantized; the checkpoint is broken")
            out[name] = Logical(name, shape, DEQUANTIZED_DTYPE, kind, parts, g)
        return out

    def _ct_shape(self, base: str, parts: dict[str, TensorInfo]) -> tuple[int, int]:
        info = parts.get("weight_shape")
        if info is None:
            packed = parts["weight_packed"]
            return packed.shape[0], packed.shape[1] * 8  # no shape tensor: assume no padding
        shape = tuple(int(v) for v in self.files.read(info).tolist())
        if len(shape) != 2 or shape[0] <= 0 or shape[1] <= 0:
            raise VismmoeError(f"{info.shard}: {info.name} = {list(shape)} is not a 2-D shape (broken checkpoint)")
        return shape  # type: ignore[return-value]

    # --- reading ---------------------------------------------------------------------------------------------

    def _part(self, info: TensorInfo, index: int | None) -> torch.Tensor:
        return self.files.read(info, index)

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """The weight (or slice `index` of a fused [E, ...] weight): in the source dtype when it is stored dense,
        else dequantized to float32."""
        lt = self.logical[name]
        if lt.kind == "raw":
            return self._part(lt.parts[""], index)
        if lt.kind == "fp8":
            return fp8.dequantize(self._part(lt.parts["weight"], index), self._part(lt.parts["scale"], index),
                                  self.fp8_block)  # fmt: skip
        if index is not None:
            raise ValueError(f"{name}: {lt.kind} weights are 2-D, they have no expert index")
        parts = {s: self.files.read(i) for s, i in lt.parts.items()}
        if lt.kind == "awq":
            return awq.dequantize(parts, lt.group_size, name)
        return compressed_tensors.dequantize(parts, lt.shape, lt.group_size, name)  # type: ignore[arg-type]

    def int4(self, name: str) -> Int4Groups | None:
        """The source's own int4 codes and groups (AWQ, compressed-tensors) when they tile the weight exactly."""
        lt = self.logical[name]
        if lt.kind not in ("awq", "compressed-tensors") or lt.shape[1] % lt.group_size:
            return None
        parts = {s: self.files.read(i) for s, i in lt.parts.items()}
        if lt.kind == "awq":
            return awq.int4_groups(parts, lt.group_size, name)
        return compressed_tensors.int4_groups(parts, lt.shape, lt.group_size, name)  # type: ignore[arg-type]

    def itemsize(self, name: str) -> int:
        return TORCH_DTYPES[self.logical[name].dtype].itemsize

    def close(self) -> None:
        self.files.close()
