"""The engine against transformers' own model on the same checkpoint: same greedy tokens, logits within 1e-5."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3VLMoeForConditionalGeneration

import vismmoe_edge
from tests.hf_reference import (
    NEW_TOKENS,
    PROMPTS,
    assert_matches,
    hf_kwargs,
    teacher_forced_logits,
)
from vismmoe_edge.config import parse_budget
from vismmoe_edge.sampling import SamplingConfig


@pytest.mark.parametrize("layout", ["v5", "hub", "per_expert"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
@pytest.mark.parametrize("pinned", [0, 2])
def test_engine_matches_transformers(checkpoints, references, layout: str, budget: str, pinned: int) -> None:
    engine = vismmoe_edge.load(checkpoints[layout], memory_budget=budget, pinned_layers=pinned, device="cpu")
    assert engine.dtype == torch.float32
    budget_bytes = parse_budget(budget, engine.catalogue.expert_bytes * len(engine.catalogue.experts))
    for name, ref in references.items():
        result = engine.generate_from_inputs(
            ref.inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == ref.tokens, name
        ours = teacher_forced_logits(engine, ref.inputs, ref.tokens)
        for step, (a, b) in enumerate(zip(ours, ref.logits, strict=True)):
            assert torch.allclose(a, b, atol=1e-5, rtol=0), f"{name} step {step}: {(a - b).abs().max()}"
        stats = engine.experts.pipeline.stats
        assert stats.peak_resident_bytes <= budget_bytes
        if budget == "25%":
            assert result.experts["misses"] > 0 and result.experts["evictions"] > 0, name


def test_pinned_layers_prefill_without_host_work(checkpoints, references, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MoE layer pinned (as where GPU slots hold every expert): a prefill takes each layer's slots from the
    routing on the device (OffloadedExperts.pinned_forward) and never enters the pipeline's per-expert path, whose
    first step reads the routing back to the host. Tokens and logits stay transformers'; the hits, counted on the
    device, equal the per-expert path's."""
    from vismmoe_edge.experts.compute import OffloadedExperts
    from vismmoe_edge.experts.pipeline import ExpertPipeline

    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=10, device="cpu")
    moe = [m for m in engine.model.modules() if isinstance(m, OffloadedExperts)]
    assert len(moe) == 10 and all(m.pinned_run() is not None for m in moe)
    ref = references["one_image"]
    hits = []
    for fast in (False, True):
        with monkeypatch.context() as m:
            if fast:  # one new token: the prefill alone
                m.setattr(ExpertPipeline, "begin_layer", lambda *a, **kw: pytest.fail("per-expert path in a prefill"))
            else:
                m.setattr(OffloadedExperts, "pinned_run", lambda self: None)
            result = engine.generate_from_inputs(ref.inputs, SamplingConfig(max_new_tokens=1, min_new_tokens=1))
        assert result.token_ids == ref.tokens[:1]
        hits.append(result.experts["hits"])
    assert hits[0] == hits[1] > 0
    assert_matches(engine, references, atol=1e-5)


@pytest.mark.parametrize("predictor", ["next-layer-gate", "previous-token"])
@pytest.mark.parametrize("tier", ["host", "unified", "mmap", "unified-slots"])
def test_every_tier_and_predictor_matches_transformers(checkpoints, references, tier: str, predictor: str) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=1, tier=tier, predictor=predictor)
    assert_matches(engine, references, atol=1e-5)
    if tier != "mmap":
        assert engine.experts.pipeline.stats.speculative_bytes > 0  # the predictor really drove prefetches


