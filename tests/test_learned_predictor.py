"""The learned predictor end to end: calibrate -> train -> export beside the model -> found and used by `run`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import vismmoe_edge
from tests.test_cli import assert_one_line_error, run_cli, run_cli_in_process
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.predict.calibration import CalibrationSet
from vismmoe_edge.predict.checkpoint import save_checkpoint
from vismmoe_edge.predict.learned import LearnedPredictor
from vismmoe_edge.predict.lookahead import train_predictor
from vismmoe_edge.predict.routing_features import FeatureRecorder
from vismmoe_edge.sampling import SamplingConfig


@pytest.fixture(scope="module")
def model_with_predictor(checkpoints: dict[str, Path], images: list[Path], tmp_path_factory) -> Path:
    model_dir = shutil.copytree(checkpoints["v5"], tmp_path_factory.mktemp("pred") / "model")
    engine = vismmoe_edge.load(model_dir, memory_budget="100%", device="cpu")
    recorder = FeatureRecorder(engine)
    for n in range(6):
        sampling = SamplingConfig(max_new_tokens=4, min_new_tokens=4, temperature=1.0, seed=n)
        engine.generate_from_inputs(engine.encode(f"Describe picture {n}.", [images[n % 2]]), sampling)
    arrays = recorder.arrays()
    data = CalibrationSet(**{k: v if v.ndim else v.item() for k, v in arrays.items()})
    model, _ = train_predictor(data, form="per_layer", epochs=3, val_requests=0, progress=False)
    save_checkpoint(model_dir / "predictor.pt", model, _)
    proc = run_cli("export-predictor", "--checkpoint", str(model_dir / "predictor.pt"), "--model", str(model_dir))
    assert proc.returncode == 0, proc.stderr
    assert "CPUExecutionProvider" in proc.stdout
    return model_dir


def test_run_finds_and_uses_the_predictor(model_with_predictor: Path, images: list[Path]) -> None:
    plain = vismmoe_edge.load(model_with_predictor, memory_budget="25%", predictor="none", device="cpu")
    learned = vismmoe_edge.load(model_with_predictor, memory_budget="25%", predictor="auto", device="cpu")
    assert plain.experts.predictor is None
    assert isinstance(learned.experts.predictor, LearnedPredictor)
    assert learned.experts.predictor.provider == "CPUExecutionProvider"
    learned.experts.predictor.min_score = 0.0  # a 3-epoch predictor is rarely confident: exercise the fetch path
    sampling = SamplingConfig(max_new_tokens=6, min_new_tokens=6)
    a = plain.generate("What is this?", [images[0]], sampling)
    b = learned.generate("What is this?", [images[0]], sampling)
    assert a.token_ids == b.token_ids  # prefetching never changes the answer
    assert learned.experts.predictor.calls > 0
    assert b.experts["speculative_bytes"] > 0 and a.experts["speculative_bytes"] == 0


def test_auto_attaches_no_predictor_where_every_expert_is_resident(model_with_predictor: Path) -> None:
    """Nothing streams, so nothing is to be prefetched (and on CUDA a predictor would turn the device decode
    path off): "auto" attaches none; a predictor asked for by name still is."""
    layers = len(vismmoe_edge.load(model_with_predictor, predictor="none", device="cpu").catalogue.moe_layers)
    resident = vismmoe_edge.load(model_with_predictor, pinned_layers=layers, predictor="auto", device="cpu")
    assert resident.experts.predictor is None and resident.experts.predictor_worker is None
    named = vismmoe_edge.load(model_with_predictor, pinned_layers=layers, predictor="learned", device="cpu")
    assert isinstance(named.experts.predictor, LearnedPredictor)


def test_predictor_for_another_model_is_refused(model_with_predictor: Path, checkpoints, tmp_path: Path) -> None:
    other = shutil.copytree(checkpoints["v5"], tmp_path / "other")
    # same architecture but pretend the file came from a 7-layer model: rewrite the metadata
    import onnx

    proto = onnx.load(str(model_with_predictor / "vismmoe-predictor.onnx"))
    for prop in proto.metadata_props:
        if prop.key == "num_layers":
            prop.value = "7"
    onnx.save(proto, str(other / "vismmoe-predictor.onnx"))
    with pytest.raises(VismmoeError, match="trained for 7 MoE layers"):
        vismmoe_edge.load(other, predictor="auto", device="cpu")


def test_learned_without_a_file_is_one_line(checkpoints: dict[str, Path]) -> None:
    proc = run_cli("run", "--model", str(checkpoints["v5"]), "--prompt", "hi", "--predictor", "learned")
    assert_one_line_error(proc, "vismmoe-predictor.onnx")
    proc = run_cli_in_process("run", "--model", str(checkpoints["v5"]), "--prompt", "hi", "--predictor", "/nope.onnx")
    assert_one_line_error(proc, "file not found")


def test_torch_fallback_when_onnx_cannot_run(model_with_predictor: Path, tmp_path: Path) -> None:
    model_dir = shutil.copytree(model_with_predictor, tmp_path / "m")
    (model_dir / "vismmoe-predictor.onnx").write_bytes(b"not an onnx file")
    engine = vismmoe_edge.load(model_dir, predictor="auto", device="cpu")
    assert engine.experts.predictor.provider == "torch"
    assert engine.experts.predictor.predict(0, torch.zeros(3, engine.text_config.hidden_size), None)


def test_min_score_filters_requests(model_with_predictor: Path) -> None:
    engine = vismmoe_edge.load(model_with_predictor, predictor="auto", device="cpu")
    predictor = engine.experts.predictor
    hidden = torch.randn(3, engine.text_config.hidden_size)
    predictor.observe(engine.catalogue.moe_layers[0], hidden, torch.zeros(3, 4, dtype=torch.long), None)
    predictor.min_score = 0.0
    everything = predictor.predict(engine.catalogue.moe_layers[0], hidden, None)
    assert len(everything) == 5 * min(predictor.top_b, engine.catalogue.num_experts)  # top-B for each of W layers
    predictor.min_score = 0.5
    confident = predictor.predict(engine.catalogue.moe_layers[0], hidden, None)
    assert confident == [r for r in everything if r[1] >= 0.5]
