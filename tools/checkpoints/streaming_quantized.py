#!/usr/bin/env python3
"""Write a random Qwen3-VL-30B-A3B-sized checkpoint straight in our quantized format, never its bf16 weights.

`quantize --bits 4 --dense-bits N` of a 62 GB bf16 checkpoint needs the 62 GB first. This tool makes each weight
when the converter asks for it and quantizes it at once, so the disk holds only the ~17 GB (dense int4) or
~18 GB (dense int8) result and RAM one tensor (or one expert) at a time:

1. a skeleton directory (hidden, beside OUT): config.json of the full geometry (48 layers of 128 experts, top-8,
   hidden 2048, 32/4 heads of 128, vocabulary 151,936, the real vision tower: synthetic_qwen3_vl_moe.synthetic_config
   with `vision="real"`), generation config, the offline processor (patch 16, merge 2, up to
   `PROXY_MAX_PIXELS`) and sparse shards whose headers name every tensor (header_only.write_header_only), so
   the converter plans exactly as for a downloaded model;
2. the converter's own plan and writer (vismmoe_edge.quant.convert: record layout, dense choices, shards, index,
   config.json with its quantization_config), reading a `GeneratedSource`: each read is answered by a seeded
   generator instead of the sparse file;
3. VISMMOE_SYNTHETIC.json in OUT, and the skeleton removed.

The weights follow synthetic_qwen3_vl_moe's rules (linears N(0, 0.02), norms 1, biases 0, embeddings N(0, 4.0),
routers N(0, 0.3): near-uniform, sampled-like routing on random tokens; lm_head rows of tokens the offline
tokenizer lacks are zero), drawn per tensor from a generator seeded by (seed, name) and rounded to bf16 as a
downloaded checkpoint would be; every dense weight then goes through the converter's quantizer. The routed experts
(29 GB of bf16 for the full model, 94% of it) are by default drawn **as int4 codes**: uniform codes 0..15 with one
scale per group chosen so that the weights' standard deviation is `expert_std` (zero-centred), encoded by the
converter's own record encoder (encode_expert with int4 groups, the path AWQ / W4A16 sources take). That is 5x
faster than drawing N(0, expert_std) and quantizing it (`--quantize-experts`: ~0.4 s per expert on one core here,
~45 min for 6,144) and changes only the weights' values, not the bytes, the layout or the routing. The outputs are
meaningless either way.

CLI:  nice -n 10 python tools/checkpoints/streaming_quantized.py $BENCH_DATA/qwen3vl-30b-a3b-int4-dense4 \\
          --dense-bits 4                                           # ~17 GB; --layers 2 for a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

for _root in Path(__file__).resolve().parents[2:0:-1]:  # the repository, then tools/
    if str(_root) not in sys.path:
        sys.path.insert(0, str(_root))

from checkpoints.header_only import write_header_only  # noqa: E402
from checkpoints.synthetic_qwen3_vl_moe import (  # noqa: E402
    _EMBED_STD,
    _LINEAR_STD,
    MARKER_NAME,
    _generator,
    _normal,
    synthetic_config,
)

from vismmoe_edge.checkpoint import TensorInfo  # noqa: E402
from vismmoe_edge.quant.quantize import Int4Groups  # noqa: E402
from vismmoe_edge.quant.record import ExpertSpec, encode_expert  # noqa: E402
from vismmoe_edge.quant.source import SourceCheckpoint  # noqa: E402

VOCAB = 151936  # Qwen3-VL-30B-A3B's vocabulary (its lm_head and embedding sizes)
PROXY_MAX_PIXELS = 1280 * 32 * 32  # up to 1,280 merged visual tokens (a 1088x1024 image gives 1,088)
PROXY_MIN_PIXELS = 32 * 32 * 4
_UNIFORM_CODE_STD = (255 / 12) ** 0.5  # standard deviation of codes drawn uniformly from 0..15


class GeneratedSource(SourceCheckpoint):
    """A skeleton checkpoint (real headers, sparse data) whose tensors are made on read, seeded by name."""

    def __init__(self, directory: Path, *, seed: int, router_std: float, expert_std: float, embed_std: float,
                 zero_lm_head_rows: list[int]) -> None:  # fmt: skip
        super().__init__(directory)
        self.seed, self.router_std, self.expert_std, self.embed_std = seed, router_std, expert_std, embed_std
        self.zero_rows = torch.tensor(zero_lm_head_rows, dtype=torch.long)

    def std_of(self, name: str) -> float | None:
        """The weight's N(0, std), or None for a 1-D norm/bias (ones/zeros)."""
        if ".mlp.experts." in name:
            return self.expert_std
        if name.endswith(".mlp.gate.weight"):
            return self.router_std
        if name.endswith("embed_tokens.weight"):
            return self.embed_std
        return None if len(self.logical[name].shape) == 1 else _LINEAR_STD

    def _part(self, info: TensorInfo, index: int | None) -> torch.Tensor:
        shape = tuple(info.shape) if index is None else tuple(info.shape[1:])
        std = self.std_of(info.name)
        if std is None:
            fill = torch.ones if info.name.endswith("norm.weight") else torch.zeros
            return fill(shape, dtype=torch.bfloat16)
        key = info.name if index is None else f"{info.name}[{index}]"
        t = _normal(shape, std, torch.bfloat16, _generator(self.seed, key))
        if info.name == "lm_head.weight":
            t[self.zero_rows] = 0
        return t


