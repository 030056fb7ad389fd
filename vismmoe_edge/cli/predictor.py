"""`vismmoe-edge train-predictor` and `export-predictor`: from calibration data to the ONNX file beside a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from vismmoe_edge.cli.common import fail
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.predict.checkpoint import load_checkpoint, plot_curves, save_checkpoint

FORM_CHOICES = ("per_layer", "window", "both")


def train_predictor_command(
    data: Annotated[list[Path], typer.Option("--data", help="calibration .npz from `calibrate`; repeat for several")],
    out: Annotated[Path, typer.Option("--out", help="folder for predictor.pt, curves.json and curves.png")] = Path(
        "predictor"
    ),
    form: Annotated[
        str, typer.Option("--form", help="per_layer (one head per upcoming layer), window (the paper's), or both")
    ] = "both",
    epochs: Annotated[int, typer.Option("--epochs", min=1)] = 30,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    top_b: Annotated[int, typer.Option("--top-b", min=1, help="hot experts per upcoming layer (targets)")] = 20,
    gamma: Annotated[float, typer.Option("--gamma", help="target decay per layer of distance")] = 0.8,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Train the lookahead MLP (soft BCE on distance-decayed targets over the next W layers); with --form both,
    train both forms and keep the one with the better validation recall@20 as predictor.pt."""
    from vismmoe_edge.predict.calibration import CalibrationSet, load_calibration
    from vismmoe_edge.predict.lookahead import train_predictor

    try:
        if form not in FORM_CHOICES:
            raise VismmoeError(f"--form {form!r}: use one of {', '.join(FORM_CHOICES)}")
        sets = [load_calibration(path) for path in data]
        calibration = sets[0] if len(sets) == 1 else CalibrationSet.concatenate(sets)
        out.mkdir(parents=True, exist_ok=True)
        results: dict[str, Any] = {}
        for f in ("per_layer", "window") if form == "both" else (form,):
            model, curves = train_predictor(
                calibration, form=f, epochs=epochs, lr=lr, top_b=top_b, gamma=gamma, seed=seed
            )
            save_checkpoint(out / f"predictor-{f}.pt", model, curves)
            results[f] = curves.to_dict()
        best = max(results, key=lambda f: results[f]["val_recall20"][-1] if results[f]["val_recall20"] else 0.0)
        (out / "predictor.pt").write_bytes((out / f"predictor-{best}.pt").read_bytes())
        (out / "curves.json").write_text(json.dumps({"kept": best, "curves": results}, indent=1) + "\n")
        png = plot_curves(results, out / "curves.png")
    except VismmoeError as e:
        raise fail(str(e)) from None
    for f, c in results.items():
        recall = f"{c['val_recall20'][-1]:.3f}" if c["val_recall20"] else "n/a"
        typer.echo(f"{f}: train loss {c['train_loss'][-1]:.4f}, validation recall@20 {recall}")
    typer.echo(f"kept {best} as {out / 'predictor.pt'}" + (f"; curves in {png}" if png else ""))


def export_predictor_command(
    checkpoint: Annotated[Path, typer.Option("--checkpoint", help="predictor.pt from train-predictor")],
    model: Annotated[
        Path | None, typer.Option("--model", help="model directory: the file goes beside it, found automatically")
    ] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write the .onnx here instead")] = None,
) -> None:
    """Export to ONNX (dynamic batch), check it against torch within 1e-4, and put it where `run` finds it."""
    from vismmoe_edge.predict.onnx_runtime import PREDICTOR_FILENAME, PredictorSession, check_export, export_onnx

    try:
        if (model is None) == (out is None):
            raise VismmoeError("pass exactly one of --model DIR or --out FILE.onnx")
        target = out if out is not None else model / PREDICTOR_FILENAME
        if model is not None and not model.is_dir():
            raise VismmoeError(f"{model}: model directory not found")
        predictor = load_checkpoint(checkpoint)
        export_onnx(predictor, target)
        error = check_export(predictor, target)
        # the torch fallback, for hosts where onnxruntime cannot run the file
        target.with_suffix(".pt").write_bytes(checkpoint.read_bytes())
        provider = PredictorSession(target).provider
    except VismmoeError as e:
        raise fail(str(e)) from None
    typer.echo(f"wrote {target} (max difference from torch {error:.1e}; onnxruntime runs it on {provider})")
