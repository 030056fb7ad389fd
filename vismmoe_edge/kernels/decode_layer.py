"""A Qwen3-VL-MoE decoder layer's attention and router for one decode token, as explicit tensor code that
torch.compile can fuse.

Eager, `attend` and `route` are transformers' own computation op for op (RMSNorm, q/k norms, rotary, the K/V
write, SDPA as transformers' sdpa integration calls it for one query, o_proj, the post-attention norm; the
router's softmax, top-k and renormalisation): tests/test_decode_layer.py checks them bit for bit on the CPU.
Compiled (`FusedLayers(compile=True)`, CUDA with Triton, `engine.compile_decode` "auto"), inductor fuses the ~60
small kernels of a layer's norms, rotary, mask and router into a handful; the token graph of
static_decode.StaticDecoder captures the compiled kernels like any others. One compiled function serves every
layer: the weights are arguments, not constants, so 48 layers compile once (per KV capacity).

Compiled on CUDA with Triton, the attention itself is kernels/decode_attention.py's split-KV (flash-decoding)
kernel. transformers' compiled sdpa path (K/V repeated per group, then SDPA with an additive mask over the
whole capacity, still what a compile without Triton or CUDA runs) was the costliest kernel of the token on an
H200 at 30B-A3B shapes: the mem-efficient SDPA kernel 61 us per layer (one query at batch 1 gives it too few
programs for ~3 MB of K/V, <1 us at HBM speed), plus ~10 us per layer writing the repeated K/V. Likewise the
router's softmax, top-k and renormalisation are one Triton program (kernels/decode_router.py) instead of
torch.topk's two kernels (8.5 us a layer); with `VISMMOE_DECODE_GEMV` holding "o" o_proj is kernels/dense_gemv.py's
GEMV instead of cuBLAS's split-K pair, and with "router" (both by default) the whole router, its GEMV included, is
decode_router.py's one kernel, launched outside the compiled function (`FusedLayers.route`).

Compiled kernels may round differently from eager ones (inductor keeps a fused norm in float32 where eager
rounds to bf16 between ops), so a compiled decode is checked on the GPU under the near-tie rule
(tools/device/decode_checks.py --compile), never on the CPU path, which stays eager and exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from vismmoe_edge.kernels.decode_attention import decode_attention
from vismmoe_edge.kernels.decode_router import route_and_lookup, route_topk
from vismmoe_edge.kernels.dense_gemv import dense_gemv
from vismmoe_edge.kernels.moe_decode import HAS_TRITON, lookup


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    eps: float  # every norm of the layer (transformers builds them from config.rms_norm_eps)
    top_k: int


@dataclass
class LayerTensors:
    """One layer's weights, in the order `attend` takes them."""

    ln1: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    ln2: torch.Tensor
    router: torch.Tensor

    @classmethod
    def of(cls, layer: Any) -> LayerTensors:
        a = layer.self_attn
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        projections = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight)
        return cls(norms[0], *projections, a.q_norm.weight, a.k_norm.weight, norms[1], layer.mlp.gate.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotated_qkv(
    h: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor, q_norm: torch.Tensor,
    k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: AttentionShape, gemv: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The normed input h [1, T, H] -> q [1, heads, T, d], k and v [1, kv_heads, T, d]: the projections, the q/k
    norms and rotary, as Qwen3VLMoeTextAttention computes them. A q_w taller than q's rows is the layer's q, k and
    v stacked (stack_qkv, compiled only): one GEMM (`gemv`: the Triton GEMV of `project`, for one row)."""
    heads, kv_heads, d = shape.heads, shape.kv_heads, shape.head_dim
    rows = h.shape[1]
    if q_w.shape[0] > heads * d:
        q, k, v = project(h, q_w, gemv and rows == 1).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    else:
        q, k, v = F.linear(h, q_w), F.linear(h, k_w), F.linear(h, v_w)
    q = rms_norm(q.view(1, rows, heads, d), q_norm, shape.eps).transpose(1, 2)
    k = rms_norm(k.view(1, rows, kv_heads, d), k_norm, shape.eps).transpose(1, 2)
    v = v.view(1, rows, kv_heads, d).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * c) + (rotate_half(q) * s), (k * c) + (rotate_half(k) * s), v


def project(x: torch.Tensor, w: torch.Tensor, gemv: bool) -> torch.Tensor:
    """F.linear of one row x [..., K]; compiled on CUDA with `gemv`, kernels/dense_gemv.py's Triton GEMV."""
    if gemv and torch.compiler.is_compiling() and x.is_cuda and HAS_TRITON:
        return dense_gemv(x.reshape(1, -1), w).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


def make_attend(shape: AttentionShape, gemv: frozenset[str] = frozenset()) -> Callable[..., torch.Tensor]:
    """`gemv`: the projections (dense_gemv.PROJECTIONS) the compiled layer computes with the Triton GEMV."""
    heads, kv_heads, d = shape.heads, shape.kv_heads, shape.head_dim
    groups = heads // kv_heads

    def attend(
        experts: torch.Tensor,  # [r, H]: the previous layer's expert outputs, weighted, summed in here first
        hidden: torch.Tensor,  # [1, 1, H], the residual stream: experts and attention are added in place
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,  # [1, kv_heads, capacity, d]: this position's K/V are written in place
        values: torch.Tensor,
        length: torch.Tensor,  # [1] long: positions this layer holds before the new one
        positions: torch.Tensor,  # [capacity] long: arange
        ln1: torch.Tensor,
        q_w: torch.Tensor,
        k_w: torch.Tensor,
        v_w: torch.Tensor,
        o_w: torch.Tensor,
        q_norm: torch.Tensor,
        k_norm: torch.Tensor,
        ln2: torch.Tensor,
    ) -> torch.Tensor:
        """Returns the post-attention norm of the updated residual, [1, 1, H]."""
        summed = experts[0]
        for row in range(1, experts.shape[0]):  # pointwise adds, which inductor fuses into the norm's kernel: a
            summed = summed + experts[row]  # sum(0) was a Triton kernel of its own, 48 a token in run 9's profile
        hidden.add_(summed.to(hidden.dtype).view_as(hidden))
        q, k, v = rotated_qkv(rms_norm(hidden, ln1, shape.eps), q_w, k_w, v_w, q_norm, k_norm, cos, sin, shape,
                              gemv="qkv" in gemv)  # fmt: skip
        keys.index_copy_(2, length, k)
        values.index_copy_(2, length, v)
        visible = positions <= length
        mask = torch.zeros(positions.shape[0], dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~visible, torch.finfo(hidden.dtype).min).view(1, 1, 1, -1)
        if torch.compiler.is_compiling() and keys.is_cuda and HAS_TRITON:  # split-KV kernels (module docstring)
            out = decode_attention(q, keys, values, length, shape.scaling)
        elif torch.compiler.is_compiling():  # transformers' sdpa path under compilation: K/V repeated per group
            out = F.scaled_dot_product_attention(q, repeat_kv(keys, groups), repeat_kv(values, groups),
                                                 attn_mask=mask, scale=shape.scaling)  # fmt: skip
        else:  # ... and eager, one query: the query heads packed per K/V head (transformers' pack_gqa)
            out = F.scaled_dot_product_attention(q.reshape(1, kv_heads, groups, d), keys, values, attn_mask=mask,
                                                 scale=shape.scaling)  # fmt: skip
        out = out.reshape(1, -1, 1, d).transpose(1, 2).contiguous().reshape(1, 1, -1)
        hidden.add_(project(out, o_w, "o" in gemv))
        return rms_norm(hidden, ln2, shape.eps)

    return attend


def make_route(top_k: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    def route(
        x: torch.Tensor, weight: torch.Tensor, table_row: torch.Tensor, routing: torch.Tensor, missed: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """x [1, H] -> (index [1, k] long, weights [1, k], slots [1, k] long, missed), the first two as
        transformers' Qwen3VLMoeTextTopKRouter, the last two looked up in the expert table; `record` writes the
        index and the miss flag into the token's `routing` [k] and `missed` [] rows."""
        logits = F.linear(x, weight)  # (with "router" in `gemv`, FusedLayers.route takes decode_router.py's kernel)
        if torch.compiler.is_compiling() and logits.is_cuda and HAS_TRITON:  # one program (decode_router.py)
            index, top = route_topk(logits, top_k)
        else:
            p, index = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), top_k, dim=-1)
            top = (p / p.sum(dim=-1, keepdim=True)).to(logits.dtype)
        return index, top, *record(index, table_row, routing, missed)

    return route


def record(
    index: torch.Tensor, table_row: torch.Tensor, routing: torch.Tensor, missed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table lookup of `index` [1, k], also written into the token's `routing` and `missed` rows: compiled,
    the two writes are stores of the lookup's own kernel, where outside it they were two copy kernels a layer
    (~96 of a 30B-A3B token's 934 in run 9's profile)."""
    slots, miss = lookup(index, table_row)
    routing.copy_(index[0])
    missed.copy_(miss)
    return slots, miss


def aligned_rows(rows: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros [rows], each element at a 16-byte boundary (a strided view), for the per-layer rows the compiled
    functions take (each layer's KV length and miss flag): compiled on layer 0's row, inductor assumes an input
    aligned and clones a misaligned one before every call, copying it back after where the call writes it
    (torch/_inductor/utils.py `copy_misaligned_inputs`). Run 11's token had ~45 `memcpy_post` and ~45
    `multi_tensor_apply` kernels: a clone and a `_foreach_copy_` for each miss flag (a bool at byte m) off 16."""
    per_row = max(1, 16 // torch.empty((), dtype=dtype).element_size())
    return torch.zeros(rows, per_row, dtype=dtype, device=device)[:, 0]


def stack_qkv(attention: Any) -> torch.Tensor:
    """The q, k and v projections' weights as one tensor, which the modules' weights become views of (so no byte
    is held twice): at batch 1 the k and v GEMVs (0.5 MB each at 30B-A3B shapes) cost a kernel launch each, more
    than their bytes. Compiled only: on the CPU a GEMV of the stacked weight may round unlike three separate ones."""
    stacked = getattr(attention, "stacked_qkv", None)
    if stacked is not None:  # an earlier decoder (another KV capacity) stacked them already
        return stacked
    projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    stacked = attention.stacked_qkv = torch.cat([p.weight.data for p in projections])
    start = 0
    for p in projections:
        rows = p.weight.shape[0]
        p.weight.data = stacked[start : start + rows]
        start += rows
    return stacked


def stack_every_qkv(language_model: Any) -> None:
    """`stack_qkv` in every layer. On CUDA the decoders do it before their first capture, whether or not they
    compile, so that the weights a captured graph reads never move afterwards."""
    for layer in language_model.layers:
        stack_qkv(layer.self_attn)


def supports(language_model: Any, moe_layers: set[int]) -> bool:
    """Every layer a Qwen3-VL-MoE MoE layer with plain bias-free linears (quantized dense weights keep the
    modules' own forward) under transformers' sdpa attention."""
    if getattr(language_model.config, "_attn_implementation", None) != "sdpa":
        return False
    for i, layer in enumerate(language_model.layers):
        a = layer.self_attn
        if i not in moe_layers or type(a).__name__ != "Qwen3VLMoeTextAttention":
            return False
        if type(layer.mlp.gate).__name__ != "Qwen3VLMoeTextTopKRouter":
            return False
        if any(type(p) is not torch.nn.Linear or p.bias is not None for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
            return False
    return True


class FusedLayers:
    """`attend` and `route` for every layer of a language model, compiled once for all of them when asked."""

    def __init__(self, language_model: Any, *, compile: bool, gemv: frozenset[str] = frozenset()) -> None:
        first = language_model.layers[0]
        a = first.self_attn
        config = language_model.config
        self.shape = AttentionShape(config.num_attention_heads, config.num_key_value_heads, a.head_dim, a.scaling,
                                    first.input_layernorm.variance_epsilon, first.mlp.gate.top_k)  # fmt: skip
        self.tensors = [LayerTensors.of(layer) for layer in language_model.layers]
        if compile:
            for layer, t in zip(language_model.layers, self.tensors, strict=True):
                t.q = stack_qkv(layer.self_attn)
        self.eager = (make_attend(self.shape, gemv), make_route(self.shape.top_k), record)
        self.compiled = compile
        self.fns = self.eager
        if compile:
            self.fns = tuple(torch.compile(fn, dynamic=False, fullgraph=True) for fn in self.eager)  # type: ignore[assignment]
        self._proven = {0, 1, 2} if not compile else set()  # the functions that have returned once
        # compiled on CUDA with "router" in `gemv`: decode_router.py's one-kernel router, and its tickets (0 between
        # calls; launched outside torch.compile, so the rows it writes are plain stores)
        device = self.tensors[0].router.device
        self.router_counter = torch.zeros(1, dtype=torch.int32, device=device) if compile and "router" in gemv else None

    def attend(
        self, i: int, experts: torch.Tensor, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: Any,
    ) -> torch.Tensor:  # fmt: skip
        """Layer i's attention, after adding the previous layer's expert outputs `experts` [r, H] (rows summed;
        zeros for the first layer) to the residual `hidden`."""
        t = self.tensors[i]
        kv = (cache.keys[i], cache.values[i], cache.lengths[i : i + 1], cache.positions)
        weights = (t.ln1, t.q, t.k, t.v, t.o, t.q_norm, t.k_norm, t.ln2)
        return self._call(0, experts, hidden, *cos_sin, *kv, *weights)

    def route(
        self, i: int, x: torch.Tensor, table_row: torch.Tensor, routing: torch.Tensor, missed: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """(index, weights, slots, missed) of layer i's router and the expert table; the index and the miss flag
        are also written into the token's `routing` and `missed` rows."""
        if self.router_counter is not None:  # GEMV, top-k, lookup and the rows in one kernel
            return *route_and_lookup(x, self.tensors[i].router, table_row, routing, missed, self.router_counter), missed
        return self._call(1, x, self.tensors[i].router, table_row, routing, missed)

    def lookup(
        self, index: torch.Tensor, table_row: torch.Tensor, routing: torch.Tensor, missed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under trace replay the routing comes in; only the table lookup (and its record) runs."""
        return self._call(2, index, table_row, routing, missed)

    def _call(self, which: int, *args: torch.Tensor) -> Any:
        if which in self._proven:
            return self.fns[which](*args)
        try:  # the compiler fails before any of its kernels runs: nothing has been written yet
            out = self.fns[which](*args)
        except Exception as e:  # noqa: BLE001 - whatever the compiler raises: the same computation, eagerly
            warnings.warn(f"torch.compile of the decode layers failed ({type(e).__name__}: {e}); running them "
                          "eagerly", stacklevel=2)  # fmt: skip
            self.fns, self.compiled = self.eager, False
            out = self.fns[which](*args)
        self._proven.add(which)
        return out
