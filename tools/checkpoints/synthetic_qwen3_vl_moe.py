#!/usr/bin/env python3
"""Write a random Qwen3-VL-MoE checkpoint with real expert sizes, shard by shard, without the model in RAM.

The result is a Hugging Face model directory that `transformers` and `vismmoe_edge.load` read like a downloaded
one: `config.json` (architectures `Qwen3VLMoeForConditionalGeneration`), `generation_config.json`,
`model.safetensors.index.json` + `model-0000k-of-0000n.safetensors` shards, and the offline processor/tokenizer
(`vismmoe_edge.processor.build_offline_processor`) saved beside them, plus `VISMMOE_SYNTHETIC.json` recording how
it was made.

How it is built (peak RAM ~ one shard, <= `shard_bytes`, plus ~100 MB):
- Parameter names and shapes come from the real class: `Qwen3VLMoeForConditionalGeneration(config)` instantiated
  on the meta device (no memory).
- The vision tower is small (demo.tiny_config's: depth 4, hidden 64) with `out_hidden_size` = text hidden; its
  weights are the real class's own initialisation (`Qwen3VLMoeVisionModel._from_config`).
- Text weights are drawn per tensor from a generator seeded by (seed, tensor name), so any tensor is
  reproducible on its own: linear layers N(0, 0.02); RMSNorm weights 1; embeddings N(0, `embed_std` = 4.0) so
  the current token, not the context average, steers every layer's routing; routers N(0, `router_std`) so
  routing is decisive; routed experts N(0, `expert_std`) in bf16 (or `dtype`), in the transformers-5 layout
  `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]` (or the hub layout `[E, H, 2I]` / `[E, I, H]` with
  `layout="hub"`). lm_head rows of tokens the offline tokenizer lacks (ids >= len(tokenizer)) and of the vision
  special tokens are zero so that greedy decoding only emits decodable text tokens; every row is still stored
  and read like a real lm_head. `routing_stats()` measures the resulting routing locality.
- Tensors are packed greedily in model order (vision, embeddings, layer 0, ..., norm, lm_head) into shards of at
  most `shard_bytes`; each shard is materialised alone and written with `safetensors.torch.save_file`.
- The directory is written as `.NAME.partial` beside `out_dir` and renamed into place at the end.

CLI:  python tools/checkpoints/synthetic_qwen3_vl_moe.py $BENCH_DATA/qwen3vl-30b-a3b-8layer   # 8 layers, ~9.7 GB
      python tools/checkpoints/synthetic_qwen3_vl_moe.py /tmp/tiny --layers 2 --experts 16               # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
MARKER_NAME = "VISMMOE_SYNTHETIC.json"
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}
_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "BOOL": 1}
# Token embeddings N(0, 4.0): large enough that the current token, not the attention average over the context,
# dominates every layer's residual stream, so routing on random tokens is close to uniform (~6-8% of a token's
# experts shared with the previous token in all 8 layers, 121-128 of 128 experts used by 64 tokens). With the
# demo's 0.2, layers 2-7 collapsed onto 32-40 experts with 62-76% overlap (measured with routing_stats()).
_EMBED_STD = 4.0
_LINEAR_STD = 0.02
# Generated in chunks of this many float32 elements (~64 MiB) so the temporary never dwarfs the output.
_CHUNK_ELEMS = 16 << 20
VISION_TOWERS = ("tiny", "real")


def real_vision_config(out_hidden: int) -> dict[str, object]:
    """Qwen3-VL-30B-A3B's vision tower (the hub's config.json, as tools/checkpoints/header_only.py records it)."""
    from checkpoints.header_only import QWEN3_VL_30B_A3B

    vision = {k: v for k, v in QWEN3_VL_30B_A3B["vision_config"].items() if k != "model_type"}
    return vision | {"out_hidden_size": out_hidden}


def synthetic_config(
    *,
    tokenizer: object,
    layers: int = 8,
    hidden: int = 2048,
    heads: int = 32,
    kv_heads: int = 4,
    head_dim: int = 128,
    experts: int = 128,
    top_k: int = 8,
    moe_intermediate: int = 768,
    vocab: int = 32000,
    dense_intermediate: int | None = None,
    vision: str = "tiny",
):
    """A Qwen3-VL-MoE config with Qwen3-VL-30B-A3B's text dimensions (defaults) and demo.tiny_config's vision tower
    (`vision="tiny"`) or Qwen3-VL-30B-A3B's own (`vision="real"`: depth 27, hidden 1152, MLP 4304, 16 heads,
    DeepStack after blocks 8/16/24; header_only.QWEN3_VL_30B_A3B), projecting to `hidden`.

    Built through `vismmoe_edge.demo.tiny_config`, so special token ids come from `tokenizer` the same way.
    """
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import tiny_config

    if vision not in VISION_TOWERS:
        raise ValueError(f"vision={vision!r}: pick one of {', '.join(VISION_TOWERS)}")
    if head_dim % 2 or (head_dim // 2) < 3:
        raise ValueError(f"head_dim={head_dim} must be even and >= 6")
    half = head_dim // 2
    # Qwen3-VL-30B-A3B uses [24, 20, 20] for head_dim 128; scale the same split to other head dims.
    t = round(half * 24 / 64)
    h = (half - t) // 2
    mrope = [t, h, half - t - h]
    return tiny_config(
        num_layers=layers,
        num_experts=experts,
        top_k=top_k,
        hidden=hidden,
        moe_intermediate=moe_intermediate,
        vocab_size=vocab,
        tokenizer=tokenizer,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=dense_intermediate if dense_intermediate is not None else 3 * hidden,
        vision_overrides=None if vision == "tiny" else real_vision_config(hidden),
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
    )


@dataclass
class _Spec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)


def _normal(shape: tuple[int, ...], std: float, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """N(0, std) in `dtype`, generated in float32 chunks along dim 0 (low peak memory for big expert tensors)."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(shape[0], -1) if len(shape) > 1 else out.view(-1, 1)
    row = flat.shape[1]
    step = max(1, _CHUNK_ELEMS // max(row, 1))
    for i in range(0, flat.shape[0], step):
        rows = min(step, flat.shape[0] - i)
        tmp = torch.randn((rows, row), generator=g, dtype=torch.float32)
        flat[i : i + rows].copy_(tmp.mul_(std))
    return out


def _plan(
    config: object,
    *,
    dtype: torch.dtype,
    seed: int,
    router_std: float,
    expert_std: float,
    layout: str,
    zero_lm_head_rows: list[int],
    embed_std: float = _EMBED_STD,
) -> list[_Spec]:
    """Every tensor of the checkpoint, in model order, with a closure that makes its data."""
    from transformers import Qwen3VLMoeForConditionalGeneration
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    with torch.device("meta"):
        meta = Qwen3VLMoeForConditionalGeneration(config)
    params = [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
    del meta

    vision_state: dict[str, torch.Tensor] = {}

    def vision_tensor(key: str) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            if not vision_state:  # the tower is tiny: build it once, with the real class's initialisation
                torch.manual_seed(seed)
                tower = Qwen3VLMoeVisionModel._from_config(config.vision_config)
                vision_state.update({k: v.detach().to(dtype).contiguous() for k, v in tower.state_dict().items()})
            return vision_state[key]

        return make

    specs: list[_Spec] = []
    for name, shape in params:
        if name.startswith("model.visual."):
            specs.append(_Spec(name, shape, dtype, vision_tensor(name.removeprefix("model.visual."))))
            continue
        g_name = name
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            if layout == "hub":
                shape = (shape[0], shape[2], shape[1])
            specs.append(_Spec(name, shape, dtype, _maker(shape, expert_std, dtype, seed, g_name)))
        elif name.endswith(".mlp.gate.weight"):
            specs.append(_Spec(name, shape, dtype, _maker(shape, router_std, dtype, seed, g_name)))
        elif name.endswith("embed_tokens.weight"):
            specs.append(_Spec(name, shape, dtype, _maker(shape, embed_std, dtype, seed, g_name)))
        elif name == "lm_head.weight":
            specs.append(_Spec(name, shape, dtype, _maker(shape, _LINEAR_STD, dtype, seed, g_name, zero_lm_head_rows)))
        elif len(shape) == 1 and name.endswith("norm.weight"):
            specs.append(_Spec(name, shape, dtype, lambda s=shape: torch.ones(s, dtype=dtype)))
        elif len(shape) == 1:
            specs.append(_Spec(name, shape, dtype, lambda s=shape: torch.zeros(s, dtype=dtype)))
        else:
            specs.append(_Spec(name, shape, dtype, _maker(shape, _LINEAR_STD, dtype, seed, g_name)))
    return specs


def _maker(
    shape: tuple[int, ...], std: float, dtype: torch.dtype, seed: int, name: str, zero_rows: list[int] | None = None
) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        t = _normal(shape, std, dtype, _generator(seed, name))
        if zero_rows:
            t[torch.tensor(zero_rows, dtype=torch.long)] = 0
        return t

    return make


def _pack(specs: list[_Spec], shard_bytes: int) -> list[list[_Spec]]:
    shards: list[list[_Spec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_checkpoint(
    out_dir: Path,
    specs: list[_Spec],
    *,
    shard_bytes: int,
    experts_total: int,
    marker: dict[str, object],
    write_extra: Callable[[Path], None],
    progress: bool | None,
) -> Path:
    """Write `specs` as shards + index into `.NAME.partial` beside `out_dir`, one shard in memory at a time; let
    `write_extra(dir)` add config, generation config and processor; add the marker with byte totals; rename the
    directory into place (replacing an old one)."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    shards = _pack(specs, shard_bytes)
    n = len(shards)
    total = sum(s.nbytes for s in specs)
    expert_bytes = sum(s.nbytes for s in specs if ".mlp.experts." in s.name)
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    free = shutil.disk_usage(tmp).free
    if free < total:  # refused before minutes of writing end in ENOSPC and a traceback
        tmp.rmdir()
        raise SystemExit(f"{out_dir}: needs {total / 1e9:.1f} GB, {free / 1e9:.1f} GB free under {out_dir.parent}: "
                         "free space or choose another --out-dir")  # fmt: skip
    weight_map: dict[str, str] = {}
    started = time.perf_counter()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out_dir.name}",
               disable=None if progress is None else not progress)  # fmt: skip
    try:
        for k, shard in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{n:05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for spec in shard:
                t = spec.make()
                if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                    raise AssertionError(f"{spec.name}: made {tuple(t.shape)} {t.dtype}, planned {spec.shape}")
                tensors[spec.name] = t
                weight_map[spec.name] = fname
                bar.update(spec.nbytes)
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)
            del tensors
        bar.close()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        write_extra(tmp)
        marker = {"synthetic": True, "random_weights": True} | marker | {
            "total_bytes": total,
            "expert_bytes": expert_bytes,
            "bytes_per_expert": expert_bytes // max(1, experts_total),
            "non_expert_bytes": total - expert_bytes,
            "shards": n,
            "build_seconds": round(time.perf_counter() - started, 1),
            "note": "Random weights for benchmarks and tests: the model's outputs are meaningless.",
        }
        (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_synthetic_checkpoint(
    out_dir: str | Path,
    *,
    layers: int = 8,
    hidden: int = 2048,
    heads: int = 32,
    kv_heads: int = 4,
    head_dim: int = 128,
    experts: int = 128,
    top_k: int = 8,
    moe_intermediate: int = 768,
    vocab: int = 32000,
    dtype: torch.dtype | str = torch.bfloat16,
    router_std: float = 0.3,
    expert_std: float = 0.02,
    embed_std: float = _EMBED_STD,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    vision: str = "tiny",
    layout: str = "v5",
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Write the checkpoint to `out_dir` (must not exist unless `overwrite`) and return its path.

    Defaults: Qwen3-VL-30B-A3B's text dimensions with 8 layers and vocab 32,000 (~9.7 GB in bf16).
    `progress`: a tqdm bar over bytes (None: only on a terminal).
    """
    from transformers import GenerationConfig

    from vismmoe_edge.testing.tiny_qwen3_vl_moe import DEMO_MAX_PIXELS, DEMO_MIN_PIXELS, build_offline_processor

    if isinstance(dtype, str):
        dtype = _DTYPES[dtype]
    if layout not in ("v5", "hub"):
        raise ValueError(f"layout must be 'v5' or 'hub', got {layout!r}")
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists():
        if not overwrite:
            raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    processor = build_offline_processor(min_pixels=DEMO_MIN_PIXELS, max_pixels=DEMO_MAX_PIXELS)
    tok = processor.tokenizer
    config = synthetic_config(
        tokenizer=tok, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        experts=experts, top_k=top_k, moe_intermediate=moe_intermediate, vocab=vocab, vision=vision,
    )
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    config.dtype = dtype
    config.get_text_config().dtype = dtype
    unused = tok.convert_tokens_to_ids(
        ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
    )
    zero_rows = sorted(set(unused) | set(range(len(tok), vocab)))
    specs = _plan(
        config, dtype=dtype, seed=seed, router_std=router_std, expert_std=expert_std, layout=layout,
        zero_lm_head_rows=zero_rows, embed_std=embed_std,
    )
    def write_extra(directory: Path) -> None:
        config.save_pretrained(directory)
        eos = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
        GenerationConfig(
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
            do_sample=False,
        ).save_pretrained(directory)
        processor.save_pretrained(directory)

    marker = {
        "builder": "tools/checkpoints/synthetic_qwen3_vl_moe.py",
        "params": {
            "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "experts": experts, "top_k": top_k, "moe_intermediate": moe_intermediate, "vocab": vocab,
            "dtype": str(dtype).removeprefix("torch."), "router_std": router_std, "expert_std": expert_std,
            "embed_std": embed_std, "linear_std": _LINEAR_STD, "seed": seed, "shard_bytes": shard_bytes,
            "vision": vision, "layout": layout,
        },
    }  # fmt: skip
    return write_checkpoint(
        out_dir, specs, shard_bytes=shard_bytes, experts_total=layers * experts, marker=marker,
        write_extra=write_extra, progress=progress,
    )  # fmt: skip


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Parse a shard's header (8-byte little-endian length + JSON) and check it covers the file exactly."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    end = 0
    for key, meta in header.items():
        a, b = meta["data_offsets"]
        count = 1
        for d in meta["shape"]:
            count *= d
        if b - a != count * _ST_ITEMSIZE[meta["dtype"]]:
            raise ValueError(f"{path}: {key} spans {b - a} bytes, its shape {meta['shape']} needs {count}")
        end = max(end, b)
    if 8 + n + end != size:
        raise ValueError(f"{path}: data ends at {8 + n + end}, the file has {size} bytes (truncated?)")
    return header


def check_shards(model_dir: Path) -> tuple[list[str], dict[str, str], int]:
    """Parse every shard header and check it against the index: (shard names, tensor -> shard, tensor bytes)."""
    index = json.loads((model_dir / INDEX_NAME).read_text())
    seen: dict[str, str] = {}
    total = 0
    shards = sorted(set(index["weight_map"].values()))
    for shard in shards:
        for key, meta in read_safetensors_header(model_dir / shard).items():
            seen[key] = shard
            total += meta["data_offsets"][1] - meta["data_offsets"][0]
    if seen != index["weight_map"]:
        missing = set(index["weight_map"]) ^ set(seen)
        raise ValueError(f"{model_dir}: index and shard headers disagree on {sorted(missing)[:5]}")
    if total != index["metadata"]["total_size"]:
        raise ValueError(f"{model_dir}: shards hold {total} bytes, the index says {index['metadata']['total_size']}")
    return shards, seen, total


def validate_checkpoint(model_dir: str | Path) -> dict[str, object]:
    """Load config.json with transformers, parse every shard header, check it against the index. Returns a summary."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if config.architectures != ["Qwen3VLMoeForConditionalGeneration"]:
        raise ValueError(f"{model_dir}: architectures {config.architectures}")
    shards, seen, total = check_shards(model_dir)
    text = config.get_text_config()
    return {
        "model_type": config.model_type,
        "layers": text.num_hidden_layers,
        "experts": text.num_experts,
        "shards": len(shards),
        "tensors": len(seen),
        "total_bytes": total,
        "bytes_on_disk": sum((model_dir / s).stat().st_size for s in shards),
    }


@torch.no_grad()
def routing_stats(model_dir: str | Path, *, tokens: int = 64, seed: int = 0) -> dict[str, object]:
    """Routing locality of a checkpoint on random token ids (what llama-bench feeds): per MoE layer, the mean share
    of a token's top-k experts also chosen by the previous token, and how many distinct experts `tokens` tokens use.

    Loads the whole model with transformers (bf16; ~10 GB for the 8-layer default), one causal forward pass.
    """
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()
    text = model.config.get_text_config()
    picks: dict[int, torch.Tensor] = {}

    def hook(layer: int):
        def fn(_module, _inputs, output):
            picks[layer] = output[2].detach().reshape(-1, text.num_experts_per_tok)  # (logits, weights, index)

        return fn

    handles = [
        layer.mlp.gate.register_forward_hook(hook(i))
        for i, layer in enumerate(model.model.language_model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, text.vocab_size, (1, tokens), generator=g)
    model(input_ids=ids)
    for h in handles:
        h.remove()
    k = text.num_experts_per_tok
    per_layer = {}
    for layer, idx in sorted(picks.items()):
        sets = [set(row.tolist()) for row in idx]
        overlap = [len(a & b) / k for a, b in zip(sets[1:], sets[:-1], strict=True)]
        per_layer[layer] = {
            "prev_token_overlap": round(sum(overlap) / len(overlap), 4),
            "distinct_experts": len(set().union(*sets)),
        }
    overlaps = [v["prev_token_overlap"] for v in per_layer.values()]
    return {
        "tokens": tokens,
        "top_k": k,
        "experts": text.num_experts,
        "uniform_overlap": round(k / text.num_experts, 4),
        "mean_prev_token_overlap": round(sum(overlaps) / len(overlaps), 4),
        "layers": per_layer,
    }


def _parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
    s = text.strip().lower()
    num = s.rstrip("kmgib")
    unit = s[len(num) :]
    if unit not in units:
        raise argparse.ArgumentTypeError(f"bad size {text!r}")
    return int(float(num) * units[unit])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--router-std", type=float, default=0.3)
    p.add_argument("--expert-std", type=float, default=0.02)
    p.add_argument("--embed-std", type=float, default=_EMBED_STD,
                   help="token embedding std; 4.0 gives near-uniform routing on random tokens, 0.2 collapses it")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=_parse_bytes, default=2 << 30, help="max bytes per shard (default 2GiB)")
    p.add_argument("--layout", choices=("v5", "hub"), default="v5")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--routing-stats", action="store_true",
                   help="afterwards, load the model (needs RAM for all of it) and record routing locality on random "
                        f"tokens in {MARKER_NAME}")
    a = p.parse_args(argv)
    if a.out_dir.exists() and not a.overwrite:
        p.error(f"{a.out_dir} exists (use --overwrite)")
    parent = a.out_dir.expanduser().absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    print(f"free space under {parent}: {free / 1e9:.1f} GB", file=sys.stderr)
    t0 = time.perf_counter()
    out = build_synthetic_checkpoint(
        a.out_dir, layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim,
        experts=a.experts, top_k=a.top_k, moe_intermediate=a.moe_intermediate, vocab=a.vocab, dtype=a.dtype,
        router_std=a.router_std, expert_std=a.expert_std, embed_std=a.embed_std, seed=a.seed,
        shard_bytes=a.shard_size, layout=a.layout,
        overwrite=a.overwrite, progress=True,
    )
    built = time.perf_counter() - t0
    summary = validate_checkpoint(out)
    marker = json.loads((out / MARKER_NAME).read_text())
    summary.update(
        path=str(out), build_seconds=round(built, 1), expert_bytes=marker["expert_bytes"],
        bytes_per_expert=marker["bytes_per_expert"],
    )
    if a.routing_stats:
        marker["routing_on_random_tokens"] = routing_stats(out)
        (out / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        summary["mean_prev_token_overlap"] = marker["routing_on_random_tokens"]["mean_prev_token_overlap"]
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    for root in Path(__file__).resolve().parents[2:0:-1]:  # the repository, then tools/ (checkpoints.header_only)
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
    raise SystemExit(main())
