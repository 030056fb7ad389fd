"""The `vismmoe-edge` command: a Typer app whose commands are thin shells over the Python API.

One module per command. Nothing outside this package imports it or typer, and the command modules import
neither torch nor transformers at module level, so `--help` stays fast (tests/test_layout.py checks both).
"""

from __future__ import annotations

import sys

import typer

from vismmoe_edge.cli import analyze, bench, calibrate, doctor, info, plan, predictor, profile, run, serve
from vismmoe_edge.cli import eval as eval_

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
    app()
