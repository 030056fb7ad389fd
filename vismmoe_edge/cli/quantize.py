"""`vismmoe-edge quantize`: a model directory (bf16/fp32, Qwen FP8, compressed-tensors W4A16, AutoAWQ) to one
with int4 or int8 routed experts, everything else kept (vismmoe_edge.quant.convert, docs/quantization.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import fail
from vismmoe_edge.errors import VismmoeError

LAYOUT_HELP = (
    "int4 nibble layout: auto (this CPU's kernel tiles), rowmajor, or another CPU's tiles: cpu_b64_split (AVX-512), "
    "cpu_b32_split (AVX2), cpu_b16_pairs (Jetson Orin, NEON), cpu_b32_pairs"
)

GROUP_HELP = "int4 only: inputs per scale and zero (default 128, or the largest group that divides both expert widths)"


def quantize_command(
    src: Annotated[Path, typer.Argument(help="model directory: bf16/fp32, FP8 (block 128), W4A16 or AWQ GEMM")],
    out: Annotated[Path, typer.Argument(help="new directory to write (must not exist, or be empty)")],
    bits: Annotated[int, typer.Option("--bits", help="4 (group-wise) or 8 (per output channel)")],
    dense_bits: Annotated[
        int | None,
        typer.Option(
            "--dense-bits",
            help="also quantize attention, lm_head and dense MLPs to 4 or 8 bits (the vision tower to int8); "
            "the token embedding is then read by row from disk",
        ),
    ] = None,
    group_size: Annotated[int | None, typer.Option("--group-size", min=2, help=GROUP_HELP)] = None,
    layout: Annotated[str, typer.Option("--layout", help=LAYOUT_HELP)] = "auto",
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="e.g. 4GB or 2GiB")] = "4GB",
    progress: Annotated[bool, typer.Option("--progress/--no-progress", help="show a progress bar")] = True,
) -> None:
    """Quantize a model's routed experts to int4 or int8 (one contiguous record per expert); with --dense-bits the
    other linears too, else the vision tower, attention, routers, shared experts and embeddings keep their dtype.
    Memory stays at one tensor at a time."""
    if bits not in (4, 8):
        raise fail(f"--bits {bits}: use 4 or 8")
    if dense_bits is not None and dense_bits not in (4, 8):
        raise fail(f"--dense-bits {dense_bits}: use 4 or 8 (or leave it out to keep the dense weights)")
    from vismmoe_edge.conversion import quantize_checkpoint, read_quantized_catalogue
    from vismmoe_edge.units import format_bytes

    try:
        written = quantize_checkpoint(src, out, bits, group_size, progress, layout=layout,
                                      max_shard_size=max_shard_size, dense_bits=dense_bits)  # fmt: skip
        catalogue = read_quantized_catalogue(written)
    except VismmoeError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise fail("interrupted; nothing was written to OUT", 130) from None
    spec = catalogue.spec
    group = f"group {spec.quant.group_size}" if bits == 4 else "per output channel"
    if bits == 4 and group_size is None:
        group += f" (picked: divides hidden {spec.hidden} and moe_intermediate {spec.inter}; --group-size to choose)"
    typer.echo(
        f"{written}: int{bits}, {group}, layout {spec.quant.layout}: {format_bytes(spec.nbytes)} per expert "
        f"({spec.nbytes / spec.dense_nbytes_bf16:.3f}x bf16), {len(catalogue.experts)} experts, "
        f"{format_bytes(catalogue.total_bytes)} in all"
        + ("" if dense_bits is None else f"; dense weights int{dense_bits}, vision tower int8")
    )
