#!/usr/bin/env python3
"""Rewrite a Qwen3-VL-MoE checkpoint's language model as a text-only `Qwen3MoeForCausalLM` directory.

Why: llama.cpp's converter (`convert_hf_to_gguf.py`) maps `Qwen3VLMoeForConditionalGeneration` through a path that
expects the hub expert layout (`gate_up_proj [E, H, 2I]`), while our synthetic checkpoints use the transformers-5
layout (`[E, 2I, H]`). Its `Qwen3MoeForCausalLM` path reads fused transformers-5 expert tensors directly. The
export keeps every language-model tensor byte for byte (experts included: a hub-layout source is transposed to
the v5 layout, nothing else changes), renames `model.language_model.*` to `model.*`, keeps `lm_head.weight`, and
drops the vision tower. On text-only input the two models compute the same function: with equal T/H/W position
ids, interleaved M-RoPE is plain RoPE, and Qwen3-VL-MoE always renormalises its top-k weights
(`norm_topk_prob=True` here).

Peak RAM is one source shard (each output shard mirrors one input shard).

CLI:  python tools/checkpoints/export_text_moe.py SRC_DIR OUT_DIR [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

INDEX_NAME = "model.safetensors.index.json"
_COPY = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
         "generation_config.json", "vocab.json", "merges.txt")
_LM_PREFIX = "model.language_model."


def text_moe_config(src_config: dict) -> dict:
    """config.json of the `Qwen3MoeForCausalLM` equivalent of a Qwen3-VL-MoE config.json (validated by transformers)."""
    from transformers import Qwen3MoeConfig

    t = src_config["text_config"]
    rope = dict(t.get("rope_parameters") or {})
    theta = rope.get("rope_theta", t.get("rope_theta", 5_000_000.0))
    cfg = Qwen3MoeConfig(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        intermediate_size=t.get("intermediate_size", 3 * t["hidden_size"]),
        num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        hidden_act=t.get("hidden_act", "silu"),
        max_position_embeddings=t.get("max_position_embeddings", 32768),
        rms_norm_eps=t.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", src_config.get("tie_word_embeddings", False))),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        attention_bias=t.get("attention_bias", False),
        decoder_sparse_step=t.get("decoder_sparse_step", 1),
        moe_intermediate_size=t["moe_intermediate_size"],
        num_experts_per_tok=t["num_experts_per_tok"],
        num_experts=t.get("num_experts", t.get("num_local_experts")),
        norm_topk_prob=True,  # Qwen3-VL-MoE's router always renormalises the top-k weights
        mlp_only_layers=t.get("mlp_only_layers", []),
        bos_token_id=t.get("bos_token_id"),
        eos_token_id=t.get("eos_token_id"),
        pad_token_id=t.get("pad_token_id"),
        dtype=t.get("dtype", src_config.get("dtype", "bfloat16")),
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg.to_dict()


def _rename(key: str) -> str | None:
    if key.startswith("model.visual."):
        return None
    if key.startswith(_LM_PREFIX):
        return "model." + key[len(_LM_PREFIX) :]
    if key == "lm_head.weight":
        return key
    raise ValueError(f"unexpected tensor {key} in a Qwen3-VL-MoE checkpoint")


def export_text_moe(src_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False,
                    progress: bool | None = None) -> Path:
    """Write the text-only Qwen3MoeForCausalLM directory; returns `out_dir`."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True (--overwrite)")
    src_config = json.loads((src_dir / "config.json").read_text())
    if src_config.get("model_type") != "qwen3_vl_moe":
        raise ValueError(f"{src_dir}: model_type {src_config.get('model_type')!r}, expected 'qwen3_vl_moe'")
    config = text_moe_config(src_config)
    t = src_config["text_config"]
    two_i, hidden = 2 * t["moe_intermediate_size"], t["hidden_size"]
    if two_i == hidden or two_i // 2 == hidden:
        raise ValueError("hidden == I or 2I: the expert layout cannot be told from shapes")

    with torch.device("meta"):
        meta = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    want = {n: tuple(p.shape) for n, p in meta.named_parameters()}
    del meta

    index = json.loads((src_dir / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    tmp = out_dir.parent / f".{out_dir.name}.partial"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    weight_map: dict[str, str] = {}
    total = 0
    bar = tqdm(total=sum((src_dir / s).stat().st_size for s in shards), unit="B", unit_scale=True,
               desc="exporting text MoE", disable=None if progress is None else not progress)
    try:
        n_out = 0
        plan: list[tuple[str, list[tuple[str, str]]]] = []
        for shard in shards:
            with safe_open(str(src_dir / shard), framework="pt") as f:
                keys = [(k, new) for k in f.keys() if (new := _rename(k)) is not None]
            if keys:
                plan.append((shard, keys))
        n_out = len(plan)
        for i, (shard, keys) in enumerate(plan, 1):
            fname = f"model-{i:05d}-of-{n_out:05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(src_dir / shard), framework="pt") as f:
                for key, new in keys:
                    x = f.get_tensor(key)
                    if new.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and \
                            tuple(x.shape) != want[new]:
                        x = x.transpose(1, 2).contiguous()  # hub layout [E, H, 2I] / [E, I, H] -> v5
                    if new not in want:
                        raise ValueError(f"{shard}: {key} -> {new} is not a Qwen3MoeForCausalLM parameter")
                    if tuple(x.shape) != want[new]:
                        raise ValueError(f"{shard}: {key} has shape {tuple(x.shape)}, expected {want[new]}")
                    tensors[new] = x
                    weight_map[new] = fname
                    total += x.numel() * x.element_size()
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)
            del tensors
            bar.update((src_dir / shard).stat().st_size)
        bar.close()
        missing = sorted(set(want) - set(weight_map))
        if missing and not (missing == ["lm_head.weight"] and config.get("tie_word_embeddings")):
            raise ValueError(f"{src_dir}: no tensor for {missing[:3]}")
        (tmp / INDEX_NAME).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
            + "\n"
        )
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in _COPY:
            if (src_dir / name).is_file():
                shutil.copy2(src_dir / name, tmp / name)
        (tmp / "EXPORTED_FROM.json").write_text(
            json.dumps({"source": str(src_dir.resolve()), "tool": "tools/checkpoints/export_text_moe.py"}, indent=2)
            + "\n"
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        bar.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Qwen3-VL-MoE checkpoint -> text-only Qwen3MoeForCausalLM directory")
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    out = export_text_moe(a.src, a.out, overwrite=a.overwrite, progress=True)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
