"""The predictor a `--predictor` option names: none, a simple one, or the learned ONNX model."""

from __future__ import annotations

from pathlib import Path

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import Predictor
from vismmoe_edge.step_context import StepContext

PREDICTORS = ("none", "next-layer-gate", "previous-token", "learned", "auto")


def find_learned_predictor(name: str, model_dir: Path) -> Path | None:
    """The ONNX file a predictor option names: an explicit .onnx path, or the one beside the checkpoint for
    "learned" (required) and "auto" (used when present)."""
    from vismmoe_edge.predict.onnx_runtime import PREDICTOR_FILENAME

    if name.endswith(".onnx"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise VismmoeError(f"--predictor {name}: file not found")
        return path
    if name not in ("learned", "auto"):
        return None
    path = model_dir / PREDICTOR_FILENAME
    if path.is_file():
        return path
    if name == "learned":
        raise VismmoeError(
            f"--predictor learned: no {PREDICTOR_FILENAME} in {model_dir}; make one with calibrate, "
            "train-predictor and export-predictor --model DIR"
        )
    return None


def make_learned_predictor(path: Path, context: StepContext, *, on_gpu: bool) -> Predictor:
    from vismmoe_edge.predict.learned import LearnedPredictor
    from vismmoe_edge.predict.onnx_runtime import PredictorSession

    try:
        session = PredictorSession(path, prefer_gpu=on_gpu)
    except VismmoeError:
        # onnxruntime missing or unable to run the file: the torch checkpoint saved beside it, if any
        fallback = path.with_suffix(".pt")
        if not fallback.is_file():
            raise
        from vismmoe_edge.predict.checkpoint import load_checkpoint
        from vismmoe_edge.predict.onnx_runtime import TorchPredictorSession

        session = TorchPredictorSession(load_checkpoint(fallback))
    try:
        return LearnedPredictor(session, session.metadata, context)
    except ValueError as e:
        raise VismmoeError(f"{path}: {e}") from None


def check_predictor_name(name: str) -> None:
    """Refuse an unknown --predictor before any weight is loaded."""
    if name not in PREDICTORS and not name.endswith(".onnx"):
        raise VismmoeError(f"--predictor {name!r}: use one of {', '.join(PREDICTORS)}, or a .onnx file")


def make_predictor(
    name: str, model_dir: Path, context: StepContext, model: object, *, on_gpu: bool
) -> Predictor | None:
    """The predictor `name` asks for; `model` is the built model (the next-layer gate reads its routers)."""
    from vismmoe_edge.predict.simple import NextLayerGatePredictor, PreviousTokenPredictor

    check_predictor_name(name)
    learned = find_learned_predictor(name, model_dir)
    if learned is not None:
        return make_learned_predictor(learned, context, on_gpu=on_gpu)
    if name in ("none", "learned", "auto"):
        return None  # auto with no learned file beside the model: demand fetches only
    moe_layers = context.moe_layers
    if name == "next-layer-gate":
        layers = model.model.language_model.layers  # type: ignore[attr-defined]
        # GLM keeps its routers in fp32 under bf16/fp16; the predictor multiplies them with compute-dtype states
        head = getattr(model.lm_head, "weight", None)  # type: ignore[attr-defined]  (None: an int4/int8 lm_head)
        dtype = head.dtype if head is not None else model.model.language_model.norm.weight.dtype  # type: ignore[attr-defined]
        gates = {i: layers[i].mlp.gate.weight.to(dtype) for i in moe_layers}
        return NextLayerGatePredictor(gates, top_b=2 * context.top_k)
    return PreviousTokenPredictor(moe_layers)
