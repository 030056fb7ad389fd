"""The lookahead predictor as a file: ONNX export (opset 17, sigmoid scores, metadata inside) and the sessions
that run it at serve time: onnxruntime (CUDA provider when present, else CPU) or torch as a fallback.

Both sessions share one API: `.run(history, hidden, visual, layer_onehot) -> np.ndarray` of probabilities
[B, E] (window form) or [B, W, E] (per_layer form), `.provider` and `.metadata`.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.predict.lookahead import LookaheadMLP

PREDICTOR_FILENAME = "vismmoe-predictor.onnx"  # conventional name, beside a checkpoint
OPSET = 17
INPUTS = ("history", "hidden", "visual", "layer_onehot")
OUTPUT = "scores"
# metadata_props key -> parser; every value is stored as a string
METADATA: dict[str, type] = {
    "form": str,
    "window": int,
    "top_b": int,
    "gamma": float,
    "num_layers": int,
    "num_experts": int,
    "history": int,
    "hidden_dim": int,
}


class _Probabilities(nn.Module):
    """The exported graph: the model's logits through a sigmoid, so the runtime gets probabilities."""

    def __init__(self, model: LookaheadMLP) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model(*inputs))


def random_inputs(meta: dict[str, Any], batch: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Plausible float32 inputs for a model with this metadata: shares that sum to 1, one-hot layers."""
    rng = np.random.default_rng(seed)
    e, d, h, L = meta["num_experts"], meta["hidden_dim"], meta["history"], meta["num_layers"]
    history = rng.random((batch, h, e), dtype=np.float32)
    history /= history.sum(axis=2, keepdims=True)
    onehot = np.zeros((batch, L), dtype=np.float32)
    onehot[np.arange(batch), rng.integers(0, L, batch)] = 1.0
    hidden = rng.normal(0.0, 3.0, (batch, d)).astype(np.float32)
    visual = rng.normal(0.0, 1.0, (batch, d)).astype(np.float32)
    return history.reshape(batch, -1), hidden, visual, onehot


def export_onnx(model: LookaheadMLP, path: str | Path) -> Path:
    """Write the model as ONNX (opset 17, dynamic batch axis, output "scores" = sigmoid probabilities) with its
    metadata (form, window, top_b, gamma, num_layers, num_experts, history, hidden_dim) in metadata_props."""
    try:
        import onnx
    except ImportError:
        raise VismmoeError("exporting the predictor needs the onnx package: pip install 'onnx>=1.16'") from None
    path = Path(path)
    wrapped = _Probabilities(copy.deepcopy(model).cpu().eval())
    example = tuple(torch.from_numpy(a) for a in random_inputs(model.metadata(), batch=2))
    buffer = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter warns that it is legacy; it needs no onnxscript
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapped, example, buffer, opset_version=OPSET, input_names=list(INPUTS), output_names=[OUTPUT],
            dynamic_axes={name: {0: "batch"} for name in (*INPUTS, OUTPUT)}, dynamo=False,
        )  # fmt: skip
    proto = onnx.load_from_string(buffer.getvalue())
    onnx.helper.set_model_props(proto, {key: str(value) for key, value in model.metadata().items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(proto, str(path))
    return path


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:300] if text else type(e).__name__


def _open_session(path: Path, providers: Sequence[str], threads: int) -> Any:
    import onnxruntime as ort

    if not path.is_file():
        raise VismmoeError(f"predictor file {path} does not exist; export one with the predictor training tool")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads  # batch-1 MLP: more threads cost more in sync than they save
    options.inter_op_num_threads = 1
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except Exception as e:  # onnxruntime raises its own Fail/InvalidProtobuf types; any of them means "broken file"
        raise VismmoeError(f"onnxruntime cannot load predictor {path}: {_one_line(e)}; re-export it") from None


def _parse_metadata(path: Path, custom: dict[str, str]) -> dict[str, Any]:
    missing = [key for key in METADATA if key not in custom]
    if missing:
        raise VismmoeError(f"{path} is not a vismmoe predictor (metadata lacks {', '.join(missing)}); re-export it")
    try:
        return {key: parse(custom[key]) for key, parse in METADATA.items()}
    except ValueError as e:
        raise VismmoeError(f"{path}: bad predictor metadata ({_one_line(e)}); re-export it") from None


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The metadata export_onnx stored, typed: {"form": str, "window": int, ..., "gamma": float}."""
    path = Path(path)
    session = _open_session(path, ["CPUExecutionProvider"], threads=1)
    return _parse_metadata(path, session.get_modelmeta().custom_metadata_map)


def _as_inputs(history: Any, hidden: Any, visual: Any, layer_onehot: Any) -> dict[str, np.ndarray]:
    arrays = [np.ascontiguousarray(np.asarray(a, dtype=np.float32)) for a in (history, hidden, visual, layer_onehot)]
    arrays[0] = arrays[0].reshape(arrays[0].shape[0], -1)  # history may come as [B, H, E]
    return dict(zip(INPUTS, arrays, strict=True))


class PredictorSession:
    """An exported predictor on onnxruntime: CUDA provider when onnxruntime has it and prefer_gpu, else CPU."""

    def __init__(self, path: str | Path, prefer_gpu: bool = True, threads: int = 1) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise VismmoeError(f"{path}: onnxruntime is not installed (pip install onnxruntime)") from None

        self.path = Path(path)
        cuda = prefer_gpu and "CUDAExecutionProvider" in ort.get_available_providers()
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
        self.session = _open_session(self.path, providers, threads)
        self.metadata = _parse_metadata(self.path, self.session.get_modelmeta().custom_metadata_map)

    @property
    def provider(self) -> str:
        """What onnxruntime really runs on: it falls back to CPU silently when the CUDA provider fails to start."""
        return str(self.session.get_providers()[0])

    def run(self, history: Any, hidden: Any, visual: Any, layer_onehot: Any) -> np.ndarray:
        return self.session.run([OUTPUT], _as_inputs(history, hidden, visual, layer_onehot))[0]


class TorchPredictorSession:
    """The same API on the torch model itself, for machines where onnxruntime is missing or broken."""

    provider = "torch"

    def __init__(self, model: LookaheadMLP) -> None:
        self.model = model.eval()
        self.metadata = model.metadata()
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def run(self, history: Any, hidden: Any, visual: Any, layer_onehot: Any) -> np.ndarray:
        arrays = _as_inputs(history, hidden, visual, layer_onehot).values()
        inputs = [torch.from_numpy(a).to(self.device) for a in arrays]
        return torch.sigmoid(self.model(*inputs)).cpu().numpy()


def check_export(
    model: LookaheadMLP, path: str | Path, atol: float = 1e-4, batches: Sequence[int] = (1, 7), seed: int = 0
) -> float:
    """Max |onnxruntime - torch| over random inputs of each batch size; VismmoeError above atol."""
    onnx_session, torch_session = PredictorSession(path, prefer_gpu=False), TorchPredictorSession(model)
    worst = 0.0
    for n, batch in enumerate(batches):
        inputs = random_inputs(model.metadata(), batch, seed + n)
        got, want = onnx_session.run(*inputs), torch_session.run(*inputs)
        if got.shape != want.shape:
            raise VismmoeError(f"{path}: onnxruntime gives shape {got.shape}, torch {want.shape}; re-export it")
        worst = max(worst, float(np.abs(got - want).max()))
    if worst > atol:
        raise VismmoeError(f"{path}: onnxruntime and torch differ by {worst:.2e} (> {atol:.0e}); re-export it")
    return worst
