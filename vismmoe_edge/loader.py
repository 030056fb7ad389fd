"""`load(...)`: open a checkpoint directory and return a ready Engine. The one entry point of the Python API."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vismmoe_edge.checkpoint import TORCH_DTYPES, ExpertCatalogue, read_tensor_table
from vismmoe_edge.config import parse_budget, resolve_device, resolve_dtype
from vismmoe_edge.engine import Engine
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import Predictor
from vismmoe_edge.experts.pipeline import POLICIES
from vismmoe_edge.experts.runtime import attach_predictor, build_runtime
from vismmoe_edge.experts.store import ExpertStore, ShardFiles
from vismmoe_edge.models.registry import model_family


def eos_token_ids(model_dir: Path, config: object, tokenizer: object) -> list[int]:
    """Stop tokens: generation_config.json first (it lists <|im_end|> for chat models), then config, tokenizer."""
    candidates: list[object] = []
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        try:
            candidates.append(json.loads(gen_path.read_text()).get("eos_token_id"))
        except json.JSONDecodeError as e:
            raise VismmoeError(f"{gen_path}: not valid JSON ({e})") from e
    candidates.append(getattr(config.get_text_config(), "eos_token_id", None))  # type: ignore[attr-defined]
    candidates.append(getattr(tokenizer, "eos_token_id", None))
    for value in candidates:
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value:
            return [int(v) for v in value]
    return []


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


def make_learned_predictor(path: Path, engine: Engine) -> Predictor:
    from vismmoe_edge.predict.learned import LearnedPredictor
    from vismmoe_edge.predict.onnx_runtime import PredictorSession

    try:
        session = PredictorSession(path, prefer_gpu=engine.device.type == "cuda")
    except VismmoeError:
        # onnxruntime missing or unable to run the file: the torch checkpoint saved beside it, if any
        fallback = path.with_suffix(".pt")
        if not fallback.is_file():
            raise
        from vismmoe_edge.predict.onnx_runtime import TorchPredictorSession
        from vismmoe_edge.predictor_cli import load_checkpoint

        session = TorchPredictorSession(load_checkpoint(fallback))
    try:
        return LearnedPredictor(session, session.metadata, engine)
    except ValueError as e:
        raise VismmoeError(f"{path}: {e}") from None


def make_predictor(name: str, model: object, moe_layers: list[int]) -> Predictor | None:
    from vismmoe_edge.predict.simple import NextLayerGatePredictor, PreviousTokenPredictor

    if name in ("none", "learned", "auto") or name.endswith(".onnx"):
        return None  # the learned predictor needs the engine: attached after it is built
    layers = model.model.language_model.layers  # type: ignore[attr-defined]
    top_k = layers[moe_layers[0]].mlp.gate.top_k
    if name == "next-layer-gate":
        # GLM keeps its routers in fp32 under bf16/fp16; the predictor multiplies them with compute-dtype states
        dtype = model.lm_head.weight.dtype  # type: ignore[attr-defined]
        gates = {i: layers[i].mlp.gate.weight.to(dtype) for i in moe_layers}
        return NextLayerGatePredictor(gates, top_b=2 * top_k)
    return PreviousTokenPredictor(moe_layers)


def drop_unneeded_pages(files: ShardFiles, table: dict, catalogue: ExpertCatalogue, pinned: set[int]) -> None:
    """Give back the page cache that loading filled: the non-expert weights now live in our own memory, and
    fault read-around pulled in streamed experts nobody asked for. Unified memory counts page cache against
    the same DRAM, and a cgroup counts it against the process."""
    files.close()  # unmapped pages are the only ones POSIX_FADV_DONTNEED can drop
    ranges = [(i.shard, i.offset, i.nbytes) for n, i in table.items() if n not in catalogue.tensor_names]
    for loc in catalogue.experts.values():
        if loc.layer not in pinned:
            ranges += [(p.shard, p.offset, p.nbytes) for p in loc.parts]
    fds: dict[Path, int] = {}
    try:
        for shard, offset, nbytes in ranges:
            fd = fds.get(shard)
            if fd is None:
                fd = fds[shard] = os.open(shard, os.O_RDONLY)
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    finally:
        for fd in fds.values():
            os.close(fd)


def load(
    model_dir: str | Path | None = None,
    *,
    memory_budget: str = "100%",
    pinned_layers: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    tier: str = "auto",
    predictor: str = "none",
    policy: str = "lru",
) -> Engine:
    """Load a Qwen3-VL-MoE or GLM-4.5V checkpoint with its routed experts left on disk.

    model_dir: a Hugging Face model directory; None uses the built-in demo model (created on first use).
    memory_budget: bytes of expert weights kept in memory (pinned prefix + cache), e.g. "2GiB" or "40%"
        of all routed-expert bytes at the compute dtype.
    pinned_layers: the first N MoE layers keep all their experts resident.
    tier: where cache slots live: "host" (RAM slots), "gpu" (CUDA slots), "unified" (the page cache, managed:
        for Jetson and CPU hosts), "mmap" (the page cache, unmanaged: a baseline), "auto" (gpu on CUDA, else
        host).
    predictor: what drives prefetch: "none" (demand only), "next-layer-gate", "previous-token", "learned" (the
        vismmoe-predictor.onnx beside the checkpoint), "auto" (learned when that file exists, else none), or
        the path of a .onnx file.
    policy: which finished expert leaves first: "lru" (least recently used) or "popularity" (the one the
        fewest tokens routed to, decayed; then least recently used).
    """
    is_demo = model_dir is None
    if model_dir is None:
        from vismmoe_edge.demo import ensure_demo_model

        model_dir = ensure_demo_model()
    model_dir = Path(model_dir).expanduser()
    family = model_family(model_dir)  # by config.json's model_type; anything else is one-line refused
    config = family.read_config(model_dir)
    table = family.select_tensors(config, read_tensor_table(model_dir))
    catalogue = family.catalogue_for(config, table)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, TORCH_DTYPES[catalogue.dtype], torch_device)
    processor = family.load_processor(model_dir)

    if policy not in POLICIES:
        raise VismmoeError(f"--policy {policy!r}: use one of {', '.join(POLICIES)}")
    if predictor not in PREDICTORS and not predictor.endswith(".onnx"):  # before the model is built, not after
        raise VismmoeError(f"--predictor {predictor!r}: use one of {', '.join(PREDICTORS)}, or a .onnx file")
    learned = find_learned_predictor(predictor, model_dir)
    moe_layers = catalogue.moe_layers
    if not 0 <= pinned_layers <= len(moe_layers):
        raise VismmoeError(f"--pinned-layers {pinned_layers}: the model has {len(moe_layers)} MoE layers")
    files = ShardFiles()
    store = ExpertStore(catalogue, files, torch_dtype, torch_device)
    total_expert_bytes = store.expert_nbytes() * len(catalogue.experts)
    budget = parse_budget(memory_budget, total_expert_bytes)
    runtime = build_runtime(
        store, budget_bytes=budget, pinned_layers=moe_layers[:pinned_layers], tier=tier, policy=policy
    )
    model = family.build_model(config, table, catalogue, files, runtime, dtype=torch_dtype, device=torch_device)
    if runtime.pipeline.tier.name in ("unified", "mmap"):
        drop_unneeded_pages(files, table, catalogue, set(moe_layers[:pinned_layers]))
    attach_predictor(runtime, make_predictor(predictor, model, catalogue.moe_layers))
    engine = Engine(
        model,
        processor,
        runtime,
        catalogue,
        model_dir=model_dir,
        device=torch_device,
        dtype=torch_dtype,
        eos_token_ids=eos_token_ids(model_dir, config, processor.tokenizer),
        is_demo=is_demo,
        pinned_layers=pinned_layers,
        ops=family.ops,
    )
    if learned is not None:
        attach_predictor(runtime, make_learned_predictor(learned, engine))
    return engine
