"""`quantize_checkpoint`: a model directory (bf16/fp32, FP8, compressed-tensors W4A16, AWQ) -> our int4/int8 one.

Routed experts become records (record.py: codes, scales and zeros of one expert back to back); with `dense_bits`
the model's other linears become int4/int8 matrices too (dense.py); every other tensor keeps its name and bytes
(quantized ones of an FP8/W4A16/AWQ source are dequantized to bf16). Memory
stays at one tensor, or one expert, at a time: sources are read through mmap and shards are streamed out.
The output is built in a hidden directory beside OUT, config.json written last, and renamed into place at the
end, so an interrupted run leaves nothing at OUT (and nothing with a config.json) that could load as a model.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vismmoe_edge.checkpoint import (
    FUSED_EXPERT_KEY,
    INDEX_FILE,
    PER_EXPERT_KEY,
    TORCH_DTYPES,
    ExpertCatalogue,
    TensorInfo,
)
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.quant import dense
from vismmoe_edge.quant.config import DEFAULT_INT4_GROUP, QuantConfig, check_dense_bits, make_config, pick_group_size
from vismmoe_edge.quant.packing import ROWMAJOR, native_cpu_layout
from vismmoe_edge.quant.quantize import cat_rows
from vismmoe_edge.quant.record import ExpertSpec, encode_expert
from vismmoe_edge.quant.shards import Entry, ShardWriter, parse_size, plan_shards
from vismmoe_edge.quant.source import SourceCheckpoint
from vismmoe_edge.units import format_bytes

DEFAULT_MAX_SHARD = "4GB"
_WEIGHT_FILES = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.ckpt|\.gguf|\.h5|\.msgpack|\.index\.json)$")
_LAYER = re.compile(r"\.layers\.(\d+)\.")

Producer = Callable[[], list[torch.Tensor]]
# The model family's float catalogue of a source directory's (dense) tensors: which are routed experts and where.
FloatCatalogue = Callable[[Path, dict[str, TensorInfo]], ExpertCatalogue]
# The model family's nn.Linear weights of a source directory: name -> (N, K) (routers and routed experts left out).
LinearWeights = Callable[[Path], dict[str, tuple[int, int]]]


@dataclass
class Unit:
    """Tensors written together (one expert's record, or one plain tensor) and how to make them."""

    entries: list[Entry]
    make: Producer

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    @property
    def sort_key(self) -> tuple[int, str]:
        m = _LAYER.search(self.entries[0].name)
        return (int(m[1]) if m else -1, self.entries[0].name)


def resolve_layout(bits: int, layout: str) -> str:
    """ "auto": for int4 this CPU's kernel tiles (the unified tier reads them in place), else row-major."""
    if layout != "auto":
        return layout
    return ROWMAJOR if bits == 8 else (native_cpu_layout() or ROWMAJOR)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise VismmoeError(f"{out}: already exists and is not an empty directory; pick a new output directory")


def _logical_table(source: SourceCheckpoint) -> dict[str, TensorInfo]:
    """TensorInfos of the dense weights the source stands for, for the families' catalogue checks."""
    table = {}
    for name, lt in source.logical.items():
        info = next(iter(lt.parts.values()))
        nbytes = TORCH_DTYPES[lt.dtype].itemsize * int(torch.Size(lt.shape).numel())
        table[name] = TensorInfo(name, info.shard, lt.dtype, lt.shape, info.offset, nbytes)
    return table


Readers = dict[tuple[int, int], tuple[str, Producer]]  # (layer, expert) -> (output name prefix, record maker)


def _fused_readers(source: SourceCheckpoint, names: set[str], hub: bool, spec: ExpertSpec) -> Readers:
    """Qwen3-VL-MoE's fused [E, 2I, H] / [E, H, I] tensors (or the hub layout's transposes), one slice per expert."""
    layers: dict[int, dict[str, str]] = {}
    prefixes: dict[int, str] = {}
    for n in names:
        m = FUSED_EXPERT_KEY.match(n)
        layers.setdefault(int(m["layer"]), {})[m["kind"]] = n
        prefixes[int(m["layer"])] = m["prefix"]
    out: Readers = {}
    for layer, kinds in layers.items():
        gu, dn = kinds["gate_up_proj"], kinds["down_proj"]
        for e in range(source.logical[gu].shape[0]):

            def make(e: int = e, gu: str = gu, dn: str = dn) -> list[torch.Tensor]:
                gate_up, down = source.read(gu, e).to(torch.float32), source.read(dn, e).to(torch.float32)
                if hub:  # [H, 2I] / [I, H] on disk: the transposes of nn.Linear's weights
                    gate_up, down = gate_up.t(), down.t()
                return encode_expert(spec, gate_up, down)

            out[(layer, e)] = (f"{prefixes[layer]}.{e}", make)
    return out


def _per_expert_readers(source: SourceCheckpoint, names: set[str], spec: ExpertSpec) -> Readers:
    """experts.{j}.{gate,up,down}_proj.weight; int4 sources (AWQ, W4A16) of the same group keep their own codes."""
    bases = {}
    for n in names:
        m = PER_EXPERT_KEY.match(n)
        bases[(int(m["layer"]), int(m["expert"]))] = f"{m['prefix']}.{m['expert']}"
    out: Readers = {}
    for key, base in bases.items():

        def make(base: str = base) -> list[torch.Tensor]:
            gate, up, down = (f"{base}.{k}_proj.weight" for k in ("gate", "up", "down"))
            if spec.quant.bits == 4:
                q = [source.int4(n) for n in (gate, up, down)]
                if all(g is not None and g.group_size == spec.quant.group_size for g in q):
                    # transcoding: the codes stay, only scales and float zeros are rounded to bf16
                    return encode_expert(spec, cat_rows([q[0], q[1]]), q[2])  # type: ignore[list-item,arg-type]
            w = [source.read(n).to(torch.float32) for n in (gate, up, down)]
            return encode_expert(spec, torch.cat(w[:2]), w[2])

        out[key] = (base, make)
    return out


def _plain_unit(source: SourceCheckpoint, name: str) -> Unit:
    lt = source.logical[name]

    def make() -> list[torch.Tensor]:
        t = source.read(name)
        return [t if lt.kind == "raw" else t.to(TORCH_DTYPES[lt.dtype])]

    return Unit([Entry(name, lt.dtype, lt.shape)], make)


def _dense_unit(source: SourceCheckpoint, choice: dense.DenseChoice, layout: str) -> Unit:
    def make() -> list[torch.Tensor]:
        return dense.encode(choice, source.read(choice.weight), layout)

    return Unit([Entry(name, dtype, shape) for name, dtype, shape in choice.fields(layout)], make)


def _geometry(catalogue) -> tuple[int, int]:
    """(hidden, moe_intermediate) from the first expert's parts as the catalogue found them."""
    parts = {p.kind: (p.shape[::-1] if p.transposed else p.shape) for p in next(iter(catalogue.experts.values())).parts}
    hidden, inter = parts["down"]
    return hidden, inter


def _shard_names(n: int) -> Iterator[str]:
    for k in range(1, n + 1):
        yield f"model-{k:05d}-of-{n:05d}.safetensors"


def _write_shard(path: Path, units: list[Unit], bar: tqdm) -> None:
    writer = ShardWriter(path, [e for u in units for e in u.entries])
    try:
        for unit in units:
            for entry, tensor in zip(unit.entries, unit.make(), strict=True):
                writer.write(entry.name, tensor)
                bar.update(entry.nbytes)
        writer.close()
    except BaseException:
        writer.abort()
        raise


def _copy_extra_files(src: Path, dst: Path) -> list[str]:
    """Tokenizer, processor, chat template, generation config...: every top-level file that is not weights."""
    copied = []
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.name != "config.json" and not _WEIGHT_FILES.search(f.name):
            shutil.copy2(f, dst / f.name)
            copied.append(f.name)
    return copied


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, obj: object) -> None:
    with path.open("w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _plan(
    source: SourceCheckpoint,
    catalogue_of: FloatCatalogue,
    bits: int,
    group_size: int | None,
    layout: str,
    dense_bits: int | None = None,
    linears_of: LinearWeights | None = None,
) -> tuple[ExpertSpec, list[Unit]]:
    """The quantization spec, checked against the model's geometry, and every output unit in file order."""
    catalogue = catalogue_of(source.directory, _logical_table(source))
    hidden, inter = _geometry(catalogue)
    if bits == 4 and group_size is None:
        group_size = pick_group_size(hidden, inter)
    origin = {"quant_method": source.method, "expert_layout": catalogue.layout}
    quant = make_config(bits, group_size, layout, origin)
    dense_group = DEFAULT_INT4_GROUP  # at most: each matrix takes the largest kernel group dividing its width
    if dense_bits is not None:
        quant = QuantConfig(bits, group_size, layout, origin, dense_bits, dense_group if dense_bits == 4 else None)
    spec = ExpertSpec(quant, hidden, inter)
    spec.check_geometry()
    linears = linears_of(source.directory) if dense_bits is not None and linears_of is not None else {}
    units = []
    for n in sorted(source.logical):
        if n in catalogue.tensor_names:
            continue
        if n in linears and tuple(source.logical[n].shape) == linears[n]:
            assert dense_bits is not None and dense_group is not None
            units.append(_dense_unit(source, dense.choose(n, *linears[n], dense_bits, dense_group), layout))
        else:
            units.append(_plain_unit(source, n))
    if catalogue.layout == "per_expert":
        readers = _per_expert_readers(source, catalogue.tensor_names, spec)
    else:
        readers = _fused_readers(source, catalogue.tensor_names, catalogue.layout == "hub", spec)
    for _, (prefix, make) in sorted(readers.items()):
        units.append(Unit([Entry(f"{prefix}.{f.name}", f.dtype, f.shape) for f in spec.fields], make))
    units.sort(key=lambda u: u.sort_key)  # layer by layer, as the source is laid out
    return spec, units


