"""The prefix cache (issue 26): one image, many questions. The second question about an image reuses the image's
vision features and the prompt prefix's KV, and its greedy tokens stay those of transformers' own model fed what
its processor returns, and those of a cold run; the byte bound holds under eviction and under threads."""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import pytest
import torch
import typer

from tests.hf_reference import NEW_TOKENS, hf_references
from vismmoe_edge.prefix_cache import CachedVision, PrefixCache, image_code, shared_length
from vismmoe_edge.sampling import SamplingConfig

QUESTIONS = {"first": ("What shape is red?", 1), "second": ("Which shape is blue, and where is it?", 1)}


def greedy() -> SamplingConfig:
    return SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)


def ask_twice(engine, prompts: dict, image: Path) -> tuple[list, list]:
    """Each question with the cache (the first fills it, the second reuses it), then each cold."""
    warm = [engine.generate_from_inputs(engine.encode(q, [image]), greedy()) for q, _ in prompts.values()]
    cold = [
        engine.generate_from_inputs(engine.encode(q, [image]), greedy(), use_cache=False) for q, _ in prompts.values()
    ]
    return warm, cold


def check_reuse(engine, refs: dict, prompts: dict, image: Path) -> None:
    engine.prefix_cache = PrefixCache(64 << 20, salt="test")
    try:
        warm, cold = ask_twice(engine, prompts, image)
    finally:
        engine.prefix_cache = None
    first, second = warm
    assert first.timings.prefix_reused_tokens == 0 and first.timings.vision_cached_images == 0
    image_tokens = int((refs["second"].inputs.input_ids == engine.model.config.image_token_id).sum())
    # the whole image and the template before it came from the cache: only the question was prefilled
    assert second.timings.prefix_reused_tokens > image_tokens
    assert second.timings.vision_cached_images == 1
    for name, result, cold_result in zip(prompts, warm, cold, strict=True):
        assert result.token_ids == refs[name].tokens == cold_result.token_ids, name
        assert result.prompt_token_ids == refs[name].inputs.input_ids[0].tolist()


@pytest.fixture(scope="module")
def question_refs(checkpoints: dict[str, Path], images: list[Path]) -> dict:
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.models.qwen3_vl_moe import load_qwen3_vl_processor
    from vismmoe_edge.prompt import encode_prompt, load_image

    model_dir = checkpoints["v5"]
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, experts_implementation="eager").eval()
    processor = load_qwen3_vl_processor(model_dir)
    encode = lambda prompt, paths: encode_prompt(processor, prompt, [load_image(p) for p in paths])  # noqa: E731
    return hf_references(model, encode, images, QUESTIONS)


@pytest.mark.parametrize(("budget", "pinned"), [("100%", 0), ("30%", 2)], ids=["all-resident", "budget-30%"])
def test_second_question_reuses_the_prefill_with_transformers_tokens(
    checkpoints: dict[str, Path], images: list[Path], question_refs: dict, budget: str, pinned: int
) -> None:
    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget=budget, pinned_layers=pinned, device="cpu")
    check_reuse(engine, question_refs, QUESTIONS, images[0])


@pytest.mark.parametrize("explicit", [False, True], ids=["transformers-layers", "explicit-attention"])
def test_a_suffix_over_padded_graph_buffers_keeps_tokens_and_hits(
    checkpoints: dict[str, Path], images: list[Path], question_refs: dict, explicit: bool
) -> None:
    """suffix_graph.py: with every MoE layer pinned, the second question's suffix runs over static buffers padded
    to 8 tokens (on CUDA captured once and replayed; here the same steps eagerly), through transformers' layers or
    the explicit attention that CUDA compiles (kernels/suffix_layer.py). Its tokens are transformers', its
    prefill logits those of the unpadded prefill, and its hits too: padding rows count none."""
    from vismmoe_edge.loader import load
    from vismmoe_edge.suffix_graph import SuffixGraphs

    engine = load(checkpoints["v5"], memory_budget="100%", pinned_layers=10, device="cpu")
    engine.suffix_graphs = graphs = SuffixGraphs(engine, capture=False, explicit_layers=explicit)
    check_reuse(engine, question_refs, QUESTIONS, images[0])
    assert (graphs.suffix_layers() is not None) == explicit
    assert graphs.replays == 1  # the second question; cold runs reuse nothing
    logits, hits = {}, {}
    for padded in (True, False):
        graphs.enabled = padded
        engine.prefix_cache = PrefixCache(64 << 20, salt="test")
        engine.prefill(engine.encode(QUESTIONS["first"][0], [images[0]]))
        second = engine.encode(QUESTIONS["second"][0], [images[0]])  # keyed by the cache's frames
        before = engine.experts.pipeline.stats.hits
        logits[padded], _ = engine.prefill(second)
        hits[padded] = engine.experts.pipeline.stats.hits - before
    engine.prefix_cache = None
    assert graphs.replays == 2 and hits[True] == hits[False] > 0
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=0)


