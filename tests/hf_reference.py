"""transformers' own model as the reference: the prompts, its greedy tokens and per-step logits, and the check that
an engine gives the same tokens with logits within a tolerance. Shared by the equivalence and fidelity tests.

The quantized runs' tolerance (docs/quantization.md, "Fidelity"): the reference checkpoints are float32 and the
kernels compute in float32 from the same dequantized weights, so the only differences are one rounding per
dequantized weight and the accumulation order; logits stay within LOGIT_ATOL, while a wrong nibble, group or
scale moves them by 0.1-1 (tested in test_quant_engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vismmoe_edge.prompt import PromptInputs
from vismmoe_edge.sampling import SamplingConfig

NEW_TOKENS = 6
LOGIT_ATOL = 1e-4
PROMPTS = {
    "text": ("Tell me a story about the sea.", 0),
    "one_image": ("What shape is red?", 1),
    "two_images": ("Which image has more blue?", 2),
}


@dataclass
class Reference:
    inputs: PromptInputs
    tokens: list[int]
    logits: list[torch.Tensor]  # per generated position, before any logits processor


def hf_kwargs(inputs: PromptInputs) -> dict[str, torch.Tensor]:
    kwargs = {"input_ids": inputs.input_ids, "attention_mask": torch.ones_like(inputs.input_ids)}
    if inputs.pixel_values is not None:
        kwargs |= {"pixel_values": inputs.pixel_values, "image_grid_thw": inputs.image_grid_thw}
        if inputs.mm_token_type_ids is not None:
            kwargs["mm_token_type_ids"] = inputs.mm_token_type_ids
    return kwargs


def hf_references(model, encode, images: list[Path], prompts: dict = PROMPTS) -> dict[str, Reference]:
    """transformers' greedy tokens and per-step logits for each prompt; `encode(prompt, image paths)`."""
    refs = {}
    for name, (prompt, n_images) in prompts.items():
        inputs = encode(prompt, images[:n_images])
        with torch.no_grad():
            out = model.generate(
                **hf_kwargs(inputs),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,  # random weights may emit EOS at once; both sides suppress it alike
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        if hasattr(model, "model") and hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = None  # state transformers caches on the model: keep prompts independent
        tokens = out.sequences[0, inputs.num_tokens :].tolist()
        refs[name] = Reference(inputs, tokens, [step[0].float() for step in out.logits])
    return refs


def teacher_forced_logits(engine, inputs: PromptInputs, tokens: list[int], *, static: bool = False) -> list:
    logits, state = engine.prefill(inputs)
    if static:
        engine.start_decode(state, len(tokens))
    steps = [logits.float()]
    for token in tokens[:-1]:
        steps.append(engine.decode_step(token, state).float().clone())
    return steps


def assert_matches(engine, refs: dict[str, Reference], *, static: bool = False, atol: float = LOGIT_ATOL) -> float:
    """Same greedy tokens as the reference for every prompt, logits within `atol` at every step; returns the
    largest logit difference seen."""
    worst = 0.0
    for name, ref in refs.items():
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        result = engine.generate_from_inputs(ref.inputs, sampling)
        assert result.token_ids == ref.tokens, name
        ours = teacher_forced_logits(engine, ref.inputs, ref.tokens, static=static)
        for step, (a, b) in enumerate(zip(ours, ref.logits, strict=True)):
            diff = (a - b).abs().max().item()
            worst = max(worst, diff)
            assert diff <= atol, f"{name} step {step}: {diff}"
    return worst


@dataclass
class Divergence:
    """Where a run's greedy tokens first leave the reference's, and whether that is a near-tie."""

    step: int  # the first differing generated position
    margin: float  # the reference's top-2 logit margin there
    difference: float  # max |ours - reference| over the vocabulary there, teacher-forced on the reference's tokens
    accepted: bool  # margin < difference: the two implementations' rounding alone can swap the top two

    def describe(self) -> str:
        verdict = "near-tie, accepted" if self.accepted else "NOT a near-tie"
        gaps = f"reference top-2 margin {self.margin:.4g}, logit difference {self.difference:.4g}"
        return f"step {self.step}: {gaps} ({verdict})"


def near_tie_divergence(
    ours: list[int], reference: list[int], ref_logits: list[torch.Tensor], our_forced_logits: list[torch.Tensor]
) -> Divergence | None:
    """The near-tie rule of the GPU checks (never of the CPU tests, which stay exact): None when the tokens are
    equal; else the first differing step, accepted only where the reference's top-2 margin is below the largest
    logit difference between the two implementations at that step, both teacher-forced on the reference's tokens.

    At the first differing step both runs have seen the same tokens, so the difference measured there is the
    numerical noise between the implementations (bf16 sums in another order, another GEMM); a margin below it
    is a tie that noise decides. The difference is the maximum over the vocabulary, not that of the two
    tokens' gap (which any flip makes at least the margin); the callers also bound it by their logit tolerance,
    so a wrong expert (a difference of 0.1-1) is not excused as a tie.
    """
    if ours == reference:
        return None
    step = next((i for i, (a, b) in enumerate(zip(ours, reference, strict=False)) if a != b), None)
    if step is None:
        raise AssertionError(f"lengths differ: {len(ours)} tokens against the reference's {len(reference)}")
    top2 = ref_logits[step].float().topk(2).values
    margin = float(top2[0] - top2[1])
    difference = float((our_forced_logits[step].float() - ref_logits[step].float()).abs().max())
    return Divergence(step, margin, difference, margin < difference)