def int4_groups(shape: tuple[int, int], std: float, group_size: int, g: torch.Generator) -> Int4Groups:
    """Uniform int4 codes of one [N, K] matrix, scaled so that W = (codes - 8) * scale + zero has mean 0, std `std`."""
    n, k = shape
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.full((n, k // group_size), std / _UNIFORM_CODE_STD).bfloat16().float()
    return Int4Groups(codes, scale, (0.5 * scale).bfloat16().float(), group_size)


def generated_int4_expert_units(units: list, spec: ExpertSpec, *, seed: int, expert_std: float) -> None:
    """Replace, in place, how each routed expert's record is made: int4 codes drawn directly (int4_groups)."""
    hidden, inter = spec.hidden, spec.inter
    for unit in units:
        first = unit.entries[0].name
        if ".mlp.experts." not in first:
            continue
        prefix, expert = first.rsplit(".", 2)[0].rsplit(".", 1)  # {prefix}.{e}.{field}

        def make(key: str = f"{prefix}[{expert}]") -> list[torch.Tensor]:
            g = _generator(seed, key)
            gate_up = int4_groups((2 * inter, hidden), expert_std, spec.quant.group_size, g)
            down = int4_groups((hidden, inter), expert_std, spec.quant.group_size, g)
            return encode_expert(spec, gate_up, down)

        unit.make = make


def write_quantized(skeleton: Path, out: Path, source: GeneratedSource, *, dense_bits: int, layout: str,
                    quantize_experts: bool, progress: bool) -> None:  # fmt: skip
    """quant.convert.quantize_checkpoint's steps on `source`, with the experts drawn as int4 unless
    `quantize_experts` (then it is quantize_checkpoint itself)."""
    from vismmoe_edge.conversion import float_catalogue, linear_weights, quantize_checkpoint
    from vismmoe_edge.quant import convert

    if quantize_experts:
        quantize_checkpoint(skeleton, out, 4, progress=progress, layout=layout, dense_bits=dense_bits, source=source)
        return
    layout = convert.resolve_layout(4, layout)
    spec, units = convert._plan(source, float_catalogue, 4, None, layout, dense_bits, linear_weights)
    generated_int4_expert_units(units, spec, seed=source.seed, expert_std=source.expert_std)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        convert._write(tmp, units, convert.parse_size(convert.DEFAULT_MAX_SHARD), progress)
        convert._copy_extra_files(skeleton, tmp)
        quant = spec.quant.to_dict()
        config = source.config | {"quantization_config": quant}
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # last, as the converter does
        tmp.chmod(0o755)
        os.replace(tmp, out)
    finally:
        source.close()
        shutil.rmtree(tmp, ignore_errors=True)


def build(
    out: Path,
    *,
    dense_bits: int,
    layers: int = 48,
    experts: int = 128,
    seed: int = 0,
    router_std: float = 0.3,
    expert_std: float = 0.02,
    embed_std: float = _EMBED_STD,
    layout: str = "auto",
    quantize_experts: bool = False,
    progress: bool = True,
    vision: str = "real",
    vocab: int = VOCAB,
    **text: int,
) -> Path:
    """Write the quantized proxy checkpoint to `out` (must not exist) and return it. `vision="tiny"`, `vocab` and
    `text` (synthetic_config's hidden, heads, kv_heads, head_dim, top_k, moe_intermediate) shrink it for tests."""
    from transformers import GenerationConfig

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_offline_processor

    out = Path(out).expanduser().absolute()
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or pick another directory")
    processor = build_offline_processor(min_pixels=PROXY_MIN_PIXELS, max_pixels=PROXY_MAX_PIXELS)
    tok = processor.tokenizer
    text = {"dense_intermediate": 6144} | text
    config = synthetic_config(tokenizer=tok, layers=layers, experts=experts, vocab=vocab, vision=vision, **text)
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    config.dtype = torch.bfloat16
    config.get_text_config().dtype = torch.bfloat16
    special = tok.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    )
    zero_rows = sorted(set(special) | set(range(len(tok), vocab)))
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    skeleton = Path(tempfile.mkdtemp(prefix=f".{out.name}.skeleton-", dir=out.parent)) / "src"
    try:
        write_header_only(skeleton, config.to_dict())
        config.save_pretrained(skeleton)  # transformers' own serialisation, as the real checkpoint has
        GenerationConfig(bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                         eos_token_id=tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]),
                         pad_token_id=tok.pad_token_id, do_sample=False).save_pretrained(skeleton)  # fmt: skip
        processor.save_pretrained(skeleton)
        source = GeneratedSource(skeleton, seed=seed, router_std=router_std, expert_std=expert_std,
                                 embed_std=embed_std, zero_lm_head_rows=zero_rows)  # fmt: skip
        write_quantized(skeleton, out, source, dense_bits=dense_bits, layout=layout,
                        quantize_experts=quantize_experts, progress=progress)  # fmt: skip
    finally:
        shutil.rmtree(skeleton.parent, ignore_errors=True)
    shards = sorted(out.glob("*.safetensors"))
    marker = {
        "synthetic": True,
        "random_weights": True,
        "builder": "tools/checkpoints/streaming_quantized.py",
        "params": {"layers": layers, "num_experts": experts, "vocab": vocab, "vision": vision, "bits": 4, **text,
                   "dense_bits": dense_bits, "layout": layout,
                   "experts": "quantized from N(0, expert_std)" if quantize_experts else "drawn as int4 codes",
                   "seed": seed, "router_std": router_std,
                   "expert_std": expert_std, "embed_std": embed_std, "linear_std": _LINEAR_STD},
        "bytes_on_disk": sum(p.stat().st_size for p in shards),
        "build_seconds": round(time.perf_counter() - started, 1),
        "note": "Random weights for benchmarks and tests: the model's outputs are meaningless.",
    }  # fmt: skip
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--dense-bits", type=int, choices=(4, 8), required=True)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", default="auto", help="int4 layout (auto: this CPU's kernel tiles; rowmajor for CUDA)")
    p.add_argument(
        "--quantize-experts",
        action="store_true",
        help="draw the experts in bf16 and quantize them (5x slower) instead of drawing int4 codes",
    )
    a = p.parse_args(argv)
    if a.out.exists():
        p.error(f"{a.out} exists; remove it or pick another directory")
    free = shutil.disk_usage(a.out.expanduser().absolute().parent if a.out.parent.exists() else Path.cwd()).free
    print(f"free space: {free / 1e9:.1f} GB", file=sys.stderr)
    out = build(
        a.out,
        dense_bits=a.dense_bits,
        layers=a.layers,
        experts=a.experts,
        seed=a.seed,
        layout=a.layout,
        quantize_experts=a.quantize_experts,
    )
    print(json.dumps(json.loads((out / MARKER_NAME).read_text()), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