def test_the_daemon_warms_the_suffix_attention_for_its_shapes_and_keeps_no_graph(
    checkpoints: dict[str, Path], images: list[Path], question_refs: dict
) -> None:
    """serve/warmup.py: where the suffix attention compiles (CUDA), the daemon runs it before READY over zeros of
    the warm shapes, so that torch.compile's code takes any length, and drops those graphs. Here the compiled flag is
    set by hand over the eager code (the CPU compiles nothing): the shapes run, nothing is kept, and the
    next question still gets transformers' tokens."""
    from vismmoe_edge.loader import load
    from vismmoe_edge.serve.warmup import warm_suffix_graphs
    from vismmoe_edge.suffix_graph import SuffixGraphs

    engine = load(checkpoints["v5"], memory_budget="100%", pinned_layers=10, device="cpu")
    engine.prefix_cache = PrefixCache(64 << 20, salt="test")
    assert warm_suffix_graphs(engine) is None  # the CPU's own suffix graphs: nothing compiles
    engine.suffix_graphs = graphs = SuffixGraphs(engine, capture=False, explicit_layers=True)
    explicit = graphs.suffix_layers()
    assert explicit is not None and not explicit.compiled and not graphs.warm()
    shapes: set[tuple[int, int]] = set()
    attend = explicit.attend

    def recording(i: int, hidden: torch.Tensor, cos_sin, prefix_keys: torch.Tensor, *rest):  # type: ignore[no-untyped-def]
        shapes.add((prefix_keys.shape[2], hidden.shape[1]))
        return attend(i, hidden, cos_sin, prefix_keys, *rest)

    explicit.attend = recording  # type: ignore[method-assign]
    explicit.compiled = True
    assert warm_suffix_graphs(engine) is not None
    assert shapes == {(24, 8), (40, 16), (37, 16)} and not graphs.graphs and graphs.enabled
    assert engine.experts.pipeline.stats.hits == 0  # the warm-up's zeros count nothing
    check_reuse(engine, question_refs, QUESTIONS, images[0])


def test_the_warm_shapes_compile_the_attention_mask_aligned_and_not() -> None:
    """Inductor guards an SDPA mask's strides on alignment to 8 elements on CUDA (torch/_inductor/ir.py
    is_aligned_realized_tensor), and the mask's row stride is reused + padded positions: run 13's daemon warmed
    two aligned shapes (24 + 8, 40 + 16), and the first question after a frame, 1,094 + 32, compiled again for
    3 s. The shapes after the first (those compiled with dynamic lengths) cover both cases."""
    from vismmoe_edge.suffix_graph import MASK_ALIGNMENT, WARM_SHAPES, padded_length

    dynamic = WARM_SHAPES[1:]
    aligned = {(reused + padded_length(tokens)) % MASK_ALIGNMENT == 0 for reused, tokens in dynamic}
    assert aligned == {True, False}
    assert len({padded_length(t) for _, t in WARM_SHAPES[:2]}) == 2  # the first two differ: lengths go dynamic
    assert len({r for r, _ in WARM_SHAPES[:2]}) == 2


