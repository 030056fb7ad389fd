"""Decode with a preallocated KV cache and, on CUDA, as CUDA graphs replayed between routing decisions.

Between two routing decisions a decode step is fixed-shape work: norms, attention over the KV cache, the
router, and (once the host knows where the routed experts sit) the experts from their slots. Each piece is
captured once as a `torch.cuda.CUDAGraph` and replayed, so a layer costs the host two graph launches instead
of ~70 kernel launches. The host still learns each MoE layer's routed experts, because it decides what to
fetch: one asynchronous copy of the top-k ids into pinned memory and one event per layer are the step's only
synchronisations. No compiler is involved (torch.compile needs Triton, which JetPack's torch may lack).

The layers are transformers' own modules: attention is the model's attention module writing through
`StaticCache.update`, so numerics match the eager path. The decoder layer's body (norm, attention, residual,
norm, router, experts, residual) is spelled out here for the Qwen3-VL-MoE layer shape; families whose MoE block
adds shared experts or other routers keep the eager path (`supports_static_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from vismmoe_edge.experts.compute import OffloadedExperts

# KV capacity grows in steps of this many tokens, so that a few capture sizes serve every request length.
CAPACITY_STEP = 512


def supports_static_decode(model: Any) -> bool:
    """True for Qwen3-VL-MoE: a layer is norm, attention, norm, then a routed-experts block with no shared experts."""
    return getattr(getattr(model, "config", None), "model_type", "") == "qwen3_vl_moe"


def capacity_for(tokens: int) -> int:
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


class StaticCache:
    """Per-layer K/V buffers of a fixed capacity and, per layer, the number of positions filled.

    Layers may hold different lengths: after visual-token compression the layers past the pinned prefix saw
    fewer tokens. `update` is what transformers' attention modules call; it writes the new position in place.
    """

    def __init__(self, prefill: DynamicCache, capacity: int) -> None:
        layers = prefill.layers
        first = layers[0].keys
        batch, heads, _, dim = first.shape
        self.capacity = capacity
        self.keys = [torch.zeros(batch, heads, capacity, dim, dtype=first.dtype, device=first.device) for _ in layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        lengths = [layer.keys.shape[2] for layer in layers]
        if max(lengths) >= capacity:
            raise ValueError(f"KV capacity {capacity} cannot hold {max(lengths)} prompt positions and a new one")
        for i, layer in enumerate(layers):
            self.keys[i][:, :, : lengths[i]] = layer.keys
            self.values[i][:, :, : lengths[i]] = layer.values
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=first.device)  # filled positions per layer
        self.positions = torch.arange(capacity, device=first.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        at = self.lengths[layer_idx : layer_idx + 1]
        self.keys[layer_idx].index_copy_(2, at, key_states)
        self.values[layer_idx].index_copy_(2, at, value_states)
        return self.keys[layer_idx], self.values[layer_idx]

    def mask(self, layer_idx: int, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, 1, capacity]: 0 where this layer holds a position (the new one included), -inf elsewhere."""
        visible = self.positions <= self.lengths[layer_idx]
        zeros = torch.zeros(self.capacity, dtype=dtype, device=self.positions.device)
        return zeros.masked_fill(~visible, torch.finfo(dtype).min).view(1, 1, 1, -1)

    def advance(self) -> None:
        self.lengths += 1


@dataclass
class StepBuffers:
    """Every tensor a captured graph reads or writes: the graphs always see these same addresses."""

    token: torch.Tensor  # [1, 1] long, on the device
    position: torch.Tensor  # [3, 1, 1] long
    hidden: torch.Tensor  # [1, 1, H]
    normed: torch.Tensor  # [1, 1, H]: the MoE block's input
    logits: torch.Tensor  # [vocab]
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    top_k_index: dict[int, torch.Tensor] = field(default_factory=dict)  # per MoE layer, [1, k] on the device
    top_k_weights: dict[int, torch.Tensor] = field(default_factory=dict)
    host_index: dict[int, torch.Tensor] = field(default_factory=dict)  # pinned copies the host reads
    host_weights: dict[int, torch.Tensor] = field(default_factory=dict)
    host_slots: dict[int, torch.Tensor] = field(default_factory=dict)  # pinned: the slot of each routed expert
    slots: dict[int, torch.Tensor] = field(default_factory=dict)  # their device copies
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # routing weights the experts are mixed by


