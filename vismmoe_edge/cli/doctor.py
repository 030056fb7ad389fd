"""`vismmoe-edge doctor`: what this machine offers (Python, torch, CUDA, Jetson board, jtop, kernel features)."""

from __future__ import annotations

import typer


def doctor() -> None:
    """Check this machine: Python, torch, transformers, CUDA, Jetson, jtop, onnxruntime, kernel features."""
    from vismmoe_edge.hardware.doctor import format_checks, run_checks

    checks = run_checks()
    typer.echo(format_checks(checks))
    if any(not c.ok and c.required for c in checks):
        raise typer.Exit(1)
