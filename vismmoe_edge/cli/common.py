"""What the commands share: one-line errors and turning their options into a loaded engine."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from vismmoe_edge.engine import Engine
    from vismmoe_edge.options import LoadOptions


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def load_options(params: dict[str, Any], **fixed: Any) -> LoadOptions:
    """The LoadOptions of a command: each of its parameters (its `locals()`) named like a LoadOptions field, then
    `fixed`. Every command spells those options the same way (cli/options.py), so this is the one mapping."""
    from vismmoe_edge.options import LoadOptions

    names = {f.name for f in fields(LoadOptions)} - set(fixed)
    return LoadOptions(**{name: value for name, value in params.items() if name in names}, **fixed)


def plan_and_load(model: Path | None, options: LoadOptions) -> tuple[Engine, str]:
    """Load with what the user left to the planner filled in; returns the engine and the plan's one-line note."""
    from vismmoe_edge.options import load_engine

    engine, resolved = load_engine(model, options)
    return engine, resolved.note


def demo_model() -> Path:
    """The built-in demo model, for commands run without a model (as `run` does); says so on stderr."""
    from vismmoe_edge.demo import ensure_demo_model

    typer.echo("note: no model given: using the built-in demo model (docs/demo-model.md)", err=True)
    return ensure_demo_model()
