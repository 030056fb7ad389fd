#!/usr/bin/env python3
"""GPU check of the prefix cache (issue 26): the second question about one image, its prefix's KV reused, against
the same question prefilled cold in the same engine, under the near-tie rule of tests/hf_reference.py.

On the CPU the two are bit-identical (tests/test_prefix_cache.py). On CUDA the reused KV was computed in a prefill
of another length, so GEMMs of other shapes may round it differently: a differing greedy token is accepted only
where the cold run's top-2 logit margin is below the largest logit difference between the two, both
teacher-forced on the cold run's tokens; both numbers are reported. Runs on a tiny bf16 checkpoint and, with
--model, on any checkpoint (the 48-layer 30B-A3B geometry of tools/bench/discrete.py). On CUDA with every
expert resident it also times the second question's prefill against its captured graph's replay alone
(`second_question_timing`): how much of it is the graph, how much the host and the copies around it.
    python3 tools/device/prefix_cache_checks.py --out $OUT/prefix_cache_checks.json [--model DIR --image IMG]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from checks import Checks  # noqa: E402

from tests.hf_reference import near_tie_divergence  # noqa: E402

FIRST = "What colour is the circle?"
SECOND = "How many shapes are there?"
NEW_TOKENS = 12
LOGIT_TOLERANCE = 1.0  # a larger difference is a wrong KV, not rounding, whatever the margin


def forced_logits(engine, inputs, tokens: list[int], *, use_cache: bool) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Per-step logits fed `tokens` after the prompt (the prefix cache read, or not)."""
    logits, state = engine.prefill(inputs, use_cache=use_cache)
    engine.start_decode(state, len(tokens))
    steps = [logits.float().cpu()]
    for token in tokens[:-1]:
        steps.append(engine.decode_step(token, state).float().cpu())
    return steps


def second_question(model_dir: Path, images: list[Path], device: str, budget: str, warm_suffix: bool = False) -> dict:
    import vismmoe_edge
    from vismmoe_edge.prefix_cache import PrefixCache
    from vismmoe_edge.sampling import SamplingConfig

    engine = vismmoe_edge.load(model_dir, memory_budget=budget, pinned_layers=1, device=device)
    engine.prefix_cache = PrefixCache(8 * 2**30, salt=f"{model_dir}|{engine.dtype}|{engine.device}")
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    out: dict = {"frames": []}
    if warm_suffix:  # as the daemon does before READY: the suffix layers then run the code compiled for any length
        out["suffix_graphs_warmed"] = engine.suffix_graphs.warm()
    ok = True
    for image in images:
        engine.generate_from_inputs(engine.encode(FIRST, [image]), sampling)  # keeps the image's prefix
        inputs = engine.encode(SECOND, [image])
        cold = engine.generate_from_inputs(inputs, sampling, use_cache=False).token_ids
        result = engine.generate_from_inputs(inputs, sampling)
        warm, reused = result.token_ids, result.timings.prefix_reused_tokens
        frame: dict = {"image": image.name, "reused_tokens": reused, "equal": warm == cold,
                       "suffix_graph_tokens": result.timings.suffix_graph_tokens,
                       "prefill_s": result.timings.prefill_s}  # fmt: skip
        ok &= reused > 0
        # every expert resident on CUDA: the question after the image runs as a replayed graph (suffix_graph.py)
        ok &= device != "cuda" or budget != "100%" or result.timings.suffix_graph_tokens > 0
        if warm != cold:
            reference = forced_logits(engine, inputs, cold, use_cache=False)
            ours = forced_logits(engine, inputs, cold, use_cache=True)
            divergence = near_tie_divergence(warm, cold, reference, ours)
            assert divergence is not None
            frame["divergence"] = divergence.describe()
            ok &= divergence.accepted and divergence.difference < LOGIT_TOLERANCE and device == "cuda"
        out["frames"].append(frame)
    if device == "cuda" and budget == "100%":
        try:  # a measurement: its failure is recorded, not a failed equivalence check
            out["second_question_timing"] = suffix_timing(engine, engine.encode(SECOND, [images[-1]]))
        except RuntimeError as e:
            out["second_question_timing"] = {"error": str(e)}
    engine.close()
    return {"ok": ok, **out}


def suffix_timing(engine, inputs, repeats: int = 10) -> dict:  # type: ignore[no-untyped-def]
    """Where the second question's time goes (medians of `repeats`): the whole prefill with its prefix reused
    (host work, KV copies, the replay, the first token's logits) against the captured graph's replay alone."""
    import statistics
    import time

    from vismmoe_edge.results import Timings

    walls = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        timings = Timings()
        logits, _ = engine.prefill(inputs, timings)
        logits.float().cpu()
        walls.append(time.perf_counter() - t0)
    graphs = [g for g in engine.suffix_graphs.graphs.values() if g.graph is not None]
    replays = []
    for graph in graphs[-1:]:  # the most recent shape: this question's
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(repeats):
            start.record()
            graph.graph.replay()
            end.record()
            end.synchronize()
            replays.append(start.elapsed_time(end) / 1e3)
    return {
        "prefill_reused_s": statistics.median(walls),
        "graph_replay_s": statistics.median(replays) if replays else None,
        "reused_tokens": timings.prefix_reused_tokens,
        "suffix_graph_tokens": timings.suffix_graph_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", type=Path, help="also check this checkpoint (every expert resident)")
    ap.add_argument("--image", type=Path, action="append", default=[], help="an image for --model (repeatable)")
    ap.add_argument("--warm", action="store_true", help="for --model: warm the suffix graphs first, as the daemon "
                    "does (the compiled attention then takes any length: the daemon's code)")  # fmt: skip
    args = ap.parse_args(argv)
    from igpu_checks import make_images

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    checks = Checks(needs_cuda=args.device == "cuda")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        images = make_images(tmp)
        tiny = build_tiny_checkpoint(tmp / "m", seed=5, dtype=torch.bfloat16, layout="hub", num_layers=8)
        for budget in ("100%", "25%"):
            checks.run(f"second question, tiny bf16, {budget}",
                       lambda budget=budget: second_question(tiny, images, args.device, budget))  # fmt: skip
        if args.model is not None:
            checks.run(f"second question, {args.model.name}",
                       lambda: second_question(args.model, args.image or images[:1], args.device, "100%",
                                               warm_suffix=args.warm))  # fmt: skip
    args.out.write_text(json.dumps(checks.results, indent=1))
    return 0 if all(r["status"] != "fail" for r in checks.results) else 1


if __name__ == "__main__":
    sys.exit(main())
