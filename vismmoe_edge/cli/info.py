"""`vismmoe-edge info`: a checkpoint's MoE shape, resident and expert bytes, and the pinned depths that fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import demo_model, fail
from vismmoe_edge.cli.options import InfoBudgetOpt
from vismmoe_edge.errors import VismmoeError


def info(
    model_dir: Annotated[
        Path | None, typer.Argument(help="Hugging Face model directory; omit for the built-in demo model")
    ] = None,
    memory_budget: InfoBudgetOpt = "100%",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Describe a checkpoint: its MoE shape, resident and expert bytes, and which pinned depths fit a budget."""
    from vismmoe_edge.planning.describe import describe_checkpoint, format_description

    try:
        description = describe_checkpoint(model_dir if model_dir is not None else demo_model(), memory_budget)
    except VismmoeError as e:
        raise fail(str(e)) from None
    typer.echo(json.dumps(description, indent=2) if as_json else format_description(description))
