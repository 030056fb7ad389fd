"""GLM-4.5V through the engine against transformers' own model on the same tiny checkpoint: same greedy tokens,
logits within 1e-5, the model's own routing, resident shared experts / dense layers / routers."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Glm4vMoeForConditionalGeneration

import vismmoe_edge
from tests.hf_reference import NEW_TOKENS, PROMPTS, hf_kwargs, teacher_forced_logits
from vismmoe_edge.compress.prune import CompressionConfig
from vismmoe_edge.config import parse_budget
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import OffloadedExperts
from vismmoe_edge.prompt import PromptInputs, encode_prompt, load_image
from vismmoe_edge.sampling import SamplingConfig

LAYERS = 7  # layer 0 dense (first_k_dense_replace = 1), layers 1..6 MoE: 25% leaves 8 slots beside 1 pinned
MOE_LAYERS = list(range(1, LAYERS))


@dataclass
class Reference:
    inputs: PromptInputs
    tokens: list[int]
    logits: list[torch.Tensor]  # per generated position, before any logits processor
    routes: dict[int, torch.Tensor]  # MoE layer -> top-k experts per prompt token, from the prefill


@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vismmoe_edge.testing.tiny_glm4v import build_tiny_glm4v_checkpoint

    return build_tiny_glm4v_checkpoint(tmp_path_factory.mktemp("glm") / "tiny", seed=7, num_layers=LAYERS)


@pytest.fixture(scope="module")
def hf_model(glm_dir: Path) -> Glm4vMoeForConditionalGeneration:
    return Glm4vMoeForConditionalGeneration.from_pretrained(glm_dir, experts_implementation="eager").eval()


def hf_prefill_routes(model: Glm4vMoeForConditionalGeneration, inputs: PromptInputs) -> dict[int, torch.Tensor]:
    """The experts transformers' router picks for every prompt token (gate output: logits, weights, index)."""
    routes: dict[int, torch.Tensor] = {}
    handles = [
        model.model.language_model.layers[i].mlp.gate.register_forward_hook(
            lambda _m, _in, out, i=i: routes.__setitem__(i, out[2].detach().clone())
        )
        for i in MOE_LAYERS
    ]
    try:
        with torch.no_grad():
            model(**hf_kwargs(inputs))
    finally:
        for h in handles:
            h.remove()
    model.model.rope_deltas = None  # state transformers caches on the model: keep later calls independent
    return routes


@pytest.fixture(scope="module")
def references(glm_dir: Path, hf_model, images: list[Path]) -> dict[str, Reference]:
    from vismmoe_edge.models.glm4v_moe import load_glm4v_processor

    processor = load_glm4v_processor(glm_dir)
    refs = {}
    for name, (prompt, n_images) in PROMPTS.items():
        inputs = encode_prompt(processor, prompt, [load_image(p) for p in images[:n_images]])
        routes = hf_prefill_routes(hf_model, inputs)
        with torch.no_grad():
            out = hf_model.generate(
                **hf_kwargs(inputs),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,  # random weights may emit EOS at once; both sides suppress it alike
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, inputs.num_tokens :].tolist()
        refs[name] = Reference(inputs, tokens, [step[0].float() for step in out.logits], routes)
    return refs


def test_tiny_checkpoint_is_in_the_glm_layout(glm_dir: Path) -> None:
    from vismmoe_edge.checkpoint import read_tensor_table
    from vismmoe_edge.models import glm4v_moe

    config = glm4v_moe.read_config(glm_dir)
    table = read_tensor_table(glm_dir)
    assert len({info.shard for info in table.values()}) > 1
    catalogue = glm4v_moe.FAMILY.catalogue_for(config, table)
    assert catalogue.layout == "per_expert" and catalogue.moe_layers == MOE_LAYERS
    prefix = "model.language_model.layers"
    assert f"{prefix}.1.mlp.experts.15.up_proj.weight" in catalogue.tensor_names
    assert not any("gate_up_proj" in name for name in table)
    resident = [name for name in table if name not in catalogue.tensor_names]
    for name in (
        f"{prefix}.0.mlp.gate_proj.weight",  # the dense first layer
        f"{prefix}.1.mlp.gate.weight",
        f"{prefix}.1.mlp.gate.e_score_correction_bias",
        f"{prefix}.1.mlp.shared_experts.down_proj.weight",
    ):
        assert name in resident, name


