#!/usr/bin/env python3
"""Write a random DeepSeek-VL2 checkpoint in the original layout, real expert sizes, shard by shard.

The DeepSeek-VL2 counterpart of tools/checkpoints/synthetic_qwen3_vl_moe.py (same approach, same helpers): a model
directory that `vismmoe_edge.load` reads like a downloaded DeepSeek-VL2 one: `config.json` in the original form
(`model_type: deepseek_vl_v2`, `language_config` / `vision_config` / `projector_config`), `generation_config.json`,
`model.safetensors.index.json` + shards, the offline tokenizer and `processor_config.json`, and
`VISMMOE_SYNTHETIC.json` recording how it was made.

- Defaults: DeepSeek-VL2-Small's language model (`deepseek_vl2_variants.LANGUAGE["small"]`: hidden 2048, MLA
  with kv_lora_rank 512 / no q compression / nope 128 / rope 64 / v 128, 16 heads, dense intermediate 10944,
  moe_intermediate 1408, 64 routed experts, top-6, 2 shared, greedy softmax routing, first_k_dense_replace 1)
  with 9 layers (1 dense + 8 MoE) instead of 27, and vocab 32,000 instead of 129,280 (the lm_head's share of a
  decode step then stays about what it is in the 27-layer model). ~9.8 GB in bf16, 8.86 GB of it routed experts
  (17.3 MB each).
- Keys are the released checkpoint's: per-expert `language.model.layers.{l}.mlp.experts.{j}.{gate,up,down}_proj
  .weight`, `...mlp.shared_experts.*`, the dense first layer `language.model.layers.0.mlp.*`, routers
  `...mlp.gate.weight`, `language.lm_head.weight`, the timm SigLIP tower (`vision.blocks.{i}.attn.qkv`,
  `vision.pos_embed [1, N, C]`, unused `vision.attn_pool.*`), `projector.layers.{0,2}`, `image_newline`,
  `view_seperator`.
- The vision tower is small (the tiny demo's: 42 px tiles, width 32, 2 blocks) with the real class's own
  initialisation; the projector maps it to the full hidden size.
- Names and shapes come from `DeepseekVL2ForCausalLM(config)` on the meta device; each tensor is drawn from a
  generator seeded by (seed, its original name), so it is reproducible on its own: linear layers N(0, 0.02),
  RMSNorm weights 1, embeddings N(0, `embed_std`), routers N(0, `router_std`), routed experts N(0, `expert_std`).
  lm_head rows of ids the offline tokenizer lacks, of `<image>`, BOS and PAD are zero.
- Tensors are packed in model order into shards of at most `shard_bytes`, each materialised alone (peak RAM about
  one shard), written into `.NAME.partial` beside `out_dir` and renamed into place at the end.

CLI:  python tools/checkpoints/synthetic_deepseek_vl2.py $BENCH_DATA/deepseek-vl2-small-9layer # 1+8 layers, 9.8 GB
      python tools/checkpoints/synthetic_deepseek_vl2.py /tmp/tiny --layers 3 --experts 8 --top-k 2 --hidden 64 ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

TOOLS = Path(__file__).resolve().parents[1]
for _p in (TOOLS, TOOLS.parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from checkpoints import synthetic_qwen3_vl_moe as msc  # noqa: E402

INDEX_NAME = msc.INDEX_NAME
MARKER_NAME = msc.MARKER_NAME
_LINEAR_STD = msc._LINEAR_STD


def synthetic_config_json(
    *,
    image_token_id: int,
    layers: int = 9,
    vocab: int = 32000,
    experts: int = 64,
    top_k: int = 6,
    shared: int = 2,
    hidden: int | None = None,
    heads: int | None = None,
    moe_intermediate: int | None = None,
    dense_intermediate: int | None = None,
    kv_lora_rank: int | None = None,
    qk_nope_head_dim: int | None = None,
    qk_rope_head_dim: int | None = None,
    v_head_dim: int | None = None,
) -> dict[str, Any]:
    """config.json (original form): DeepSeek-VL2-Small's language_config with the given overrides (None keeps
    Small's value), the tiny demo's vision tower and candidate resolutions, a projector to `hidden`."""
    from vismmoe_edge.models.deepseek_vl2.variants import variant_config
    from vismmoe_edge.testing.tiny_deepseek_vl2 import CANDIDATES, TILE

    raw = variant_config("small")
    lang = raw["language_config"]
    overrides = {
        "num_hidden_layers": layers, "vocab_size": vocab, "n_routed_experts": experts, "num_experts_per_tok": top_k,
        "n_shared_experts": shared, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": heads, "moe_intermediate_size": moe_intermediate,
        "intermediate_size": dense_intermediate, "kv_lora_rank": kv_lora_rank, "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim,
    }  # fmt: skip
    lang.update({k: v for k, v in overrides.items() if v is not None})
    if lang["first_k_dense_replace"] >= layers:
        raise ValueError(f"layers={layers}: need at least one MoE layer after the dense first layer")
    width = 32
    raw["vision_config"] = {"model_name": "siglip_so400m_patch14_384", "image_size": TILE, "patch_size": 14,
                            "width": width, "layers": 2, "heads": 2, "mlp_ratio": 3.7362}  # fmt: skip
    raw["projector_config"] |= {"input_dim": width, "n_embed": lang["hidden_size"]}
    raw["candidate_resolutions"] = [list(r) for r in CANDIDATES]
    raw["image_token_id"] = image_token_id  # not in the hub file (its tokenizer has it); as the demos write it
    raw["torch_dtype"] = "bfloat16"
    return raw


def _plan(
    raw: dict[str, Any],
    *,
    dtype: torch.dtype,
    seed: int,
    router_std: float,
    expert_std: float,
    embed_std: float,
    zero_lm_head_rows: list[int],
) -> list[msc._Spec]:
    """Every tensor of the checkpoint under its original name, in model order, with a closure making its data."""
    from vismmoe_edge.models.deepseek_vl2.model import DeepseekVL2ForCausalLM
    from vismmoe_edge.testing.tiny_deepseek_vl2 import config_from_json

    config = config_from_json(raw)
    with torch.device("meta"):
        meta = DeepseekVL2ForCausalLM(config)
    params = [(n, tuple(t.shape)) for n, t in meta.state_dict().items()]
    del meta

    specs: list[msc._Spec] = []
    for name, shape in params:
        if name.startswith("vision."):
            if not any(s.name.startswith("vision.") for s in specs):
                specs += _vision_specs(config.vision_config, dtype=dtype, seed=seed)
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H] -> per expert gate_proj, up_proj [I, H]
            prefix = name.removesuffix(".gate_up_proj")
            experts, two_inter, hid = shape
            inter = two_inter // 2
            for j in range(experts):
                for proj, s in (("gate_proj", (inter, hid)), ("up_proj", (inter, hid)), ("down_proj", (hid, inter))):
                    key = f"{prefix}.{j}.{proj}.weight"
                    specs.append(msc._Spec(key, s, dtype, msc._maker(s, expert_std, dtype, seed, key)))
            continue
        if name.endswith(".mlp.experts.down_proj"):  # [E, H, I]: planned with gate_up_proj above
            continue
        if name.endswith(".mlp.gate.weight"):
            std = router_std
        elif name.endswith("embed_tokens.weight"):
            std = embed_std
        elif name in ("image_newline", "view_seperator"):
            std = 1.0
        elif len(shape) == 1:
            value = 1.0 if name.endswith("norm.weight") else 0.0
            specs.append(msc._Spec(name, shape, dtype, lambda s=shape, v=value: torch.full(s, v, dtype=dtype)))
            continue
        else:
            std = _LINEAR_STD
        zero = zero_lm_head_rows if name == "language.lm_head.weight" else None
        specs.append(msc._Spec(name, shape, dtype, msc._maker(shape, std, dtype, seed, name, zero)))
    return specs


def _vision_specs(vision_config: Any, *, dtype: torch.dtype, seed: int) -> list[msc._Spec]:
    """The small SigLIP tower under the original timm names (fused qkv, pos_embed [1, N, C], an unused attention
    pool), initialised by the real class; it is tiny, so it is built here."""
    from transformers import SiglipVisionModel

    from vismmoe_edge.testing.tiny_deepseek_vl2 import _timm_name

    torch.manual_seed(seed)
    tower = SiglipVisionModel(vision_config)
    state: dict[str, torch.Tensor] = {}
    for name, t in tower.state_dict().items():
        state.update(_timm_name(f"vision.{name}", t.detach().to(dtype).contiguous()))
    for i in range(vision_config.num_hidden_layers):  # timm fuses q, k, v with q rows first
        for kind in ("weight", "bias"):
            parts = [state.pop(f"vision.blocks.{i}.attn.{p}.{kind}") for p in "qkv"]
            state[f"vision.blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)
    width = vision_config.hidden_size
    g = msc._generator(seed, "vision.attn_pool")
    state["vision.attn_pool.latent"] = torch.randn(1, 1, width, generator=g).to(dtype)
    state["vision.attn_pool.q.weight"] = (torch.randn(width, width, generator=g) * _LINEAR_STD).to(dtype)
    return [msc._Spec(k, tuple(t.shape), dtype, lambda t=t: t) for k, t in state.items()]


def build_synthetic_deepseek_vl2(
    out_dir: str | Path,
    *,
    layers: int = 9,
    vocab: int = 32000,
    experts: int = 64,
    top_k: int = 6,
    shared: int = 2,
    hidden: int | None = None,
    heads: int | None = None,
    moe_intermediate: int | None = None,
    dense_intermediate: int | None = None,
    kv_lora_rank: int | None = None,
    qk_nope_head_dim: int | None = None,
    qk_rope_head_dim: int | None = None,
    v_head_dim: int | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
    router_std: float = 0.3,
    expert_std: float = 0.02,
    embed_std: float = msc._EMBED_STD,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Write the checkpoint to `out_dir` (must not exist unless `overwrite`) and return its path.

    Sizes left None keep DeepSeek-VL2-Small's; the defaults give 1 dense + 8 MoE layers, ~9.8 GB in bf16.
    """
    from vismmoe_edge.models.deepseek_vl2.processor import BOS, EOS, IMAGE_TOKEN, PAD, DeepseekVL2Processor
    from vismmoe_edge.testing.tiny_deepseek_vl2 import CANDIDATES, build_offline_deepseek_vl2_tokenizer

    if isinstance(dtype, str):
        dtype = msc._DTYPES[dtype]
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite) to replace it")
    tok = build_offline_deepseek_vl2_tokenizer()
    if vocab < len(tok):
        raise ValueError(f"vocab={vocab} is smaller than the offline tokenizer ({len(tok)} tokens)")
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    raw = synthetic_config_json(
        image_token_id=image_token_id, layers=layers, vocab=vocab, experts=experts, top_k=top_k, shared=shared,
        hidden=hidden, heads=heads, moe_intermediate=moe_intermediate, dense_intermediate=dense_intermediate,
        kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
    )  # fmt: skip
    raw["torch_dtype"] = str(dtype).removeprefix("torch.")
    zero_rows = sorted(set(tok.convert_tokens_to_ids([IMAGE_TOKEN, BOS, PAD])) | set(range(len(tok), vocab)))
    specs = _plan(raw, dtype=dtype, seed=seed, router_std=router_std, expert_std=expert_std, embed_std=embed_std,
                  zero_lm_head_rows=zero_rows)  # fmt: skip
    moe_layers = layers - raw["language_config"]["first_k_dense_replace"]

    def write_extra(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.convert_tokens_to_ids(EOS),
                      "pad_token_id": tok.pad_token_id, "do_sample": False}  # fmt: skip
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        DeepseekVL2Processor(tok, CANDIDATES, patch_size=14, downsample_ratio=2).save_pretrained(directory)

    marker = {
        "builder": "tools/checkpoints/synthetic_deepseek_vl2.py",
        "family": "deepseek-vl2",
        "language_config": raw["language_config"],
        "params": {
            "layers": layers,
            "moe_layers": moe_layers,
            "vocab": vocab,
            "experts": experts,
            "top_k": top_k,
            "shared": shared,
            "dtype": str(dtype).removeprefix("torch."),
            "router_std": router_std,
            "expert_std": expert_std,
            "embed_std": embed_std,
            "linear_std": _LINEAR_STD,
            "seed": seed,
            "shard_bytes": shard_bytes,
            "vision": "tiny",
        },  # fmt: skip
    }
    return msc.write_checkpoint(
        out_dir, specs, shard_bytes=shard_bytes, experts_total=moe_layers * experts, marker=marker,
        write_extra=write_extra, progress=progress,
    )  # fmt: skip