class StaticDecoder:
    """The decode steps of one request, over a `StaticCache` filled from the prefill's cache.

    With `graphs` (CUDA only) each piece of a step is captured on first use of a capacity and replayed after;
    without, the same functions run eagerly (the CPU path, and the check that capture changes nothing).
    """

    def __init__(self, engine: Any, prefill_cache: DynamicCache, capacity: int, *, graphs: bool) -> None:
        self.engine = engine
        self.lm = engine.language_model
        self.device = engine.device
        self.cache = StaticCache(prefill_cache, capacity)
        self.graphs = graphs and self.device.type == "cuda"
        hidden_size = self.lm.config.hidden_size
        dtype = engine.dtype
        pinned = self.device.type == "cuda"
        self.b = StepBuffers(
            token=torch.zeros(1, 1, dtype=torch.long, device=self.device),
            position=torch.zeros(3, 1, 1, dtype=torch.long, device=self.device),
            hidden=torch.zeros(1, 1, hidden_size, dtype=dtype, device=self.device),
            normed=torch.zeros(1, 1, hidden_size, dtype=dtype, device=self.device),
            logits=torch.zeros(engine.model.lm_head.out_features, dtype=dtype, device=self.device),
        )
        self.host_token = torch.zeros(1, 1, dtype=torch.long, pin_memory=pinned)
        self.host_position = torch.zeros(3, 1, 1, dtype=torch.long, pin_memory=pinned)
        self.moe: dict[int, OffloadedExperts] = {}
        for i, layer in enumerate(self.lm.layers):
            experts = getattr(layer.mlp, "experts", None)
            if not isinstance(experts, OffloadedExperts):
                continue
            self.moe[i] = experts
            k = layer.mlp.gate.top_k
            b = self.b
            b.top_k_index[i] = torch.zeros(1, k, dtype=torch.long, device=self.device)
            b.top_k_weights[i] = torch.zeros(1, k, dtype=dtype, device=self.device)
            b.host_index[i] = torch.zeros(1, k, dtype=torch.long, pin_memory=pinned)
            b.host_weights[i] = torch.zeros(1, k, dtype=torch.float32, pin_memory=pinned)
            b.host_slots[i] = torch.zeros(1, k, dtype=torch.long, pin_memory=pinned)
            b.slots[i] = torch.zeros(1, k, dtype=torch.long, device=self.device)
            b.weights[i] = torch.zeros(1, k, dtype=dtype, device=self.device)
        self.routed = torch.cuda.Event() if self.device.type == "cuda" else None
        self._captured: dict[str, torch.cuda.CUDAGraph] = {}
        self._pool = None

    # ---- the pieces of a step (each one graph) ------------------------------------------------------------------
    def _embed(self) -> None:
        b = self.b
        b.token.copy_(self.host_token, non_blocking=True)
        b.position.copy_(self.host_position, non_blocking=True)
        b.hidden.copy_(self.lm.embed_tokens(b.token))
        cos, sin = self.engine.ops.rotary(self.lm, b.hidden, b.position)
        if b.cos_sin is None:
            b.cos_sin = (cos, sin)
        else:
            b.cos_sin[0].copy_(cos)
            b.cos_sin[1].copy_(sin)

    def _attention(self, i: int) -> None:
        """Norm, attention (writing this position's K/V), residual, norm, and for a MoE layer its router."""
        b, layer = self.b, self.lm.layers[i]
        h = layer.input_layernorm(b.hidden)
        mask = self.cache.mask(i, b.hidden.dtype)
        attn, _ = layer.self_attn(hidden_states=h, position_embeddings=b.cos_sin, attention_mask=mask, cache=self.cache)
        b.hidden.add_(attn)
        normed = layer.post_attention_layernorm(b.hidden)
        if i not in self.moe:  # a dense layer: its MLP is part of the same fixed-shape piece
            b.hidden.add_(layer.mlp(normed))
            return
        b.normed.copy_(normed)
        _, weights, index = layer.mlp.gate(normed.view(-1, normed.shape[-1]))
        b.top_k_index[i].copy_(index)
        b.top_k_weights[i].copy_(weights)
        b.host_index[i].copy_(index, non_blocking=True)
        b.host_weights[i].copy_(weights, non_blocking=True)

    def _experts(self, i: int) -> None:
        """The routed experts of this token from their slots, mixed by their weights, added to the residual."""
        b = self.b
        b.slots[i].copy_(b.host_slots[i], non_blocking=True)
        b.weights[i].copy_(b.host_weights[i], non_blocking=True)
        out = self.moe[i].pool_compute(b.normed.view(1, -1), b.slots[i], b.weights[i])
        b.hidden.add_(out.view_as(b.hidden))

    def _tail(self) -> None:
        b = self.b
        b.logits.copy_(self.engine.model.lm_head(self.lm.norm(b.hidden))[0, -1])
        self.cache.advance()

    # ---- running them -----------------------------------------------------------------------------------------
    def _run(self, name: str, fn: Any, *args: Any) -> None:
        if not self.graphs:
            fn(*args)
            return
        graph = self._captured.get(name)
        if graph is None:
            graph = self._capture(fn, *args)
            self._captured[name] = graph
        graph.replay()

    def _capture(self, fn: Any, *args: Any) -> torch.cuda.CUDAGraph:
        # A capture must not change state: warm up (allocator, cuBLAS handles) on the K/V-free copy of the state,
        # then undo what the warm-up wrote. Every piece only overwrites its buffers, except the cache's lengths.
        lengths = self.cache.lengths.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.cache.lengths.copy_(lengths)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            fn(*args)
        self.cache.lengths.copy_(lengths)  # capturing records the kernels; it must not count as a step
        return graph

    @torch.inference_mode()
    def step(self, token: int, position: int) -> torch.Tensor:
        """One token through every layer; returns the next-token logits [vocab] (a buffer reused by the next step)."""
        self.host_token.fill_(token)
        self.host_position.fill_(position)
        self._run("embed", self._embed)
        for i in range(len(self.lm.layers)):
            self._run(f"attention.{i}", self._attention, i)
            experts = self.moe.get(i)
            if experts is None:
                continue
            if self.routed is not None:
                self.routed.record()
                self.routed.synchronize()  # the host decides what to fetch from this layer's routing
            b = self.b
            slots = experts.prepare_pool_step(b.normed.view(1, -1), b.host_index[i], b.host_weights[i])
            b.host_slots[i].copy_(slots)
            self._run(f"experts.{i}", self._experts, i)
            experts.finish_pool_step()
        self._run("tail", self._tail)
        return self.b.logits


def prefill_cache_length(cache: DynamicCache) -> int:
    return max(layer.keys.shape[2] for layer in cache.layers)


def new_decoder(engine: Any, cache: DynamicCache, max_new_tokens: int, *, graphs: bool) -> StaticDecoder:
    return StaticDecoder(engine, cache, capacity_for(prefill_cache_length(cache) + max_new_tokens + 1), graphs=graphs)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
