#!/usr/bin/env python3
"""GPU checks of quantized dense weights and of the Orin Nano plan forced through unified-slots, one JSON summary.

    python3 tools/device/orin_plan_checks.py --out $OUT/orin_plan.json            # ~5-7 min on an H200
    (or tools/device/orin_plan_h200.sh, which does the same under $OUT)

Checks (each on its own; a failure is recorded and the others still run; exit status 1 if any failed):
- dense on CUDA: a tiny Qwen3-VL-MoE (widths the int4 kernels take) quantized `--bits 4 --dense-bits 4|8`. The
  engine (attention and lm_head on tinygemm or int8, vision int8, embedding read by row) runs on the GPU with
  tiers gpu-slots and unified-slots, CUDA graphs on and off. It must match transformers on the dequantized file
  (bf16, CUDA): greedy tokens equal (a differing token only under the near-tie rule of tests/hf_reference.py,
  its margin and the teacher-forced logit difference recorded), and graphs on vs off logits within 1e-2.
- the Nano plan on the H200: the plan for the header-only 48-layer Qwen3-VL-30B-A3B on
  orin-nano-8gb-super--maxn-super with `--bits 4 --dense-bits 4` gives a pinned depth and the cache's share of the
  experts. A proxy with the real text dimensions, `--layers` decoder layers and the real vision tower is written
  straight as int4 experts + int4 dense weights in the CUDA (row-major) layout
  (tools/checkpoints/streaming_quantized.py, no bf16 copy). With `--layers 48` (the whole model) the proxy's own
  plan is used as it is; with fewer, the 48-layer plan's pinned depth and cache share. It runs through
  `--tier unified-slots --device cuda`: one 1088x1024 image (1,088 visual tokens) plus 16 sampled tokens. The
  record holds tok/s, expert bytes read per decoded token, hit rate and peak RSS. This is an H200, not an
  Orin: the rates say nothing about a board, but the plan's tier, budget and byte counts run end to end.
  `--build-only` builds the proxy under `--work` and stops (the 48-layer build can take a call of its own).
Without CUDA every check is reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from tests.hf_reference import near_tie_divergence, teacher_forced_logits  # noqa: E402
from tools.device.checks import Checks  # noqa: E402

NANO = "orin-nano-8gb-super--maxn-super"
PROMPTS = ["Tell me a story about the sea.", "What is red and blue?"]


def tiny_dense(root: Path, dense_bits: int) -> tuple[Path, Path]:
    from vismmoe_edge.conversion import dequantize_checkpoint, quantize_checkpoint
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    src = root / "src"
    if not (src / "config.json").exists():
        build_tiny_checkpoint(src, seed=5, dtype=torch.bfloat16, num_layers=8, moe_intermediate=96)
    # row-major int4 codes: what unified-slots reads on CUDA (the gpu tier takes any layout)
    q = quantize_checkpoint(src, root / f"dense{dense_bits}", 4, 32, progress=False, dense_bits=dense_bits,
                            layout="rowmajor")  # fmt: skip
    return q, dequantize_checkpoint(q, root / f"dense{dense_bits}-deq")


def check_dense_engine(root: Path, dense_bits: int) -> dict[str, Any]:
    from transformers import Qwen3VLMoeForConditionalGeneration

    import vismmoe_edge
    from vismmoe_edge.quant.dense import QuantizedLinear
    from vismmoe_edge.sampling import SamplingConfig

    q, deq = tiny_dense(root, dense_bits)
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(deq, dtype=torch.bfloat16, experts_implementation="eager")
    ref = ref.to("cuda").eval()
    out: dict[str, Any] = {}
    ok = True
    for tier in ("auto", "unified-slots"):
        engine = vismmoe_edge.load(q, memory_budget="25%", pinned_layers=1, device="cuda", tier=tier)
        head = engine.model.lm_head
        out[f"{tier} tier"] = engine.experts.pipeline.tier.name
        out[f"{tier} lm_head"] = f"{type(head).__name__} int{getattr(head, 'bits', '?')} {getattr(head, 'layout', '')}"
        ok &= isinstance(head, QuantizedLinear)
        logits: dict[bool, list[torch.Tensor]] = {}
        for graphs in (False, True):
            engine.cuda_graphs = graphs
            engine._decoders.clear()
            matches, firsts = [], []
            for prompt in PROMPTS:
                inputs = engine.encode(prompt)
                ids = inputs.input_ids.to("cuda")
                with torch.no_grad():
                    gen = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                       min_new_tokens=6, do_sample=False, output_logits=True,
                                       return_dict_in_generate=True)  # fmt: skip
                want = gen.sequences[0, inputs.num_tokens :].tolist()
                got = engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=6, min_new_tokens=6))
                if got.token_ids == want:
                    matches.append(True)
                else:  # the near-tie rule (tests/hf_reference.py): accepted only below the logit difference
                    forced = teacher_forced_logits(engine, inputs, want, static=engine.uses_static_decode())
                    d = near_tie_divergence(got.token_ids, want, [g[0].float().cpu() for g in gen.logits],
                                            [f.cpu() for f in forced])  # fmt: skip
                    matches.append(d.accepted)
                    out[f"{tier} graphs={graphs} {prompt!r}"] = d.describe()
                _, state = engine.prefill(inputs)
                if engine.uses_static_decode():
                    engine.start_decode(state, 2)
                firsts.append(engine.decode_step(got.token_ids[0], state).float().clone())
            out[f"{tier} graphs={graphs} tokens_match"] = matches
            logits[graphs] = firsts
            ok &= all(matches)
        diff = max((a - b).abs().max().item() for a, b in zip(logits[True], logits[False], strict=True))
        out[f"{tier} graphs on vs off max_abs_logit_diff"] = diff
        ok &= diff <= 1e-2
        engine.experts.pipeline.close()
    return out | {"ok": ok}


def nano_plan(work: Path) -> dict[str, Any]:
    from checkpoints.header_only import write_header_only

    from vismmoe_edge.hardware.gpu_access import ORIN_DOCUMENTED
    from vismmoe_edge.hardware.profiles import get_profile
    from vismmoe_edge.planning.plan import make_plan

    h30 = work / "qwen3-vl-30b-a3b-header-only"
    if not (h30 / "config.json").exists():
        write_header_only(h30)
    plan = make_plan(h30, get_profile(NANO), root=ROOT / "tests" / "fixtures" / "boards" / "x86-desktop",
                     cgroup=None, gpu=ORIN_DOCUMENTED, bits=4, dense_bits=4)  # fmt: skip
    return plan.as_dict()


def build_proxy(work: Path, layers: int) -> tuple[Path, float]:
    """The int4-expert, int4-dense proxy in the CUDA layout (row-major), written straight from generated weights
    (tools/checkpoints/streaming_quantized.py: Qwen3-VL-30B-A3B's text geometry with `layers` decoder layers, the
    real vision tower, vocabulary 151,936). Returns (path, seconds spent building; 0 when it was there)."""
    from checkpoints.streaming_quantized import build

    q = work / f"proxy-{layers}-int4-dense4-rowmajor"
    if (q / "config.json").exists():
        return q, 0.0
    t0 = time.perf_counter()
    build(q, dense_bits=4, layers=layers, layout="rowmajor", progress=False)
    return q, time.perf_counter() - t0


def check_nano_plan_on_h200(work: Path, layers: int, image: Path) -> dict[str, Any]:
    import vismmoe_edge
    from vismmoe_edge.sampling import SamplingConfig

    q, built = build_proxy(work, layers)
    if layers == 48:  # the full geometry: the plan of the proxy itself, its pinned depth and budget as they are
        from vismmoe_edge.hardware.gpu_access import ORIN_DOCUMENTED
        from vismmoe_edge.hardware.profiles import get_profile
        from vismmoe_edge.planning.plan import make_plan

        plan = make_plan(q, get_profile(NANO), root=ROOT / "tests" / "fixtures" / "boards" / "x86-desktop",
                         cgroup=None, gpu=ORIN_DOCUMENTED).as_dict()  # fmt: skip
        pinned, budget = plan["pinned_layers"], plan["memory_budget_bytes"]
    else:  # fewer layers: the 48-layer plan's pinned depth (capped) and cache share, scaled to them
        plan = nano_plan(work)
        pinned = min(plan["pinned_layers"], layers - 1)
        engine = vismmoe_edge.load(q, device="cuda", tier="unified-slots", memory_budget="100%", pinned_layers=0)
        total = engine.catalogue.expert_bytes * len(engine.catalogue.experts)
        engine.experts.pipeline.close()
        budget = pinned * (total // layers) + int(plan["cache_fraction"] * total)
    engine = vismmoe_edge.load(q, device="cuda", tier="unified-slots", memory_budget=str(budget),
                               pinned_layers=pinned)  # fmt: skip
    from PIL import Image

    picture = Image.open(image).convert("RGB").resize((1088, 1024))  # 34 x 32 = 1,088 visual tokens
    inputs = engine.encode("Describe the picture in detail.", [picture])
    sampling = SamplingConfig(max_new_tokens=16, min_new_tokens=16, temperature=0.7, top_p=0.9, seed=0)
    engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=2, min_new_tokens=2))  # warm-up
    before = engine.experts.pipeline.stats.bytes_read
    result = engine.generate_from_inputs(inputs, sampling)
    read = engine.experts.pipeline.stats.bytes_read - before
    return {
        "plan": {
            k: plan[k]
            for k in (
                "pinned_layers",
                "cache_fraction",
                "resident_bytes",
                "memory_budget_bytes",
                "m_avail_bytes",
                "device",
                "tier",
            )
        },  # fmt: skip
        "proxy_layers": layers,
        "build_s": round(built, 1),
        "budget_bytes": budget,
        "pinned_layers": pinned,
        "tier": engine.experts.pipeline.tier.name,
        "prompt_tokens": inputs.num_tokens,
        "timings": result.timings.as_dict(),
        "expert_bytes_read_per_generated_token": read / max(len(result.token_ids), 1),
        "experts": result.experts,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "ok": len(result.token_ids) == 16,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON summary here")
    ap.add_argument("--work", type=Path, help="where to build checkpoints (default: a temp dir)")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the synthetic proxy (48: the model)")
    ap.add_argument("--skip-proxy", action="store_true", help="only the dense-weight checks")
    ap.add_argument("--build-only", action="store_true",
                    help="only build the proxy checkpoint under --work (a separate call where the build is long)")
    args = ap.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="orin-plan-checks-"))
    work.mkdir(parents=True, exist_ok=True)
    from vismmoe_edge.evaluation.sample import ensure_sample_image

    if args.build_only:
        q, seconds = build_proxy(work, args.layers)
        print(json.dumps({"proxy": str(q), "build_s": round(seconds, 1)}))
        return 0

    checks = Checks()
    start = time.perf_counter()
    for bits in (4, 8):
        checks.run(f"cuda dense int{bits} vs transformers (tiers, graphs on/off)",
                   lambda b=bits: check_dense_engine(work / "tiny", b))  # fmt: skip
    if not args.skip_proxy:
        checks.run(f"nano plan through unified-slots on this GPU ({args.layers} layers)",
                   lambda: check_nano_plan_on_h200(work, args.layers, ensure_sample_image()))  # fmt: skip
    counts = {s: sum(r["status"] == s for r in checks.results) for s in ("pass", "fail", "skipped")}
    summary = {"seconds": round(time.perf_counter() - start, 1), "checks": checks.results, "counts": counts}
    print(json.dumps(counts))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