def validate_checkpoint(model_dir: str | Path) -> dict[str, object]:
    """Parse every shard header against the index, then read the directory as `vismmoe-edge info` does."""
    from vismmoe_edge.planning.describe import describe_checkpoint

    model_dir = Path(model_dir)
    shards, seen, total = msc.check_shards(model_dir)
    info = describe_checkpoint(model_dir)
    return {
        "architecture": info["architecture"],
        "layers": info["layers"],
        "moe_layers": info["moe_layers"],
        "experts": info["experts_per_layer"],
        "top_k": info["top_k"],
        "shared_experts": info["shared_experts"],
        "bytes_per_expert": info["bytes_per_expert"],
        "resident_bytes": info["resident_bytes"],
        "shared_expert_bytes": info.get("shared_expert_bytes"),
        "shards": len(shards),
        "tensors": len(seen),
        "total_bytes": total,
        "bytes_on_disk": sum((model_dir / s).stat().st_size for s in shards),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--layers", type=int, default=9, help="decoder layers, the first dense (default 9: 1 + 8 MoE)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--shared", type=int, default=2)
    p.add_argument("--hidden", type=int, help="default: DeepSeek-VL2-Small's 2048")
    p.add_argument("--heads", type=int, help="default: Small's 16")
    p.add_argument("--moe-intermediate", type=int, help="default: Small's 1408")
    p.add_argument("--dense-intermediate", type=int, help="default: Small's 10944")
    p.add_argument("--kv-lora-rank", type=int, help="default: Small's 512")
    p.add_argument("--qk-nope-head-dim", type=int, help="default: Small's 128")
    p.add_argument("--qk-rope-head-dim", type=int, help="default: Small's 64")
    p.add_argument("--v-head-dim", type=int, help="default: Small's 128")
    p.add_argument("--dtype", choices=sorted(msc._DTYPES), default="bfloat16")
    p.add_argument("--router-std", type=float, default=0.3)
    p.add_argument("--expert-std", type=float, default=0.02)
    p.add_argument("--embed-std", type=float, default=msc._EMBED_STD)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", type=msc._parse_bytes, default=2 << 30, help="max bytes per shard (default 2GiB)")
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    if a.out_dir.exists() and not a.overwrite:
        p.error(f"{a.out_dir} exists (use --overwrite)")
    parent = a.out_dir.expanduser().absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    print(f"free space under {parent}: {shutil.disk_usage(parent).free / 1e9:.1f} GB", file=sys.stderr)
    t0 = time.perf_counter()
    out = build_synthetic_deepseek_vl2(
        a.out_dir, layers=a.layers, vocab=a.vocab, experts=a.experts, top_k=a.top_k, shared=a.shared,
        hidden=a.hidden, heads=a.heads, moe_intermediate=a.moe_intermediate, dense_intermediate=a.dense_intermediate,
        kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, dtype=a.dtype, router_std=a.router_std, expert_std=a.expert_std,
        embed_std=a.embed_std, seed=a.seed, shard_bytes=a.shard_size, overwrite=a.overwrite, progress=True,
    )  # fmt: skip
    summary = {"path": str(out), "build_seconds": round(time.perf_counter() - t0, 1), **validate_checkpoint(out)}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
