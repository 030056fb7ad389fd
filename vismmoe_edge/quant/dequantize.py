"""`dequantize_checkpoint`: a quantized directory of ours back to a plain float checkpoint that transformers loads.

Every expert becomes exactly what `kernels.dequantize_expert` makes of its record (W = (code - 8) * scale + zero,
or q * scale), in `dtype`, and so does every quantized dense linear (`X.qweight` + scales -> `X.weight`,
quant/dense.py); every other tensor keeps its bytes. That is the reference the fidelity tests and
`eval` hold the quantized engine to: the same file, dequantized, run by transformers' own model. A family whose
transformers class loads fused experts gets them fused (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, what
transformers 5 saves), the others one tensor per projection and expert, as their checkpoints ship. Memory: one
expert at a time (one layer for the fused layout).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from vismmoe_edge.checkpoint import DTYPE_NAMES, TensorInfo, read_tensor_table
from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.quant.catalogue import RECORD_KEY, QuantizedCatalogue
from vismmoe_edge.quant.config import parse_quant_config
from vismmoe_edge.quant.convert import Unit, _check_out, _copy_extra_files, _write, _write_json
from vismmoe_edge.quant.dense import dequantized_weight, stored_matrices
from vismmoe_edge.quant.kernels import dequantize_expert, expert_views
from vismmoe_edge.quant.reader import PreadFiles
from vismmoe_edge.quant.shards import Entry


def _prefixes(catalogue: QuantizedCatalogue) -> dict[int, str]:
    out = {}
    for name in catalogue.tensor_names:
        m = RECORD_KEY.match(name)
        if m:
            out[int(m["layer"])] = m["prefix"]
    return out


def _expert(files: PreadFiles, catalogue: QuantizedCatalogue, layer: int, e: int, dtype: torch.dtype):
    r = catalogue.expert(layer, e)
    raw = files.read(TensorInfo(f"layer {layer} expert {e}", r.shard, "U8", (r.nbytes,), r.offset, r.nbytes))
    return dequantize_expert(expert_views(raw, catalogue.spec), dtype)


def _expert_units(files: PreadFiles, catalogue: QuantizedCatalogue, fused: bool, dtype: torch.dtype) -> list[Unit]:
    spec, name = catalogue.spec, DTYPE_NAMES[dtype]
    h, i, n = spec.hidden, spec.inter, catalogue.num_experts
    units = []
    for layer, prefix in sorted(_prefixes(catalogue).items()):
        if fused:

            def make_fused(layer: int = layer) -> list[torch.Tensor]:
                pairs = [_expert(files, catalogue, layer, e, dtype) for e in range(n)]
                return [torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])]

            entries = [Entry(f"{prefix}.gate_up_proj", name, (n, 2 * i, h)),
                       Entry(f"{prefix}.down_proj", name, (n, h, i))]  # fmt: skip
            units.append(Unit(entries, make_fused))
            continue
        for e in range(n):

            def make(layer: int = layer, e: int = e) -> list[torch.Tensor]:
                gate_up, down = _expert(files, catalogue, layer, e, dtype)
                return [gate_up[:i].contiguous(), gate_up[i:].contiguous(), down]

            base = f"{prefix}.{e}"
            entries = [Entry(f"{base}.{kind}_proj.weight", name, shape)
                       for kind, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))]  # fmt: skip
            units.append(Unit(entries, make))
    return units


def dequantize_checkpoint(
    src: Path,
    out: Path,
    catalogue: QuantizedCatalogue,
    *,
    fused: bool,
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> Path:
    """Write the float checkpoint our quantized `src` (its records: `catalogue`) stands for to `out` (new or empty);
    experts in `dtype` (default: the dtype of the largest non-expert tensor, the one the model computes in), one
    [E, ...] tensor per layer where the family's transformers class loads them `fused`. Returns `out`."""
    src, out = Path(src), Path(out).absolute()
    _check_out(out)
    raw_config = read_config_json(src)
    table = read_tensor_table(src)
    layout = parse_quant_config(raw_config["quantization_config"], str(src / "config.json")).layout
    choices = stored_matrices(table, layout)
    quantized = {name for c in choices.values() for name, _, _ in c.fields(layout)}
    plain = {n: i for n, i in table.items() if n not in catalogue.tensor_names and n not in quantized}
    if dtype is None:
        floats = [i for i in plain.values() if i.torch_dtype.is_floating_point]
        biggest = max(floats, key=lambda i: i.nbytes, default=None)
        dtype = biggest.torch_dtype if biggest is not None else torch.bfloat16
    files = PreadFiles()

    def copy_unit(info: TensorInfo) -> Unit:
        return Unit([Entry(info.name, info.dtype, info.shape)], lambda: [files.read(info)])

    def dense_unit(choice) -> Unit:
        def make() -> list[torch.Tensor]:
            return [dequantized_weight(lambda n: files.read(table[n]), choice, layout, dtype).contiguous()]

        return Unit([Entry(choice.weight, DTYPE_NAMES[dtype], (choice.n, choice.k))], make)

    units = [copy_unit(info) for _, info in sorted(plain.items())]
    units += [dense_unit(choice) for _, choice in sorted(choices.items())]
    units += _expert_units(files, catalogue, fused, dtype)
    units.sort(key=lambda u: u.sort_key)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        _write(tmp, units, 4 * 10**9, progress)
        _copy_extra_files(src, tmp)
        config = {k: v for k, v in raw_config.items() if k != "quantization_config"}
        _write_json(tmp / "config.json", config)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        files.close()
    return out
