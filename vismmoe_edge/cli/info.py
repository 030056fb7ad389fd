"""`vismmoe-edge info`: a checkpoint's MoE shape, resident and expert bytes, and the pinned depths that fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import demo_model, fail
from vismmoe_edge.cli.options import InfoBudgetOpt, PlanBitsOpt, PlanDenseBitsOpt, PlanGroupOpt
from vismmoe_edge.errors import VismmoeError


def info(
    model_dir: Annotated[
        Path | None, typer.Argument(help="Hugging Face model directory; omit for the built-in demo model")
    ] = None,
    memory_budget: InfoBudgetOpt = "100%",
    as_json: Annotated[bool, typer.Option("--json")] = False,
    bits: PlanBitsOpt = None,
    dense_bits: PlanDenseBitsOpt = None,
    group_size: PlanGroupOpt = None,
) -> None:
    """Describe a checkpoint: its MoE shape, each part's bytes (as stored, or as --bits/--dense-bits would convert
    it), and which pinned depths fit a budget."""
    from vismmoe_edge.planning.describe import describe_checkpoint, format_description

    try:
        description = describe_checkpoint(
            model_dir if model_dir is not None else demo_model(), memory_budget,
            bits=bits, dense_bits=dense_bits, group_size=group_size,
        )  # fmt: skip
    except VismmoeError as e:
        raise fail(str(e)) from None
    typer.echo(json.dumps(description, indent=2) if as_json else format_description(description))
