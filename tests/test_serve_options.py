"""`serve` and `run` turn the same command-line arguments into the same plan (issue 13).

Both commands are parsed by their real Typer definitions and go through their real loading paths (`run`:
plan_and_load -> options.load_engine; `serve`: Service.load); only the final weight loading is replaced, by a
probe that records what it was asked to load.
"""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from vismmoe_edge import options as options_module
from vismmoe_edge.cli.run import run
from vismmoe_edge.cli.serve import serve_command
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve import daemon


class Loaded(Exception):
    pass


def app_of(command: Any) -> typer.Typer:
    app = typer.Typer()
    app.command("cmd")(command)
    app.command("noop")(lambda: None)  # two commands, so the subcommand name is parsed as in the real CLI
    return app


@pytest.mark.parametrize(
    "shared",
    [
        ["--memory-budget", "3MiB"],  # fixed budget, pinned depth left to the plan: run caps it to what fits
        ["--memory-budget", "3MiB", "--pinned-layers", "1", "--tier", "host"],
        ["--memory-budget", "auto", "--policy", "popularity", "--predictor", "none"],
    ],
)
def test_serve_and_run_resolve_the_same_arguments_to_the_same_plan(
    shared: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    common = [*shared, "--profile", "cpu", "--device", "cpu", "--dtype", "float32", "--compressor", "none"]
    seen: dict[str, tuple[Any, Any]] = {}
    who = {"now": ""}

    def probe(checkpoint: Any, load_options: Any, resolved: Any) -> Any:
        seen[who["now"]] = (load_options, resolved)
        raise VismmoeError("probe: not loading")

    monkeypatch.setattr(options_module, "load_resolved", probe)
    # The planner reads MemAvailable each time it plans: hold it still, so that only the commands can differ.
    from vismmoe_edge.hardware import system

    monkeypatch.setattr(system, "mem_available_bytes", lambda root=None: 8 << 30)

    who["now"] = "run"
    result = CliRunner().invoke(app_of(run), ["cmd", "--prompt", "Hi", *common])
    assert "probe: not loading" in result.output, result.output

    def serve_without_http(serve_options: Any) -> int:
        from vismmoe_edge.serve.daemon import Service

        with pytest.raises(VismmoeError, match="probe"):
            Service(serve_options).load()
        return 0

    monkeypatch.setattr(daemon, "serve", serve_without_http)  # cli/serve.py imports it when the command runs
    who["now"] = "serve"
    result = CliRunner().invoke(app_of(serve_command), ["cmd", *common, "--port", "0"])
    assert result.exit_code == 0, result.output

    (run_options, run_resolved), (serve_options, serve_resolved) = seen["run"], seen["serve"]
    assert serve_options == run_options
    assert serve_resolved == run_resolved
    if shared == ["--memory-budget", "3MiB"]:
        plan = run_resolved.plan
        assert run_resolved.pinned_layers < plan.pinned_layers  # the cap on a fixed budget applied to both