def test_after_the_warm_up_the_first_question_after_a_frame_compiles_nothing(
    checkpoints: dict[str, Path], images: list[Path]
) -> None:
    """Run 12 (an H100): the daemon warmed the suffix attention, yet its first question after a cached frame took
    5.9 s, the next 0.03 s. The warm-up ran with autograd on and requests run under inference mode; dynamo guards
    on that and compiled again. Compiled here for real (inductor's CPU backend, which has no mask alignment
    guard, so the third warm shape compiles nothing more), the warm-up's two graphs are all there are after a
    question."""
    from torch._dynamo.utils import counters

    from vismmoe_edge.kernels.suffix_layer import SuffixLayers
    from vismmoe_edge.loader import load
    from vismmoe_edge.suffix_graph import SuffixGraphs

    engine = load(checkpoints["v5"], memory_budget="100%", pinned_layers=10, device="cpu")
    engine.suffix_graphs = graphs = SuffixGraphs(engine, capture=False, explicit_layers=True)
    graphs._layers = SuffixLayers(engine.language_model, compile=True)  # what CUDA gets (compiles_layers)
    torch._dynamo.reset()  # dynamo keeps what it learnt of a function's shapes per process: start and leave clean
    counters.clear()
    try:
        assert graphs.warm() and counters["stats"]["unique_graphs"] == 2
        engine.prefix_cache = PrefixCache(64 << 20, salt="test")
        engine.prefill(engine.encode(QUESTIONS["first"][0], [images[0]]))
        engine.prefill(engine.encode(QUESTIONS["second"][0], [images[0]]))
        assert graphs.replays == 1 and counters["stats"]["unique_graphs"] == 2
    finally:
        engine.prefix_cache = None
        torch._dynamo.reset()


