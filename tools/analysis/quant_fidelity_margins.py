#!/usr/bin/env python3
"""How far the quantized engine is from transformers on the dequantized file, and how far that file is from its
float source: the margins behind LOGIT_ATOL (tests/hf_reference.py, docs/quantization.md section 7.3).

    python tools/analysis/quant_fidelity_margins.py [--work /tmp/qfm]

Tiny Qwen3-VL-MoE (10 layers, moe_intermediate 96), int4 g32 and int8; host and unified tiers, 100% and 25%.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import vismmoe_edge  # noqa: E402
from tests.hf_reference import assert_matches, hf_references  # noqa: E402
from vismmoe_edge.conversion import (
    dequantize_checkpoint,  # noqa: E402
    quantize_checkpoint,  # noqa: E402
)


def images(root: Path) -> list[Path]:
    """The two pictures of tests/conftest.py."""
    paths = []
    for i, (w, h) in enumerate([(224, 160), (128, 192)]):
        img = Image.new("RGB", (w, h), (30 + 100 * i, 120, 200 - 80 * i))
        draw = ImageDraw.Draw(img)
        draw.ellipse((10, 10, 10 + w // 3, 10 + h // 3), fill=(220, 30, 30))
        draw.rectangle((w // 2, h // 2, w - 8, h - 8), fill=(20, 20, 220))
        paths.append(root / f"img{i}.png")
        img.save(paths[-1])
    return paths


def main() -> None:
    from transformers import Qwen3VLMoeForConditionalGeneration

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/qfm"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    pictures = images(args.work)
    src = build_tiny_checkpoint(args.work / "src", seed=7, num_layers=10, moe_intermediate=96)
    hf_src = Qwen3VLMoeForConditionalGeneration.from_pretrained(src, experts_implementation="eager").eval()
    for bits, group in ((4, 32), (8, None)):
        q = quantize_checkpoint(src, args.work / f"int{bits}", bits, group, progress=False)
        hf = Qwen3VLMoeForConditionalGeneration.from_pretrained(
            dequantize_checkpoint(q, args.work / f"int{bits}-deq"), experts_implementation="eager"
        ).eval()
        encode = vismmoe_edge.load(q, device="cpu").encode
        refs, src_refs = hf_references(hf, encode, pictures), hf_references(hf_src, encode, pictures)
        for tier in ("host", "unified"):
            for budget in ("100%", "25%"):
                engine = vismmoe_edge.load(q, memory_budget=budget, pinned_layers=int(budget == "25%"), tier=tier,
                                           device="cpu")  # fmt: skip
                worst = assert_matches(engine, refs, atol=1.0)
                print(f"int{bits} {tier} {budget}: engine vs transformers on the dequantized file: {worst:.2e}")
        pairs = [(a, b) for n in refs for a, b in zip(refs[n].logits, src_refs[n].logits, strict=True)]
        quant_err = max((a - b).abs().max().item() for a, b in pairs)
        same = sum(refs[n].tokens == src_refs[n].tokens for n in refs)
        span = max(step.abs().max().item() for n in refs for step in refs[n].logits)
        print(f"int{bits}: dequantized file vs float source (transformers both): {quant_err:.3g}; same tokens on "
              f"{same}/{len(refs)} prompts; logits span +-{span:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