def test_popularity_policy_matches_transformers(checkpoints, references) -> None:
    engine = vismmoe_edge.load(checkpoints["hub"], memory_budget="25%", policy="popularity", tier="unified")
    for name, ref in references.items():
        result = engine.generate_from_inputs(
            ref.inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == ref.tokens, name
    assert engine.experts.pipeline.stats.evictions > 0


def test_bfloat16_matches_transformers(tmp_path: Path, images: list[Path]) -> None:
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "bf16", seed=3, dtype=torch.bfloat16)
    engine = vismmoe_edge.load(model_dir, memory_budget="30%", pinned_layers=1, device="cpu")
    assert engine.dtype == torch.bfloat16
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.bfloat16, experts_implementation="eager"
    ).eval()
    for prompt, n_images in PROMPTS.values():
        inputs = engine.encode(prompt, images[:n_images])
        with torch.no_grad():
            out = ref.generate(
                **hf_kwargs(inputs), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
        result = engine.generate_from_inputs(
            inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == out[0, inputs.num_tokens :].tolist(), prompt


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run tools/device/gpu_checks.sh on the GPU server)"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "predictor,graphs,host_tier",
    [("none", True, False), ("none", False, False), ("none", True, True), ("next-layer-gate", True, True),
     ("previous-token", True, False)],
)  # fmt: skip
def test_cuda_slot_pool_matches_transformers(
    tmp_path: Path, images: list[Path], dtype, predictor: str, graphs: bool, host_tier: bool
) -> None:
    """The GPU tier with CUDA graphs on and off, with and without the pinned host tier: transformers' tokens."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "m", seed=5, dtype=dtype, layout="hub", num_layers=8)
    engine = vismmoe_edge.load(
        model_dir, memory_budget="25%", pinned_layers=1, device="cuda", predictor=predictor, host_tier=host_tier
    )
    engine.cuda_graphs = graphs
    assert engine.experts.pipeline.tier.name == "gpu-slots" and engine.uses_static_decode()
    ref = (
        Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, experts_implementation="eager")
        .to("cuda")
        .eval()
    )
    for prompt, n_images in PROMPTS.values():
        inputs = engine.encode(prompt, images[:n_images])
        kwargs = {k: v.to("cuda") for k, v in hf_kwargs(inputs).items()}
        with torch.no_grad():
            out = ref.generate(
                **kwargs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        tokens = out.sequences[0, inputs.num_tokens :].tolist()
        result = engine.generate_from_inputs(
            inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == tokens, prompt
        if dtype == torch.float32:
            ours = teacher_forced_logits(engine, inputs, tokens, static=True)
            for step, (a, b) in enumerate(zip(ours, out.logits, strict=True)):
                b = b[0].float()
                assert torch.allclose(a, b, atol=1e-4, rtol=0), f"{prompt} step {step}: {(a - b).abs().max()}"
    assert engine.experts.pipeline.stats.misses > 0
    assert (engine.experts.pipeline.tier.mirror is not None) == host_tier
    assert all(d.graphs == graphs for d in engine._decoders.values())


@pytest.mark.parametrize("layout", ["v5", "hub"])
@pytest.mark.parametrize("budget", ["100%", "25%"])
@pytest.mark.parametrize("pinned", [0, 2])
def test_static_cache_decode_matches_transformers(checkpoints, references, layout: str, budget: str, pinned: int):
    """The preallocated-cache decoder (what CUDA graphs replay), run eagerly here: same tokens, same logits."""
    engine = vismmoe_edge.load(checkpoints[layout], memory_budget=budget, pinned_layers=pinned, device="cpu",
                               tier="host")  # fmt: skip
    engine.static_decode = "on"
    assert engine.uses_static_decode()
    assert_matches(engine, references, static=True, atol=1e-5)
    assert len(engine._decoders) == 1  # one decoder (one capture on CUDA) served every prompt


def test_one_decoder_a_mode_grows_to_the_longest_request(checkpoints, references, monkeypatch) -> None:
    """Prompts needing several KV capacities: the decoder is rebuilt only when a request needs more than it holds
    and a shorter one reuses it, so the KV held is that of the longest request so far, never one buffer per
    length (the plan counts the KV once); the tokens stay transformers'."""
    from vismmoe_edge import static_decode

    monkeypatch.setattr(static_decode, "CAPACITY_STEP", 16)  # the tiny prompts then fall in several capacities
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu", tier="host")
    engine.static_decode = "on"
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    lengths = {name: ref.inputs.num_tokens for name, ref in references.items()}
    assert len({static_decode.capacity_for(n + NEW_TOKENS + 1) for n in lengths.values()}) == 3
    held, decoders = 0, []
    for name in ("text", "one_image", "text", "two_images", "one_image"):
        result = engine.generate_from_inputs(references[name].inputs, sampling)
        assert result.token_ids == references[name].tokens, name
        (decoder,) = engine._decoders.values()
        held = max(held, static_decode.capacity_for(lengths[name] + NEW_TOKENS + 1))
        assert decoder.cache.capacity == held, name
        decoders.append(decoder)
    assert decoders[2] is decoders[1] and decoders[4] is decoders[3] and decoders[1] is not decoders[0]
