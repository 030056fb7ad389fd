"""A Qwen3-VL-MoE layer's attention for a few prompt rows after a reused prefix (a suffix graph's padded rows:
suffix_graph.py), as explicit tensor code that torch.compile can fuse.

Replayed from a suffix graph, transformers' eager layers launched 94 kernels a layer on an H200 (run 11: 4,512 for
48 layers, 25.7 ms a replay, docs/benchmarks.md); the norms, the q/k norms, rotary, the K/V concatenation, the
K/V repeated per group and the residual add are ~50 of them, a few microseconds each on a mostly idle GPU.
Eagerly, `attend_rows` is transformers' computation op for op (RMSNorm, q/k norms, rotary, the cache's
concatenation, sdpa_attention_forward with a mask: K/V repeated per group, o_proj, the residual, the
post-attention norm): tests/test_suffix_layer.py checks it bit for bit on the CPU. Compiled (CUDA with Triton,
`engine.compile_decode`), inductor fuses those ops into a few kernels and q, k and v are one GEMM of the stacked
weight; a GPU check judges that by the near-tie rule (tools/device/prefix_cache_checks.py). The router's softmax,
top-k and renormalisation follow in the same function (Qwen3VLMoeTextTopKRouter's ops); the experts stay the
module's own: a pinned layer's grouped GEMM (experts/compute.py). One compiled function serves every layer; a
second suffix shape recompiles it once with dynamic lengths (torch.compile's automatic dynamic shapes).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from vismmoe_edge.kernels.decode_layer import AttentionShape, LayerTensors, rms_norm, rotated_qkv, stack_qkv


def make_attend_rows(shape: AttentionShape) -> Callable[..., tuple[torch.Tensor, ...]]:
    groups = shape.heads // shape.kv_heads

    def attend_rows(
        hidden: torch.Tensor,  # [1, P, H]: the residual stream
        cos: torch.Tensor,  # [1, P, d]
        sin: torch.Tensor,
        prefix_keys: torch.Tensor,  # [1, kv_heads, R, d]: the reused prefix's K/V
        prefix_values: torch.Tensor,
        mask: torch.Tensor | None,  # [1, 1, P, R + P]: the padded causal mask
        ln1: torch.Tensor,
        q_w: torch.Tensor,
        k_w: torch.Tensor,
        v_w: torch.Tensor,
        o_w: torch.Tensor,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        ln2: torch.Tensor,
        router: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        """-> (the residual after attention [1, P, H], its post-attention norm, the layer's K/V [1, kv_heads,
        R + P, d] each, the router's top-k experts [P, k] and their weights [P, k], as
        Qwen3VLMoeTextTopKRouter gives them to the layer's experts)."""
        rows = hidden.shape[1]
        q, k, v = rotated_qkv(rms_norm(hidden, ln1, shape.eps), q_w, k_w, v_w, q_norm, k_norm, cos, sin, shape)
        keys = torch.cat([prefix_keys, k], dim=-2)  # as the DynamicCache's update
        values = torch.cat([prefix_values, v], dim=-2)
        out = F.scaled_dot_product_attention(q, repeat_kv(keys, groups), repeat_kv(values, groups), attn_mask=mask,
                                             dropout_p=0.0, scale=shape.scaling)  # fmt: skip
        out = out.reshape(1, -1, rows, shape.head_dim).transpose(1, 2).contiguous()
        hidden = hidden + F.linear(out.reshape(1, rows, -1).contiguous(), o_w)
        normed = rms_norm(hidden, ln2, shape.eps)
        logits = F.linear(normed.reshape(rows, -1), router)
        p, index = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), shape.top_k, dim=-1)
        return hidden, normed, keys, values, index, (p / p.sum(dim=-1, keepdim=True)).to(logits.dtype)

    return attend_rows


class SuffixLayers:
    """`attend_rows` for every layer of a language model (kernels/decode_layer.supports), compiled once for all of
    them when asked; a compiler failure warns and runs the same code eagerly."""

    def __init__(self, language_model: Any, *, compile: bool) -> None:
        first = language_model.layers[0]
        a, config = first.self_attn, language_model.config
        shape = AttentionShape(config.num_attention_heads, config.num_key_value_heads, a.head_dim, a.scaling,
                               first.input_layernorm.variance_epsilon, first.mlp.gate.top_k)  # fmt: skip
        self.tensors = [LayerTensors.of(layer) for layer in language_model.layers]
        if compile:
            for layer, t in zip(language_model.layers, self.tensors, strict=True):
                t.q = stack_qkv(layer.self_attn)
        self.eager = make_attend_rows(shape)
        self.fn = torch.compile(self.eager, fullgraph=True) if compile else self.eager
        self.compiled = compile
        self._proven = not compile  # the function has returned once

    def attend(
        self, i: int, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], prefix_keys: torch.Tensor,
        prefix_values: torch.Tensor, mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:  # fmt: skip
        """Layer i's attention over `hidden` [1, P, H] after the prefix's K/V, and its router: (residual, normed,
        keys, values, experts, weights)."""
        t = self.tensors[i]
        args = (hidden, *cos_sin, prefix_keys, prefix_values, mask, t.ln1, t.q, t.k, t.v, t.o, t.q_norm, t.k_norm,
                t.ln2, t.router)  # fmt: skip
        if self._proven:
            return self.fn(*args)
        try:  # the compiler fails before any of its kernels runs: nothing has been written yet
            out = self.fn(*args)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises: the same computation, eagerly
            warnings.warn(f"torch.compile of the suffix layers failed ({type(e).__name__}: {e}); running them "
                          "eagerly", stacklevel=2)  # fmt: skip
            self.fn, self.compiled = self.eager, False
            out = self.fn(*args)
        self._proven = True
        return out
