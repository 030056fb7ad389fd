"""The `vismmoe-edge` command: a Typer app whose commands are thin shells over the Python API.

One module per command. Nothing outside this package imports it or typer, and the command modules import
neither torch nor transformers at module level, so `--help` stays fast (tests/test_layout.py checks both).
"""

from __future__ import annotations

import os
import signal
import sys


def _stopped_while_starting(signum: int, frame: object) -> None:
    # systemd stopped the daemon before it was up: a clean stop, not a crash (143). os._exit, not SystemExit:
    # the signal may land inside an extension's import (torch's C++ init), where an exception aborts (134).
    os._exit(0)


if sys.argv[1:2] == ["serve"]:
    # First thing: the imports below take a while, and `serve` installs its own handlers only once they are done.
    signal.signal(signal.SIGTERM, _stopped_while_starting)

import typer  # noqa: E402

try:  # typer >= 0.20 carries its own click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on plain click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # type: ignore[no-redef]

from vismmoe_edge.cli import analyze, bench, calibrate, doctor, info, plan, predictor, profile, quantize, run, serve  # noqa: E402
from vismmoe_edge.cli import eval as eval_  # noqa: E402

app = typer.Typer(
    help="Run vision-language MoE models larger than memory (Jetson Orin, desktop GPUs, CPU).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

# Commands that import torch and load a model: under a memory cgroup too small for that, they must refuse with one
# line before the imports, or the kernel OOM-kills them silently.
LOADING_COMMANDS = {"run", "serve", "eval", "bench", "profile", "calibrate", "analyze"}


@app.callback()
def _check_memory(ctx: typer.Context) -> None:
    # the subcommand's own arguments are not parsed yet: --help is looked for where the shell put it
    if ctx.invoked_subcommand not in LOADING_COMMANDS or "--help" in sys.argv[1:] or ctx.resilient_parsing:
        return
    from vismmoe_edge.cli.common import fail
    from vismmoe_edge.hardware.cgroup import startup_refusal

    refusal = startup_refusal()
    if refusal is not None:
        raise fail(refusal)


app.command("run")(run.run)
app.command("info")(info.info)
app.command("quantize")(quantize.quantize_command)
app.command("doctor")(doctor.doctor)
app.command("plan")(plan.plan_command)
app.command("serve")(serve.serve_command)
app.command("install-service")(serve.install_service_command)
app.command("profile")(profile.profile_command)
app.command("bench")(bench.bench_command)
app.command("eval")(eval_.eval_command)
app.command("analyze")(analyze.analyze_command)
app.command("calibrate")(calibrate.calibrate_command)
app.command("train-predictor")(predictor.train_predictor_command)
app.command("export-predictor")(predictor.export_predictor_command)


def main() -> None:
    """The entry point: usage errors (a missing option, `--top-p 2`) are one line, like every other error."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help() if e.ctx is not None else str(e))
        sys.exit(0)
    except UsageError as e:
        hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
        typer.echo(f"error: {' '.join(e.format_message().split())}{hint}", err=True)
        sys.exit(2)
    except typer.Abort:
        typer.echo("error: interrupted", err=True)
        sys.exit(130)
    except ClickException as e:
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        sys.exit(e.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
