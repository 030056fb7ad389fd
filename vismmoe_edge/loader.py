"""`load(...)`: open a checkpoint directory and return a ready Engine. The one entry point of the Python API."""

from __future__ import annotations

import json
from pathlib import Path

from vismmoe_edge.checkpoint_info import CheckpointInfo, as_checkpoint_info
from vismmoe_edge.config import budget_bytes, resolve_device, resolve_dtype
from vismmoe_edge.engine import Engine
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.pipeline import POLICIES
from vismmoe_edge.experts.runtime import DEFAULT_PREFETCH_DEPTH, attach_predictor, build_runtime
from vismmoe_edge.experts.store import ExpertStore, ShardFiles
from vismmoe_edge.experts.tiers.registry import resolve_auto, tier_kind
from vismmoe_edge.models.host_embedding import check_embedding_place, embedding_in_host
from vismmoe_edge.predict.factory import check_predictor_name, make_predictor
from vismmoe_edge.step_context import StepContext
from vismmoe_edge.transformers_version import check_transformers


def eos_token_ids(model_dir: Path, config: object, tokenizer: object) -> list[int]:
    """Stop tokens: generation_config.json first (it lists <|im_end|> for chat models), then config, tokenizer."""
    candidates: list[object] = []
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        try:
            generation = json.loads(gen_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise VismmoeError(f"{gen_path}: not valid JSON ({e})") from e
        if not isinstance(generation, dict):
            raise VismmoeError(f"{gen_path}: not a JSON object; re-download it")
        candidates.append(generation.get("eos_token_id"))
    candidates.append(getattr(config.get_text_config(), "eos_token_id", None))  # type: ignore[attr-defined]
    candidates.append(getattr(tokenizer, "eos_token_id", None))
    for value in candidates:
        if isinstance(value, int):
            return [value]
        if isinstance(value, list) and value:
            return [int(v) for v in value]
    return []


def load(
    model_dir: str | Path | CheckpointInfo | None = None,
    *,
    memory_budget: str | int = "100%",
    pinned_layers: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    tier: str = "auto",
    predictor: str = "none",
    policy: str = "popularity",
    prefetch_depth: int = DEFAULT_PREFETCH_DEPTH,
    host_tier: bool = False,
    embedding: str = "auto",
) -> Engine:
    """Load a Qwen3-VL-MoE, GLM-4.5V or DeepSeek-VL2 checkpoint with its routed experts left on disk.

    model_dir: a Hugging Face model directory (or what `inspect_checkpoint` read of one); None uses the built-in
        demo model.
    memory_budget: bytes of expert weights kept in memory (pinned prefix + cache): an int (bytes), "2GiB", or
        "40%" of all routed-expert bytes at the compute dtype (config.budget_bytes).
    pinned_layers: the first N MoE layers keep all their experts resident.
    tier: where cache slots live: "host" (RAM slots), "gpu" (CUDA slots), "unified" (the page cache, managed:
        for Jetson and CPU hosts), "mmap" (the page cache, unmanaged: a baseline), "auto" (gpu on CUDA, else
        host).
    predictor: what drives prefetch: "none" (demand only), "next-layer-gate", "previous-token", "learned" (the
        vismmoe-predictor.onnx beside the checkpoint), "auto" (learned when that file exists, else none), or
        the path of a .onnx file.
    policy: which finished expert leaves first: "lru" (least recently used) or "popularity" (the one the
        fewest tokens routed to, decayed; then least recently used).
    prefetch_depth: MoE layers' worth of top-k experts that predictions may have in flight at once.
    host_tier: with GPU slots, mirror every streamed expert in pinned host RAM (filled now): a miss is one DMA.
    embedding: where the token embedding lives on CUDA: "device" (GPU memory), "host" (pinned host memory the GPU
        gathers its rows from in place: models/host_embedding.py), "auto" (host where GPU slots hold fewer than
        every expert, so that its GPU memory is not taken from the experts).

    Options left to the planner ("auto" budget, ...) are filled by `vismmoe_edge.options.load_engine`.
    """
    check_transformers()
    info = as_checkpoint_info(model_dir)
    model_dir, config, table, catalogue = info.model_dir, info.config, info.table, info.catalogue
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, info.stored_dtype, torch_device)
    processor = info.family.load_processor(model_dir)

    if policy not in POLICIES:
        raise VismmoeError(f"--policy {policy!r}: use one of {', '.join(POLICIES)}")
    check_predictor_name(predictor)  # before the model is built, not after
    check_embedding_place(embedding)
    moe_layers = catalogue.moe_layers
    if not 0 <= pinned_layers <= len(moe_layers):
        raise VismmoeError(f"--pinned-layers {pinned_layers}: the model has {len(moe_layers)} MoE layers")
    if prefetch_depth < 0:
        raise VismmoeError(f"--prefetch-depth {prefetch_depth}: must not be negative")
    context = StepContext(moe_layers, catalogue.num_experts, info.top_k)
    files = ShardFiles()
    store = ExpertStore(catalogue, files, torch_dtype, torch_device)
    budget = budget_bytes(memory_budget, catalogue, torch_dtype)
    runtime = build_runtime(
        store,
        budget_bytes=budget,
        pinned_layers=moe_layers[:pinned_layers],
        tier=tier,
        policy=policy,
        speculative_experts=prefetch_depth * info.top_k,
        host_tier=host_tier,
    )
    slots_in_gpu = tier_kind(resolve_auto(tier, torch_device.type)).memory == "device"
    in_gpu = runtime.pipeline.capacity + len(runtime.pipeline.pinned)
    host_embedding = embedding_in_host(
        embedding, device=torch_device, slots_in_gpu=slots_in_gpu, experts_outside_gpu=len(catalogue.experts) - in_gpu
    )
    model = info.family.build_model(
        config, table, catalogue, files, runtime, dtype=torch_dtype, device=torch_device, host_embedding=host_embedding
    )
    runtime.pipeline.tier.after_load(files, table, catalogue, set(moe_layers[:pinned_layers]))
    on_gpu = torch_device.type == "cuda"
    # Every expert resident (a pinned prefix of every layer, or GPU slots that hold them all): nothing to prefetch,
    # and a predictor would keep the device decode path off, so "auto" attaches none; a named one is still honoured.
    if predictor == "auto" and len(runtime.pipeline.pinned) == len(catalogue.experts):
        predictor = "none"
    attach_predictor(runtime, make_predictor(predictor, model_dir, context, model, on_gpu=on_gpu))
    return Engine(
        model,
        processor,
        runtime,
        catalogue,
        context,
        model_dir=model_dir,
        device=torch_device,
        dtype=torch_dtype,
        eos_token_ids=eos_token_ids(model_dir, config, processor.tokenizer),
        is_demo=info.is_demo,
        pinned_layers=pinned_layers,
        ops=info.family.ops,
        files=files,
    )