def _write(tmp: Path, units: list[Unit], max_shard_bytes: int, progress: bool) -> None:
    """Shards and index into `tmp`, one unit in memory at a time."""
    shards = [[units[i] for i in group] for group in plan_shards([u.nbytes for u in units], max_shard_bytes)]
    total = sum(u.nbytes for u in units)
    free = shutil.disk_usage(tmp).free
    if free < total:  # refused before an hour of converting ends in ENOSPC
        raise VismmoeError(
            f"the output needs {format_bytes(total)} and {tmp.parent} has {format_bytes(free)} free: free space "
            "there or write the output elsewhere"
        )
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="quantizing", disable=not progress) as bar:
        for name, shard in zip(_shard_names(len(shards)), shards, strict=True):
            try:
                _write_shard(tmp / name, shard, bar)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise VismmoeError(
                    f"{tmp.parent} filled up while writing {name} ({format_bytes(total)} in all): free space there "
                    "or write the output elsewhere"
                ) from e
            weight_map.update(dict.fromkeys((e.name for u in shard for e in u.entries), name))
    _write_json(tmp / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def quantize_checkpoint(
    src: Path,
    out: Path,
    bits: int,
    group_size: int | None = None,
    progress: bool = True,
    *,
    catalogue_of: FloatCatalogue,
    layout: str = "auto",
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    dense_bits: int | None = None,
    linears_of: LinearWeights | None = None,
    source: SourceCheckpoint | None = None,
) -> Path:
    """Write an int4 (group-wise, default g128) or int8 (per-channel) copy of the checkpoint at `src` to `out`;
    `catalogue_of` is the model family's (vismmoe_edge.conversion passes it).

    `group_size` is for int4 only; it must divide hidden_size and moe_intermediate_size (None: 128 or, where
    that does not divide both, the group config.pick_group_size finds). `layout`:
    "auto" picks this CPU's kernel tiles (packing.CPU_LAYOUTS); name another one to convert for a different
    board (e.g. cpu_b16_pairs for a Jetson), or "rowmajor" for a CPU-neutral file. `dense_bits` (4 or 8):
    also quantize the linears `linears_of` names (attention, lm_head, dense MLPs at `dense_bits`, the vision tower
    at int8; dense.py), int4 in the experts' layout, groups of at most 128. `source`: the weights to read instead
    of `SourceCheckpoint(src)` (a subclass that makes them, e.g. tools/checkpoints/streaming_quantized.py); it is
    closed at the end like our own. Returns `out`.
    """
    src, out = Path(src).expanduser(), Path(out).expanduser().absolute()
    _check_out(out)
    layout = resolve_layout(bits, layout)
    checked_group = DEFAULT_INT4_GROUP if bits == 4 and group_size is None else group_size
    make_config(bits, checked_group, layout)  # argument errors before any reading
    check_dense_bits(dense_bits, DEFAULT_INT4_GROUP)
    if dense_bits is not None and linears_of is None:
        raise ValueError("dense_bits needs linears_of, the model family's linear weights")
    max_shard_bytes = parse_size(max_shard_size)
    source = SourceCheckpoint(src) if source is None else source
    tmp: Path | None = None
    try:
        spec, units = _plan(source, catalogue_of, bits, group_size, layout, dense_bits, linears_of)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
        _write(tmp, units, max_shard_bytes, progress)
        _copy_extra_files(src, tmp)
        _write_json(tmp / "config.json", source.config | {"quantization_config": spec.quant.to_dict()})  # last
        _fsync_dir(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the output should look like any other directory
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(tmp, out)
        tmp = None
        _fsync_dir(out.parent)
        return out
    finally:
        source.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
