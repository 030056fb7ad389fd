"""A short prompt part after a reused prefix (the next question about a frame whose KV the prefix cache holds),
prefilled by replaying a CUDA graph instead of launching each layer's ~110 kernels from Python.

Such a prefill is bound by the host on a large GPU: on the H200 (docs/benchmarks.md, run 8) 20 tokens after 1,094
reused took 0.105 s, more than a cold prefill of all 1,114 (0.093 s), since both launch the same kernels a layer
and the GPU waits for them. One graph is kept per (reused positions, padded length). The suffix is padded to a
power of two of at least 8 tokens with zero rows after the real ones: the causal mask keeps them out of every
real token's attention, their KV is cut off after the replay, their experts count no hits
(ExpertRuntime.counted_rows) and they are routed as the first row, so they read no expert of their own. Where the
decode layers compile (`engine.compile_decode`: CUDA with Triton), each layer's attention and router are the
explicit code of kernels/suffix_layer.py compiled by torch.compile (run 11: transformers' eager layers launched 94
kernels a layer into the graph), then the layer's own experts; the daemon compiles it before READY (`warm`).
Before a replay the suffix's embeddings, its rotary angles and each layer's reused KV are copied into the graph's
input buffers; after it, the last hidden state and each layer's KV are copied out, so nothing outside this module
keeps graph memory.

It applies (`SuffixGraphs.applies`) where every step inside the layers is a device op with no host
synchronisation: CUDA with graphs on, every MoE layer pinned in a slot pool of float experts
(OffloadedExperts.pinned_forward; a quantized pool's prefill reads its groups' bounds on the host, and so does a
GPU without torch's grouped GEMM, such as an Orin's sm_87), no predictor, route hook or replayed trace, no visual
token in the suffix, at most MAX_TOKENS tokens. Anything else, or a capture that fails, prefills eagerly (a failed
capture turns this off for the engine). `VISMMOE_SUFFIX_GRAPHS=0` turns it off.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from vismmoe_edge.experts.compute import OffloadedExperts
from vismmoe_edge.experts.pool_compute import grouped_mm_works
from vismmoe_edge.kernels.decode_layer import supports
from vismmoe_edge.kernels.suffix_layer import SuffixLayers
from vismmoe_edge.prefix_cache import restore_prefix
from vismmoe_edge.static_decode import capture_stream, compiles_layers

MAX_TOKENS = 64  # a longer suffix is less bound by the host, and each length would need its own graph
MIN_PADDED = 8
MAX_GRAPHS = 2  # each holds its KV outputs and activations (~0.35 GB at 30B-A3B with a 1,100-token prefix)
# (reused positions, suffix tokens) the daemon compiles before READY (`SuffixGraphs.warm`). The first two make
# torch.compile's code take any length (automatic dynamic shapes). On CUDA inductor then guards the attention
# mask's row stride, reused + padded positions, on alignment to 8 elements (the SDPA kernels' bias alignment:
# torch/_inductor/ir.py `is_aligned_realized_tensor`, "guard to recompile when necessary"): 24 + 8 and 40 + 16 are
# aligned, so run 13's first question after a frame (1,094 reused + 32) compiled again for 3 s. The third shape,
# 37 + 16 = 53, compiles the unaligned case too (run 14, an H200: tools/device/suffix_guard_check.py, a real
# follow-up compiled one graph for 5.3 s after the first two shapes and nothing after all three).
WARM_SHAPES = ((24, 8), (40, 16), (37, 16))
MASK_ALIGNMENT = 8


def padded_length(tokens: int) -> int:
    return max(MIN_PADDED, 1 << (tokens - 1).bit_length())


@dataclass
class SuffixGraph:
    """One captured suffix prefill: input buffers, the graph, and the outputs it writes on each replay."""

    reused: int
    hidden: torch.Tensor  # [1, P, H] in: the suffix's embeddings, zero rows after it
    cos: torch.Tensor  # in: rotary angles of the padded positions
    sin: torch.Tensor
    counted: torch.Tensor  # [P] bool in: the rows that are real tokens
    prefix_keys: list[torch.Tensor]  # in, per layer [1, heads, reused, dim]
    prefix_values: list[torch.Tensor]
    mask: torch.Tensor | None  # the padded causal mask (a constant of the graph)
    graph: torch.cuda.CUDAGraph | None = None  # None: run eagerly (tests on the CPU)
    out: torch.Tensor | None = None  # [1, P, H] out
    keys: list[torch.Tensor] | None = None  # out, per layer [1, heads, reused + P, dim]
    values: list[torch.Tensor] | None = None
    hit_counts: list[tuple[int, torch.Tensor]] | None = None  # out: (layer, distinct experts routed) per MoE layer


class SuffixGraphs:
    def __init__(self, engine: Any, *, capture: bool = True, explicit_layers: bool = False) -> None:
        self.engine = engine
        self.capture = capture  # False: the same padded steps eagerly (what the CPU tests check)
        self.explicit_layers = explicit_layers  # without capture: the explicit attention anyway (CPU tests)
        self.enabled = os.environ.get("VISMMOE_SUFFIX_GRAPHS", "1") != "0"
        self.graphs: OrderedDict[tuple[int, int], SuffixGraph] = OrderedDict()
        self.replays = 0
        self._moe: list[OffloadedExperts] | None = None  # the model's MoE layers, found on first use
        self._layers: SuffixLayers | None | bool = None  # kernels/suffix_layer.py's, decided on first use

    def applies(self, tokens: int, suffix_visual_tokens: int) -> bool:
        engine = self.engine
        rt = engine.experts
        if not self.enabled or (self.capture and (engine.device.type != "cuda" or not engine.cuda_graphs)):
            return False
        if not 1 <= tokens <= MAX_TOKENS or suffix_visual_tokens:
            return False
        if rt.predictor is not None or rt.predictor_worker is not None or rt.route_hooks or rt.replay is not None:
            return False
        pool = rt.pipeline.tier.pool
        if pool is None or pool.form is not None:  # quantized records: their prefill reads group bounds on the host
            return False
        if not grouped_mm_works(pool.gate_up.dtype, pool.gate_up.device):  # the per-slot path reads them too
            return False
        if self._moe is None:
            self._moe = [m for m in engine.language_model.modules() if isinstance(m, OffloadedExperts)]
        return bool(self._moe) and all(m.pinned_run() is not None for m in self._moe)

    def prefill(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        reused: int,
        visual_tokens: int,
    ) -> tuple[torch.Tensor, DynamicCache] | None:
        """hidden [1, T, H] the suffix's embeddings (`visual_tokens` of them an image's), positions [3, 1, T],
        `keys` and `values` per layer [1, heads, >= reused, dim] the cached prompt's KV (its first `reused`
        positions are the prefix). Returns the suffix's last hidden states [1, T, H] and a new cache of the prefix
        and the suffix; None where this does not apply or the capture failed (the caller prefills eagerly)."""
        tokens = hidden.shape[1]
        if not self.applies(tokens, visual_tokens):
            return None
        padded = padded_length(tokens)
        graph = self.graphs.get((reused, padded))
        if graph is None:
            graph = self._build(keys, values, reused, padded, hidden)
            if graph is None:
                return None
        self.graphs.move_to_end((reused, padded))
        engine, lm = self.engine, self.engine.language_model
        graph.hidden.zero_()
        graph.hidden[:, :tokens] = hidden
        extra = torch.arange(1, padded - tokens + 1, device=positions.device).view(1, 1, -1)
        cos, sin = engine.ops.rotary(lm, graph.hidden, torch.cat([positions, positions[..., -1:] + extra], dim=-1))
        graph.cos.copy_(cos)
        graph.sin.copy_(sin)
        graph.counted.copy_(torch.arange(padded, device=graph.counted.device) < tokens)
        # one launch for every layer's reused KV (96 copy kernels at 30B-A3B, each a launch before the replay's)
        prefix = [k[:, :, :reused] for k in keys] + [v[:, :, :reused] for v in values]
        torch._foreach_copy_(graph.prefix_keys + graph.prefix_values, prefix)
        if graph.graph is not None:
            graph.graph.replay()
        else:
            self._forward(graph, self._prefix_cache(graph))
        self.replays += 1
        pipeline = engine.experts.pipeline
        for layer, hits in graph.hit_counts:  # type: ignore[union-attr]
            pipeline.log_pinned_layer(layer, hits)  # read with the prefill's other counts
        out = DynamicCache(config=engine.text_config)
        for i, (k, v) in enumerate(zip(graph.keys, graph.values, strict=True)):  # type: ignore[arg-type]
            out.update(k[:, :, : reused + tokens], v[:, :, : reused + tokens], i)  # copies out of the graph
        return graph.out[:, :tokens].clone(), out  # type: ignore[index]

    def _build(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], reused: int, padded: int,
        suffix: torch.Tensor,
    ) -> SuffixGraph | None:  # fmt: skip
        engine, lm = self.engine, self.engine.language_model
        device = suffix.device
        hidden = suffix.new_zeros(1, padded, suffix.shape[-1])
        positions = torch.arange(reused, reused + padded, device=device).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = (t.clone() for t in engine.ops.rotary(lm, hidden, positions))
        prefix_keys = [k[:, :, :reused].clone() for k in keys]
        prefix_values = [v[:, :, :reused].clone() for v in values]
        shaped = DynamicCache(config=engine.text_config)
        restore_prefix(shaped, prefix_keys, prefix_values, reused)
        mask = create_causal_mask(
            config=engine.text_config,
            inputs_embeds=hidden,
            attention_mask=torch.ones((1, reused + padded), dtype=torch.long, device=device),
            cache=shaped,
        )
        if mask is None:  # an attention without a mask here would let real tokens see the padding
            self.enabled = False
            return None
        counted = torch.ones(padded, dtype=torch.bool, device=device)
        graph = SuffixGraph(reused, hidden, cos, sin, counted, prefix_keys, prefix_values, mask)
        if self.capture:
            try:
                graph.graph = self._capture(graph)
            except RuntimeError as e:  # an op that synchronises, or a capture this build refuses
                self.enabled = False
                torch.cuda.synchronize(device)
                warnings.warn(f"CUDA graph capture of a prompt suffix failed ({e}); prefilling eagerly", stacklevel=3)
                return None
        self.graphs[(reused, padded)] = graph
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return graph

    def _prefix_cache(self, graph: SuffixGraph) -> DynamicCache:
        """A cache whose layers start as views of the prefix buffers: made outside a capture (a layer's first use
        creates an empty tensor from a Python list, which a capture may refuse)."""
        cache = DynamicCache(config=self.engine.text_config)
        restore_prefix(cache, graph.prefix_keys, graph.prefix_values, graph.reused)
        return cache

    def _forward(self, graph: SuffixGraph, cache: DynamicCache) -> None:
        """The layers over the input buffers; sets the outputs (on a capture: the tensors each replay rewrites)."""
        engine, lm = self.engine, self.engine.language_model
        rt, pipeline = engine.experts, engine.experts.pipeline
        since = len(pipeline.pending_hits)
        rt.counted_rows = graph.counted
        angles = (graph.cos, graph.sin)
        explicit = self.suffix_layers()
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        try:
            hidden = graph.hidden
            for i, layer in enumerate(lm.layers):
                if explicit is None:  # transformers' layer
                    hidden = layer(hidden, attention_mask=graph.mask, cache=cache, position_embeddings=angles)
                else:  # attention and router as explicit tensor code (compiled on CUDA), then the layer's experts
                    prefix = (graph.prefix_keys[i], graph.prefix_values[i])
                    hidden, normed, k, v, index, weights = explicit.attend(i, hidden, angles, *prefix, graph.mask)
                    keys.append(k)
                    values.append(v)
                    rows = normed.view(-1, normed.shape[-1])  # as Qwen3VLMoeTextSparseMoeBlock hands them over
                    hidden = hidden + layer.mlp.experts(rows, index, weights).view_as(hidden)
                hidden = engine.ops.after_layer(lm, i, hidden, None, [])
        finally:
            rt.counted_rows = None
            graph.hit_counts = pipeline.unlog_pinned_layers(since)  # prefill() logs them on each run
        graph.out = hidden
        graph.keys = keys if explicit is not None else [layer.keys for layer in cache.layers]
        graph.values = values if explicit is not None else [layer.values for layer in cache.layers]

    @torch.inference_mode()  # as the engine's prefill runs: dynamo guards on grad mode, and recompiles (run 12)
    def warm(self, shapes: tuple[tuple[int, int], ...] = WARM_SHAPES) -> bool:
        """Build and drop suffix graphs of `shapes` (reused positions, suffix tokens) over zeros, where the
        explicit attention compiles: after two shapes torch.compile's code takes any length (automatic dynamic
        shapes), and the third compiles the mask's other alignment (WARM_SHAPES), so the first question after a
        cached frame does not wait seconds for the compiler (the daemon calls this before READY:
        serve/warmup.py). True where it compiled."""
        explicit = self.suffix_layers() if self.applies(MIN_PADDED, 0) else None
        if explicit is None or not explicit.compiled:
            return False
        engine, lm = self.engine, self.engine.language_model
        attention = lm.layers[0].self_attn
        for reused, tokens in shapes:
            like = torch.zeros(1, lm.config.num_key_value_heads, reused, attention.head_dim, device=engine.device,
                               dtype=engine.dtype)  # fmt: skip
            suffix = torch.zeros(1, tokens, lm.config.hidden_size, device=engine.device, dtype=engine.dtype)
            kv, padded = [like] * len(lm.layers), padded_length(tokens)
            graph = self._build(kv, kv, reused, padded, suffix)
            if graph is not None and graph.graph is None:  # not capturing (the CPU tests): the same steps eagerly
                self._forward(graph, self._prefix_cache(graph))
            self.graphs.pop((reused, padded), None)  # built for the compiler only
        return explicit.compiled

    def suffix_layers(self) -> SuffixLayers | None:
        """The explicit attention of kernels/suffix_layer.py, compiled, where the decode layers compile
        (`engine.compile_decode`: CUDA with Triton by default) and every layer is one it knows; else None."""
        if self._layers is None:
            engine = self.engine
            compiled = self.capture and compiles_layers(engine.compile_decode, engine.device)
            known = supports(engine.language_model, set(engine.catalogue.moe_layers))
            use = known and (compiled or self.explicit_layers)
            self._layers = SuffixLayers(engine.language_model, compile=compiled) if use else False
        return self._layers or None

    def _capture(self, graph: SuffixGraph) -> torch.cuda.CUDAGraph:
        """Warm up on the capture stream (allocator, library handles), then capture; the caller replays."""
        device = graph.hidden.device
        side = capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward(graph, self._prefix_cache(graph))
        torch.cuda.current_stream(device).wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        cache = self._prefix_cache(graph)
        with torch.cuda.graph(cuda_graph, stream=side, capture_error_mode="thread_local"):
            self._forward(graph, cache)
        return cuda_graph
