"""What the commands share: one-line errors and turning their options into a loaded engine."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from vismmoe_edge.engine import Engine
    from vismmoe_edge.options import LoadOptions


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


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