def test_a_suffix_s_padding_rows_reach_no_expert_of_their_own(
    checkpoints: dict[str, Path], images: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The padding rows of a suffix's graph buffers are routed as its first row: they read no expert weights the
    question's own tokens do not (routed as they come, each could reach k experts of its own)."""
    from vismmoe_edge.experts.compute import OffloadedExperts
    from vismmoe_edge.loader import load
    from vismmoe_edge.suffix_graph import SuffixGraphs

    engine = load(checkpoints["v5"], memory_budget="100%", pinned_layers=10, device="cpu")
    engine.suffix_graphs = graphs = SuffixGraphs(engine, capture=False)
    engine.prefix_cache = PrefixCache(64 << 20, salt="test")
    engine.prefill(engine.encode(QUESTIONS["first"][0], [images[0]]))
    second = engine.encode(QUESTIONS["second"][0], [images[0]])
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    compute = OffloadedExperts.pool_compute

    def spy(self: OffloadedExperts, x: torch.Tensor, slots: torch.Tensor, *args: object, **kwargs: object):
        seen.append((slots.clone(), engine.experts.counted_rows.clone()))
        return compute(self, x, slots, *args, **kwargs)

    monkeypatch.setattr(OffloadedExperts, "pool_compute", spy)
    engine.prefill(second)
    assert graphs.replays == 1 and seen
    for slots, counted in seen:
        assert 0 < int(counted.sum()) < counted.shape[0]  # padding exists
        assert (slots[~counted] == slots[:1]).all()


def test_the_suffix_graph_applies_only_where_nothing_needs_the_host(checkpoints: dict[str, Path]) -> None:
    """Where a capture would fail or the padding could change what the engine sees, the suffix prefills eagerly:
    on the CPU (no CUDA graphs), with a route hook, a visual token in the suffix, more than 64 tokens, or a layer
    whose experts are not all pinned."""
    from vismmoe_edge.loader import load
    from vismmoe_edge.suffix_graph import MAX_TOKENS, SuffixGraphs, padded_length

    assert [padded_length(n) for n in (1, 8, 9, 20, 33, 64)] == [8, 8, 16, 32, 64, 64]
    engine = load(checkpoints["v5"], memory_budget="100%", pinned_layers=10, device="cpu")
    assert not SuffixGraphs(engine).applies(20, 0)  # capturing needs CUDA
    graphs = SuffixGraphs(engine, capture=False)
    assert graphs.applies(20, 0) and graphs.applies(MAX_TOKENS, 0)
    assert not graphs.applies(MAX_TOKENS + 1, 0) and not graphs.applies(20, 1)
    engine.experts.route_hooks.append(lambda *args: None)
    assert not graphs.applies(20, 0)
    partial = load(checkpoints["v5"], memory_budget="30%", pinned_layers=2, device="cpu")
    assert not SuffixGraphs(partial, capture=False).applies(20, 0)


def test_second_question_on_the_demo_model_matches_transformers(images: list[Path]) -> None:
    """The shipped demo model (float32 on both sides), budget below 100%."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.demo import TRAINED_DEMO_DIR
    from vismmoe_edge.evaluation.sample import ensure_sample_image
    from vismmoe_edge.loader import load
    from vismmoe_edge.prompt import encode_prompt, load_image

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(TRAINED_DEMO_DIR, dtype=torch.float32).eval()
    engine = load(TRAINED_DEMO_DIR, memory_budget="50%", pinned_layers=2, device="cpu", dtype="float32")
    encode = lambda prompt, paths: encode_prompt(engine.processor, prompt, [load_image(p) for p in paths])  # noqa: E731
    sample = ensure_sample_image()
    prompts = {"first": ("What colour is the circle?", 1), "second": ("How many triangles are there?", 1)}
    refs = hf_references(model, encode, [sample], prompts)
    check_reuse(engine, refs, prompts, sample)


def test_compression_reuses_vision_features_only(checkpoints: dict[str, Path], images: list[Path]) -> None:
    """Under --compressor the cut after the pinned prefix shortens the sequence for the layers behind it, so the
    whole prefill runs again: only the vision tower's output is reused (the random method reads no saliency), and
    the tokens are those of a cold run with the same compression."""
    from vismmoe_edge.compress.config import CompressionConfig
    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget="100%", pinned_layers=2, device="cpu")
    engine.compression = CompressionConfig("random", keep_ratio=0.5)
    engine.prefix_cache = PrefixCache(64 << 20, salt="test")
    warm, cold = ask_twice(engine, QUESTIONS, images[0])
    assert [r.timings.prefix_reused_tokens for r in warm] == [0, 0]
    assert [r.timings.vision_cached_images for r in warm] == [0, 1]
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold]
    assert (
        warm[1].compression is not None and warm[1].compression.kept_visual_tokens < warm[1].compression.visual_tokens
    )
    stats = engine.prefix_cache.stats()
    assert stats.prefix_hits == 0 and stats.vision_hits == 1

    engine.compression = CompressionConfig("saliency", keep_ratio=0.5)  # reads the tower's attention: runs it
    again = engine.generate_from_inputs(engine.encode(QUESTIONS["second"][0], [images[0]]), greedy())
    assert again.timings.vision_cached_images == 0 and again.timings.prefix_reused_tokens == 0


def test_opt_out_and_another_image(checkpoints: dict[str, Path], images: list[Path]) -> None:
    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget="100%", device="cpu")
    engine.prefix_cache = cache = PrefixCache(64 << 20, salt="test")
    engine.generate_from_inputs(engine.encode("What shape is red?", [images[0]]), greedy())
    before = cache.stats()
    off = engine.generate_from_inputs(engine.encode("What is blue?", [images[0]]), greedy(), use_cache=False)
    assert off.timings.prefix_reused_tokens == 0 and cache.stats() == before  # neither read nor written
    other = engine.generate_from_inputs(engine.encode("What shape is red?", [images[1]]), greedy())
    assert other.timings.prefix_reused_tokens < 16 and other.timings.vision_cached_images == 0  # another image
    assert cache.stats().entries == before.entries + 2  # its features and its prefix
    tensors = [t for e in cache._entries.values() for t in (e.keys + e.values if hasattr(e, "keys") else e.deepstack)]
    # what the bound counts is what is held: no entry keeps a larger tensor (a whole request's) alive
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)


# ---- the cache alone --------------------------------------------------------------------------------------------
def kv(tokens: int, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.randn(1, 2, tokens, 8) for _ in range(layers)], [torch.randn(1, 2, tokens, 8) for _ in range(layers)]


def content(*parts: list[int]) -> torch.Tensor:
    return torch.tensor([t for part in parts for t in part], dtype=torch.long)


def test_match_compares_images_not_just_placeholders() -> None:
    cache = PrefixCache(1 << 20, min_reuse_tokens=4)
    head = list(range(100, 110))
    a, b = [image_code("a" * 32)] * 20, [image_code("b" * 32)] * 20
    cache.store(content(head, a, [1, 2, 3]), *kv(33))
    entry, reused = cache.match(content(head, a, [1, 2, 4, 5]))
    assert entry is not None and reused == 32
    entry, reused = cache.match(content(head, b, [1, 2, 3]))  # same size, another image: only the text before it
    assert reused == 10
    assert cache.match(content(head, a, [1, 2, 3]))[1] == 32  # the same prompt: all but its last position
    assert shared_length(content([1, 2, 3]), content([1, 2])) == 2


def test_store_keeps_one_entry_per_image_and_extends_conversations() -> None:
    cache = PrefixCache(1 << 20, min_reuse_tokens=4)
    img = [image_code("c" * 32)] * 20
    cache.store(content([7] * 5, img, [1, 2]), *kv(27))
    cache.store(content([7] * 5, img, [3, 4, 5]), *kv(28))  # another question: shares all of the image
    assert cache.stats().entries == 1
    cache.store(content([7] * 5, img, [1, 2], [9, 9, 9]), *kv(30))  # the next turn of the first: replaces it
    stats = cache.stats()
    assert stats.entries == 1 and cache.match(content([7] * 5, img, [1, 2], [9, 9, 9], [8]))[1] == 30


def test_lru_bound_and_eviction() -> None:
    one = sum(t.numel() * 4 for t in sum(kv(10), [])) + 10 * 8
    cache = PrefixCache(3 * one, min_reuse_tokens=1)
    for i in range(10):
        cache.store(content([1000 + i] * 10), *kv(10))
        assert cache.stats().bytes <= 3 * one
    stats = cache.stats()
    assert stats.entries == 3 and stats.evictions == 7
    assert cache.match(content([1009] * 10 + [1]))[1] == 10  # the newest stay
    assert cache.match(content([1000] * 10 + [1]))[0] is None  # the oldest went
    cache.store(content([5] * 40), *kv(40))  # larger than the whole bound: not kept, nothing evicted for it
    assert cache.stats().too_large == 1 and cache.stats().entries == 3
    cache.put_vision("x", CachedVision(torch.zeros(10, 4), (torch.zeros(10, 4),)))
    assert cache.stats().bytes <= 3 * one and cache.vision(["x"]) is not None and cache.vision(["x", "y"]) is None


def test_threads_share_one_cache_within_its_bound() -> None:
    capacity = 200_000
    cache = PrefixCache(capacity, min_reuse_tokens=2)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(200):
            n = rng.randint(4, 40)
            prompt = content([rng.randint(0, 5)] * 3, [rng.randint(0, 50) for _ in range(n)])
            if rng.random() < 0.5:
                cache.store(prompt, *kv(prompt.numel()))
            else:
                entry, reused = cache.match(prompt)
                if entry is not None and not (0 < reused < prompt.numel() and entry.keys[0].shape[2] >= reused):
                    errors.append(f"bad match {reused} of {prompt.numel()}")
            key = str(rng.randint(0, 30))
            cache.put_vision(key, CachedVision(torch.zeros(rng.randint(1, 200), 16), ()))
            cache.vision([key])
            if cache.stats().bytes > capacity:
                errors.append("over the bound")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    stats = cache.stats()
    held = sum(entry.nbytes for entry in cache._entries.values())
    assert stats.bytes == held <= capacity and stats.entries == len(cache._entries) and stats.evictions > 0


# ---- the plan and the CLI ---------------------------------------------------------------------------------------
def test_the_plan_counts_the_prefix_cache(checkpoints: dict[str, Path], capsys) -> None:
    from vismmoe_edge.checkpoint_info import inspect_checkpoint
    from vismmoe_edge.cli.plan import plan_command
    from vismmoe_edge.errors import VismmoeError
    from vismmoe_edge.hardware.profiles import get_profile
    from vismmoe_edge.options import parse_prefix_cache
    from vismmoe_edge.planning.memory_plan import default_prefix_cache_bytes, runtime_parts
    from vismmoe_edge.planning.plan import format_plan, make_plan

    info = inspect_checkpoint(checkpoints["v5"])
    default = default_prefix_cache_bytes(info, 4096, info.stored_dtype.itemsize)
    assert default == runtime_parts(info, device="cpu").prefix_cache_bytes > 0
    s_layer = info.catalogue.num_experts * info.catalogue.expert_bytes
    m_e = 3 * s_layer  # what is left for experts once every other part, the prefix cache included, is counted
    for bound in (None, 0, 1 << 20):
        others = runtime_parts(info, device="cpu", prefix_cache_bytes=bound).total_bytes
        plan = make_plan(info, get_profile("cpu"), mem_available=others + m_e, c_safe=0, cgroup=None,
                         prefix_cache_bytes=bound)  # fmt: skip
        assert plan.memory_budget_bytes == m_e  # the prefix cache came out of M_avail before the experts
        assert (
            plan.prefix_cache_bytes == plan.memory_parts["prefix_cache_bytes"] == (default if bound is None else bound)
        )
        assert plan.memory_parts["total_bytes"] <= plan.m_avail_bytes
    assert "prefix cache    1.00 MiB" in format_plan(plan)
    assert parse_prefix_cache("auto") is None and parse_prefix_cache("off") == 0 and parse_prefix_cache("2KiB") == 2048
    for bad in ("lots", "-5", "0.0001"):
        with pytest.raises(VismmoeError, match="--prefix-cache-bytes"):
            parse_prefix_cache(bad)
    with pytest.raises(typer.Exit):
        plan_command(checkpoints["v5"], profile="cpu", prefix_cache_bytes="big")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prefix-cache-bytes 'big'" in err


def test_run_answers_several_questions_reusing_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several --prompt: the later questions reuse the first's prefill, their prefill is compiled (where it
    compiles: CUDA) before the first is timed, and they give a cold run's tokens."""
    from typer.testing import CliRunner

    import vismmoe_edge.serve.warmup as warmup
    from vismmoe_edge.cli import app

    warmed = []
    real_warm = warmup.warm_suffix_graphs
    monkeypatch.setattr(warmup, "warm_suffix_graphs", lambda engine: warmed.append(real_warm(engine)))
    questions = ["What colour is the circle?", "How many shapes are there?"]
    args = ["run", "--device", "cpu", "--max-new-tokens", "4", "--json"]
    result = CliRunner().invoke(app, [*args, "--prompt", questions[0], "--prompt", questions[1]])
    assert result.exit_code == 0, result.output
    assert warmed == [None]  # called once; the CPU compiles nothing
    report = json.loads(result.stdout.strip().splitlines()[-1])
    first, second = report["answers"]
    assert [first["question"], second["question"]] == questions
    assert first["timings"]["prefix_reused_tokens"] == 0 and second["timings"]["prefix_reused_tokens"] > 64
    assert second["ttft_s"] == second["timings"]["prefill_s"] > 0 and report["prefix_cache"]["prefix_hits"] == 1
    cold = CliRunner().invoke(app, [*args, "--prompt", questions[1], "--prefix-cache-bytes", "0"])
    assert cold.exit_code == 0, cold.output
    assert json.loads(cold.stdout.strip().splitlines()[-1])["token_ids"] == second["token_ids"]
    both = CliRunner().invoke(app, ["run", "--prompt", "a", "--prompt", "b", "--prompt-file", "x.txt"])
    assert both.exit_code == 2 and "not both" in both.output


def test_image_keys_follow_pixels_and_processor_settings(checkpoints: dict[str, Path], images: list[Path]) -> None:
    from PIL import Image

    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget="100%", device="cpu")
    engine.prefix_cache = PrefixCache(64 << 20, salt="test")
    key = engine.encode("Q?", [images[0]]).image_keys
    same = Image.open(images[0]).convert("RGB")
    assert engine.encode("Another question?", [same]).image_keys == key  # the pixels, not the file or prompt
    assert engine.encode("Q?", [Image.eval(same, lambda v: v ^ 1)]).image_keys != key
    engine.processor.image_processor.size.longest_edge = 128 * 128
    assert engine.encode("Q?", [images[0]]).image_keys != key  # another resize bound: other visual tokens
    # inputs built without the engine's encode are keyed by their processor patches, and reuse as well
    first, second = (engine.encode(q, [images[0]]) for q, _ in QUESTIONS.values())
    first.image_keys = second.image_keys = None
    engine.generate_from_inputs(first, greedy())
    assert engine.generate_from_inputs(second, greedy()).timings.prefix_reused_tokens > 16


def test_prompts_with_video_placeholders_never_reuse(checkpoints: dict[str, Path]) -> None:
    """Video placeholders are not content-addressed: such a prompt neither reuses nor keeps KV (text-only
    prompts, which do, as the control)."""
    from vismmoe_edge.loader import load

    engine = load(checkpoints["v5"], memory_budget="100%", device="cpu")
    engine.prefix_cache = PrefixCache(64 << 20, salt="test")
    video = engine.model.config.video_token_id
    text = "Describe the scene in front of the robot in every detail you can. " * 3
    plain = [engine.encode(text + q) for q in ("Left?", "Right?")]
    assert [engine.generate_from_inputs(i, greedy()).timings.prefix_reused_tokens > 16 for i in plain] == [False, True]
    engine.prefix_cache.clear()
    for inputs in plain:
        inputs.input_ids = torch.cat([torch.full((1, 1), video), inputs.input_ids], dim=1)
    assert [engine.generate_from_inputs(i, greedy()).timings.prefix_reused_tokens for i in plain] == [0, 0]
    assert engine.prefix_cache.stats().entries == 0