def test_processor_is_offline_and_counts_visual_tokens(glm_dir: Path, images: list[Path]) -> None:
    from vismmoe_edge.models.glm4v_moe import load_glm4v_processor

    processor = load_glm4v_processor(glm_dir)
    inputs = encode_prompt(processor, "What is this?", [load_image(images[0])])
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image|>")
    assert inputs.image_grid_thw.tolist() == [[1, 12, 16]]  # 224x160 -> 168x224 px -> 12x16 patches of 14
    assert int((inputs.input_ids == image_id).sum()) == 12 * 16 // 4
    assert inputs.mm_token_type_ids is not None and int(inputs.mm_token_type_ids.sum()) == 48


@pytest.mark.parametrize("budget", ["100%", "25%"])
@pytest.mark.parametrize("pinned", [0, 1])
def test_engine_matches_transformers(glm_dir, references, budget: str, pinned: int) -> None:
    engine = vismmoe_edge.load(glm_dir, memory_budget=budget, pinned_layers=pinned, device="cpu")
    assert engine.dtype == torch.float32 and engine.catalogue.moe_layers == MOE_LAYERS
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


@pytest.mark.parametrize(("tier", "predictor"), [("unified", "next-layer-gate"), ("host", "previous-token")])
def test_tiers_and_predictors_match_transformers(glm_dir, references, tier: str, predictor: str) -> None:
    engine = vismmoe_edge.load(glm_dir, memory_budget="25%", pinned_layers=1, tier=tier, predictor=predictor)
    for name, ref in references.items():
        result = engine.generate_from_inputs(
            ref.inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == ref.tokens, name
    assert engine.experts.pipeline.stats.speculative_bytes > 0


def test_offloaded_experts_see_the_models_own_routing(glm_dir, references) -> None:
    """OffloadedExperts is handed top_k_index by transformers' MoE block (sigmoid + bias + groups): the experts
    we fetch are the ones transformers' own router picks, token by token."""
    engine = vismmoe_edge.load(glm_dir, memory_budget="25%", device="cpu")
    seen: dict[int, torch.Tensor] = {}
    engine.experts.route_hooks.append(lambda layer, hidden, index, weights: seen.__setitem__(layer, index.clone()))
    for name, ref in references.items():
        seen.clear()
        engine.prefill(ref.inputs)
        assert sorted(seen) == MOE_LAYERS, name
        for layer in MOE_LAYERS:
            ours, theirs = seen[layer].sort(dim=-1).values, ref.routes[layer].sort(dim=-1).values
            assert torch.equal(ours, theirs), f"{name} layer {layer}"


def test_resident_parts_are_loaded(glm_dir, hf_model) -> None:
    engine = vismmoe_edge.load(glm_dir, memory_budget="25%", device="cpu")
    ours, theirs = engine.model.model.language_model.layers, hf_model.model.language_model.layers
    assert not hasattr(ours[0].mlp, "experts")  # dense layer: its MLP is an ordinary resident module
    assert torch.equal(ours[0].mlp.gate_proj.weight, theirs[0].mlp.gate_proj.weight)
    for i in MOE_LAYERS:
        assert isinstance(ours[i].mlp.experts, OffloadedExperts)
        bias = ours[i].mlp.gate.e_score_correction_bias
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0
        assert torch.equal(bias, theirs[i].mlp.gate.e_score_correction_bias)
        assert torch.equal(ours[i].mlp.gate.weight, theirs[i].mlp.gate.weight)
        assert torch.equal(ours[i].mlp.shared_experts.up_proj.weight, theirs[i].mlp.shared_experts.up_proj.weight)
    assert not any(p.is_meta for p in engine.model.parameters())


def test_bfloat16_matches_transformers(tmp_path: Path, images: list[Path]) -> None:
    """In bf16 transformers keeps the router (weight and bias) in fp32; so must we, or routing drifts."""
    from vismmoe_edge.testing.tiny_glm4v import build_tiny_glm4v_checkpoint

    model_dir = build_tiny_glm4v_checkpoint(tmp_path / "bf16", seed=3, dtype=torch.bfloat16, num_layers=4)
    engine = vismmoe_edge.load(model_dir, memory_budget="100%", device="cpu")
    assert engine.dtype == torch.bfloat16
    assert engine.model.model.language_model.layers[1].mlp.gate.weight.dtype == torch.float32
    ref = Glm4vMoeForConditionalGeneration.from_pretrained(
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


def test_compression_is_accepted_for_glm_and_refused_where_ops_say_no(glm_dir) -> None:
    """GLM supports compression (tests/test_compress_glm4v.py checks it); a family whose ops say it does not is
    refused in one line when the compressor is set, not mid-request."""
    from vismmoe_edge.models.glm4v_moe import Glm4vMoeOps

    engine = vismmoe_edge.load(glm_dir, device="cpu")
    engine.compression = CompressionConfig("random", keep_ratio=0.5)

    class Unsupported(Glm4vMoeOps):
        supports_compression = False

    engine.ops = Unsupported()
    with pytest.raises(VismmoeError, match="not supported for glm4v_moe") as e:
        engine.compression = CompressionConfig("zip", keep_ratio=0.5)
    assert "\n" not in str(e.value) and "--compressor zip" in str(e.value)
    engine.compression = CompressionConfig()  # none stays accepted


def test_info_reports_shared_experts_and_dense_layers(glm_dir) -> None:
    from vismmoe_edge.planning.describe import describe_checkpoint, format_description

    d = describe_checkpoint(glm_dir, "25%")
    hidden, inter, dense_inter = 128, 48, 3 * 128
    assert d["architecture"] == "Glm4vMoeForConditionalGeneration" and d["expert_layout"] == "per_expert"
    assert (d["layers"], d["moe_layers"], d["experts_per_layer"], d["top_k"]) == (LAYERS, len(MOE_LAYERS), 16, 4)
    assert d["shared_experts"] == 1
    assert d["shared_expert_bytes"] == len(MOE_LAYERS) * 3 * hidden * inter * 4
    assert (d["dense_mlp_bytes"], d["dense_mlp_layers"]) == (3 * hidden * dense_inter * 4, 1)
    assert d["resident_bytes"] > d["shared_expert_bytes"] + d["dense_mlp_bytes"]
    assert d["total_expert_bytes"] == len(MOE_LAYERS) * 16 * 3 * hidden * inter * 4
    text = format_description(d)
    assert "1 shared" in text and "shared experts" in text and "(1 dense layers)" in text


def test_extra_mtp_layer_is_ignored(glm_dir: Path, tmp_path: Path, references) -> None:
    """GLM-4.5V checkpoints carry a next-token-prediction layer after the last decoder layer; transformers
    ignores it on load, and so must the expert catalogue and the resident loader."""
    model_dir = Path(shutil.copytree(glm_dir, tmp_path / "mtp"))
    extra = {
        f"model.language_model.layers.{LAYERS}.mlp.experts.0.gate_proj.weight": torch.zeros(48, 128),
        f"model.language_model.layers.{LAYERS}.eh_proj.weight": torch.zeros(128, 256),
    }
    save_file(extra, str(model_dir / "mtp.safetensors"), metadata={"format": "pt"})
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] |= dict.fromkeys(extra, "mtp.safetensors")
    index_path.write_text(json.dumps(index))
    engine = vismmoe_edge.load(model_dir, device="cpu")
    assert engine.catalogue.moe_layers == MOE_LAYERS
    ref = references["one_image"]
    result = engine.generate_from_inputs(
        ref.inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    )
    assert result.token_ids == ref.tokens


def test_unknown_model_type_is_one_line_refused(tmp_path: Path) -> None:
    from vismmoe_edge.models.registry import model_family

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4", "architectures": ["Llama4ForX"]}))
    with pytest.raises(VismmoeError, match="unsupported architecture Llama4ForX; vismmoe-edge runs Qwen3VLMoe"):
        model_family(tmp_path)
