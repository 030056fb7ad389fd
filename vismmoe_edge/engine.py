"""Our own prefill layer loop and decode loop over transformers' decoder layers (Qwen3-VL-MoE, GLM-4.5V, DeepSeek-VL2).

transformers' `generate` cannot continue a sequence that was shortened mid-stack, and visual-token
compression needs exactly that, so the engine owns the loop: embeddings, M-RoPE positions computed once,
the DeepStack injections after the first layers (Qwen), a DynamicCache, sampling and streaming. What
differs per model family sits behind `PrefillOps` (vismmoe_edge/models/ops.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from PIL import Image
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from vismmoe_edge.checkpoint import ExpertCatalogue
from vismmoe_edge.compress.cut import cut_visual_tokens
from vismmoe_edge.compress.prune import CompressionConfig, CompressionReport
from vismmoe_edge.detokenize import TextStream
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import ExpertRuntime
from vismmoe_edge.experts.promotion import promotions_per_token
from vismmoe_edge.experts.replay import TraceReplay
from vismmoe_edge.experts.store import ShardFiles
from vismmoe_edge.finite import check_finite
from vismmoe_edge.kernels.dense_gemv import gemv_projections
from vismmoe_edge.kernels.mapped_prefetch import lookahead_per_layer
from vismmoe_edge.models.ops import PrefillOps, visual_features
from vismmoe_edge.prefix_cache import PrefixCache, restore_prefix
from vismmoe_edge.prefix_keys import cached_vision, has_video, keep_vision, patch_keys, pixel_keys, prompt_content
from vismmoe_edge.prompt import PromptInputs, encode_messages, encode_prompt, load_image
from vismmoe_edge.results import GenerationResult, Timings
from vismmoe_edge.sampling import Sampler, SamplingConfig
from vismmoe_edge.static_decode import StaticDecoder, capacity_for, compiles_layers, reads_host_in_place
from vismmoe_edge.step_context import StepContext
from vismmoe_edge.suffix_graph import SuffixGraphs
from vismmoe_edge.telemetry import TraceRecorder
from vismmoe_edge.trace import TraceWriter, load_trace
from vismmoe_edge.video import Clip


class StepObserver(Protocol):
    def begin_step(self, phase: str, num_tokens: int) -> None: ...
    def end_step(self, phase: str, token_index: int) -> None: ...


@dataclass
class DecodeState:
    cache: DynamicCache
    next_position: int  # decode positions continue the original numbering (max prompt position + 1)
    static: StaticDecoder | None = None  # the preallocated-cache decoder that took the cache over, if any


class Engine:
    """One loaded model. Not thread-safe: a server serialises requests in front of it."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        experts: ExpertRuntime,
        catalogue: ExpertCatalogue,
        context: StepContext,
        *,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids: list[int],
        is_demo: bool = False,
        pinned_layers: int = 0,
        ops: PrefillOps,
        files: ShardFiles | None = None,
    ) -> None:
        self.model = model
        self.files = files  # the shards' maps, unmapped by close()
        self.ops = ops  # the family's vision, positions and DeepStack
        self.processor = processor
        self.experts = experts
        self.catalogue = catalogue
        self.model_dir = model_dir
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = eos_token_ids
        self.is_demo = is_demo
        self.language_model = model.model.language_model
        self.text_config = self.language_model.config
        self.observers: list[StepObserver] = []  # trace recording, trace replay
        self.pinned_layers = pinned_layers  # MoE layers always resident: the prefix that sees every token
        self.compression = CompressionConfig()  # visual-token compression, applied right after that prefix
        self.last_compression: CompressionReport | None = None
        self.context = context  # what observers of a step read: tokens of interest, the visual summary
        # Decode over a preallocated KV cache, as CUDA graphs on CUDA: "auto" (on for CUDA and the families whose
        # layers it knows), "on" (eagerly on the CPU too: the check that it changes no token), "off".
        self.static_decode = "auto"
        self.cuda_graphs = os.environ.get("VISMMOE_CUDA_GRAPHS", "1") != "0"
        # The whole decode token on the device (static_decode.StaticDecoder.token_step): "auto" (on CUDA where
        # every expert stays in the slot pool and nothing observes the routing as it happens), "on", "off".
        self.device_decode = os.environ.get("VISMMOE_DEVICE_DECODE", "auto")
        # ... experts in no GPU slot read in place over the bus from the pinned host tier: "auto", "1", "0"
        self.device_decode_mapped: bool | str = os.environ.get("VISMMOE_DEVICE_DECODE_MAPPED", "auto")
        # ... its layers compiled (kernels/decode_layer.py): "auto" (CUDA with Triton), True or "1", False or "0"
        self.compile_decode: bool | str = os.environ.get("VISMMOE_COMPILE_DECODE", "auto")
        # ... launching each token before the host reads the one before it: "auto" (the pool holds every expert),
        # "on" (also where tokens may miss: the CPU tests of the discard path), "off"
        self.decode_ahead = os.environ.get("VISMMOE_DECODE_AHEAD", "auto")
        # ... experts read in place that move into GPU slots after a token, at most (0: none; experts/promotion.py)
        self.promotions_per_token = promotions_per_token(os.environ.get("VISMMOE_PROMOTIONS_PER_TOKEN"))
        # ... and the next layer's likely experts staged in HBM a layer ahead, at most (kernels/mapped_prefetch.py)
        self.mapped_lookahead = lookahead_per_layer(os.environ.get("VISMMOE_MAPPED_LOOKAHEAD"))
        self.decode_gemv = gemv_projections()  # ... its projections on Triton GEMVs (kernels/dense_gemv.py)
        self._decoders: dict[tuple, StaticDecoder] = {}  # (top-k, device, mapped, fused, Triton GEMVs, lookahead)
        self.suffix_graphs = SuffixGraphs(self)
        # Vision features and prompt-prefix KV kept across requests (None: off); the loader sizes it from the plan.
        self.prefix_cache: PrefixCache | None = None

    def close(self) -> None:
        """Stop the expert I/O and predictor threads and unmap the shards no tensor views any more; the engine is
        not used after. A service that reloads models calls it (or `with vismmoe_edge.load(...) as engine:`)."""
        rt = self.experts
        if rt.predictor_worker is not None:
            rt.predictor_worker.close()
        for decoder in [d for d in self._decoders.values() if d.on_device]:  # a token in flight reads the slots
            decoder.settle()
        rt.pipeline.close()
        self._decoders.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.files is not None:
            self.files.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def interest_rows(self) -> torch.Tensor | None:
        return self.context.interest_rows

    @interest_rows.setter
    def interest_rows(self, rows: torch.Tensor | None) -> None:
        self.context.interest_rows = rows

    @property
    def visual_summary(self) -> torch.Tensor | None:
        return self.context.visual_summary

    @visual_summary.setter
    def visual_summary(self, summary: torch.Tensor | None) -> None:
        self.context.visual_summary = summary

    @property
    def compression(self) -> CompressionConfig:
        return self._compression

    @compression.setter
    def compression(self, config: CompressionConfig) -> None:
        # Refused here, where every caller (run, serve, analyze, calibrate) sets it, not mid-request.
        if config.method != "none" and not self.ops.supports_compression:
            raise VismmoeError(f"--compressor {config.method}: visual-token compression is not supported for "
                               f"{self.ops.model_type} yet; use --compressor none")  # fmt: skip
        self._compression = config

    # ---- inputs -------------------------------------------------------------------------------------
    def encode(
        self, prompt: str, images: list[str | Path | Image.Image] | None = None, videos: list[Clip] | None = None
    ) -> PromptInputs:
        loaded = [img if isinstance(img, Image.Image) else load_image(img) for img in images or []]
        return self._keyed(encode_prompt(self.processor, prompt, loaded, videos or []), loaded)

    def encode_messages(
        self,
        messages: list[dict[str, Any]],
        images: list[str | Path | Image.Image] | None = None,
        videos: list[Clip] | None = None,
    ) -> PromptInputs:
        """A multi-turn conversation; its `{"type": "image"}` parts take `images` in order, `{"type": "video"}`
        parts `videos` (clips of frames: vismmoe_edge/video.py)."""
        loaded = [img if isinstance(img, Image.Image) else load_image(img) for img in images or []]
        return self._keyed(encode_messages(self.processor, messages, loaded, videos or []), loaded)

    def _keyed(self, inputs: PromptInputs, images: list[Image.Image]) -> PromptInputs:
        """With a prefix cache, each image addressed by its decoded pixels (prefix_keys.pixel_keys)."""
        if self.prefix_cache is not None and images and inputs.pixel_values is not None:
            inputs.image_keys = pixel_keys(self.prefix_cache, self.processor, images)
        return inputs

    def _attention_kernels(self) -> contextlib.AbstractContextManager:
        """On CUDA, keep SDPA off the cuDNN backend: it builds a new graph for every KV length, which made each
        decode step's attention cost ~30 ms on an H200 with torch 2.11 (tools/bench/profile_decode.py)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    # ---- prefill ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(
        self, inputs: PromptInputs, timings: Timings | None = None, *, use_cache: bool = True
    ) -> tuple[torch.Tensor, DecodeState]:
        """Run the prompt through every layer; return last-position logits [vocab] and the decode state. With a
        prefix cache (and `use_cache`), the images' vision features and the KV of the longest prompt prefix seen
        before are reused, and only the rest of the prompt is prefilled (prefix_cache.py)."""
        with self._attention_kernels():
            return self._prefill(inputs, timings or Timings(), use_cache)

    def _prefill(self, inputs: PromptInputs, timings: Timings, use_cache: bool) -> tuple[torch.Tensor, DecodeState]:
        lm = self.language_model
        input_ids = inputs.input_ids.to(self.device)
        video = inputs.pixel_values_videos is not None
        compress = self.compression.method != "none" and inputs.has_images and not video
        cache_on = self.prefix_cache is not None and use_cache
        # Under compression the layers after the pinned prefix run on a shortened sequence chosen from the whole
        # prompt, so no prefix KV is reused or kept; a replayed trace is indexed by prompt position. Clips are
        # not addressed by content: a prompt with one neither reuses nor keeps anything.
        replayed = self.experts.replay is not None
        reuse_kv = cache_on and not compress and not replayed and not has_video(self.model.config, input_ids)
        keys: list[str] = []
        if cache_on and inputs.has_images and not video:
            keys = inputs.image_keys or patch_keys(inputs, self.prefix_cache.salt)  # type: ignore[union-attr]
        content = None
        if reuse_kv:
            counts = self.ops.visual_token_counts(self.model, inputs.image_grid_thw) if keys else []
            content = prompt_content(input_ids, self.model.config.image_token_id, keys, counts)
        entry, reused = self.prefix_cache.match(content) if content is not None else (None, 0)  # type: ignore[union-attr]
        timings.prefix_reused_tokens = reused
        for observer in self.observers:
            observer.begin_step("prefill", input_ids.shape[1] - reused)
        hidden = lm.embed_tokens(input_ids[:, reused:])
        visual_mask = None
        deepstack: list[torch.Tensor] = []
        self.last_compression = None
        if video and self.compression.method != "none":
            note = "not applied: video tokens are not compressed"
            self.last_compression = CompressionReport(method=self.compression.method, note=note)
        self.interest_rows = self.visual_summary = None
        saliency, suffix_visual = None, 0
        if inputs.has_images or video:
            start = time.perf_counter()
            grid = inputs.image_grid_thw.to(self.device) if inputs.has_images else None
            if compress and self.compression.needs_saliency:
                saliency = self.ops.saliency(self.model, grid)  # hooks the family's vision tower during the forward
            visual = inputs.vision  # a seen frame's, taken at encoding (seen_frames.py)
            if visual is None and keys and saliency is None:
                visual = cached_vision(self.prefix_cache, keys)  # type: ignore[arg-type]
            if visual is None:
                with saliency if saliency is not None else contextlib.nullcontext():
                    visual, full_mask = visual_features(self.ops, self.model, inputs, input_ids, grid, self.dtype)
                if keys:
                    counts = self.ops.visual_token_counts(self.model, grid)
                    keep_vision(self.prefix_cache, keys, visual, counts)  # type: ignore[arg-type]
            else:
                timings.vision_cached_images = len(keys)
                full_mask = input_ids == self.model.config.image_token_id
            timings.vision_s = time.perf_counter() - start
            image_embeds = visual.embeds.to(hidden.dtype)  # images' and clips' tokens, in prompt order
            if int(full_mask.sum()) != image_embeds.shape[0]:
                raise ValueError(
                    f"prompt has {int(full_mask.sum())} visual tokens, images and videos give {image_embeds.shape[0]}"
                )
            before = int(full_mask[:, :reused].sum())  # visual tokens whose KV the cache gave
            suffix_visual = image_embeds.shape[0] - before
            deepstack = [features[before:] for features in visual.deepstack]
            visual_mask = full_mask[:, reused:]
            hidden = hidden.masked_scatter(visual_mask.unsqueeze(-1), image_embeds[before:])
            self.interest_rows, self.visual_summary = visual_mask[0], image_embeds.float().mean(dim=0)
            video_grid = inputs.video_grid_thw.to(self.device) if video else None
            mm_types = inputs.mm_token_type_ids.to(self.device)
            positions = self.ops.rope_positions(self.model, input_ids, mm_types, grid, video_grid=video_grid)
        else:
            positions = torch.arange(input_ids.shape[1], device=self.device).view(1, 1, -1).expand(3, 1, -1)
        next_position = int(positions.max()) + 1  # decode continues the uncompressed numbering
        positions = positions[..., reused:]

        # the suffix after a reused prefix, replayed from a CUDA graph where it can be (suffix_graph.py)
        from_graph = None
        if entry is not None:
            from_graph = self.suffix_graphs.prefill(hidden, positions, entry.keys, entry.values, reused, suffix_visual)
        cos_sin, mask = None, None  # the layers' rotary angles and mask, where they run below
        if from_graph is not None:
            (hidden, cache), timings.suffix_graph_tokens = from_graph, hidden.shape[1]
        else:
            cache = DynamicCache(config=self.text_config)  # (built only here: ~1.5 ms of config lookups at 30B)
            if entry is not None:
                restore_prefix(cache, entry.keys, entry.values, reused)
            cos_sin = self.ops.rotary(lm, hidden, positions)
            ones = torch.ones(input_ids.shape, dtype=torch.long, device=self.device)
            mask = create_causal_mask(config=self.text_config, inputs_embeds=hidden, attention_mask=ones, cache=cache)
        cut_at = self._cut_layer() if compress else -1
        if cut_at >= len(lm.layers):
            note = "every MoE layer is pinned: no layer after the prefix is left to run on fewer tokens"
            self.last_compression = CompressionReport(method=self.compression.method, note=note)
        prefix_routes: dict[int, torch.Tensor] = {}
        route_hook = None
        if compress and self.compression.method == "affinity" and self.pinned_layers > 0:
            prefix = set(self.catalogue.moe_layers[: self.pinned_layers])

            def route_hook(layer: int, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
                if layer in prefix:
                    prefix_routes[layer] = index.detach()

            self.experts.route_hooks.append(route_hook)
        try:
            for i, layer in enumerate(lm.layers if from_graph is None else []):
                if i == cut_at:
                    start = time.perf_counter()
                    done = cut_visual_tokens(
                        self.compression, self.ops.visual_token_counts(self.model, grid),
                        self.ops.droppable_tokens(self.model, grid), hidden, positions, cache, visual_mask,
                        deepstack, saliency, prefix_routes, self.catalogue.moe_layers[: self.pinned_layers], i,
                    )  # fmt: skip
                    hidden, positions, deepstack = done.hidden, done.positions, done.deepstack
                    visual_mask = done.visual_mask
                    self.last_compression = done.report
                    kept_visual = done.report.kept_visual_mask
                    self.interest_rows = visual_mask[0]
                    self.visual_summary = image_embeds[kept_visual.to(image_embeds.device)].float().mean(dim=0)
                    cos_sin = self.ops.rotary(lm, hidden, positions)
                    mask = create_causal_mask(
                        config=self.text_config,
                        inputs_embeds=hidden,
                        attention_mask=torch.ones(hidden.shape[:2], dtype=torch.long, device=self.device),
                        cache=None,  # the layers after the cut start from an empty cache of their own
                    )
                    timings.compress_s = self.last_compression.seconds = time.perf_counter() - start
                hidden = layer(hidden, attention_mask=mask, cache=cache, position_embeddings=cos_sin)
                hidden = self.ops.after_layer(lm, i, hidden, visual_mask, deepstack)
        finally:
            if route_hook is not None:
                self.experts.route_hooks.remove(route_hook)
        logits = self.model.lm_head(lm.norm(hidden[:, -1:]))[0, -1]
        self.experts.pipeline.count_pinned_hits()  # pinned layers count theirs on the device (pinned_forward)
        if content is not None and bool(torch.isfinite(logits).all()):  # for later requests that start the same way
            self.prefix_cache.store(  # type: ignore[union-attr]
                content, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
            )
        for observer in self.observers:
            observer.end_step("prefill", 0)
        self.interest_rows = None  # decode steps carry one token
        return logits, DecodeState(cache=cache, next_position=next_position)

    def _cut_layer(self) -> int:
        """The decoder layer before which visual tokens are dropped: the first one after the pinned prefix."""
        if self.pinned_layers == 0:
            return 0
        return self.catalogue.moe_layers[self.pinned_layers - 1] + 1

    # ---- decode -------------------------------------------------------------------------------------
    def uses_static_decode(self) -> bool:
        """The static decoder computes a token's experts from the slot pool, so it needs a pool with room for them."""
        pipeline = self.experts.pipeline
        streams = len(pipeline.pinned) < len(self.catalogue.experts)
        room = pipeline.capacity >= self.context.top_k or not streams
        has_pool = pipeline.tier.pool is not None and room
        if self.static_decode == "off" or not has_pool or not self.ops.static_decode:
            return False
        return self.static_decode == "on" or self.device.type == "cuda"

    def uses_device_decode(self) -> bool:
        """Routing read on the device through the expert table needs nothing to watch it per layer (a predictor,
        route hooks) and, under "auto", a pool that never misses (every expert resident, or every other one
        readable in place from the host tier, `reads_host_in_place`): a miss redoes a token."""
        rt = self.experts
        if self.device_decode == "off" or rt.predictor is not None or rt.predictor_worker is not None or rt.route_hooks:
            return False
        if self.device_decode == "on":
            return True
        resident = len(rt.pipeline.pinned) + rt.pipeline.capacity >= len(self.catalogue.experts)
        in_place = self.device_decode_mapped == "auto" and reads_host_in_place("auto", self)
        return self.device.type == "cuda" and (resident or in_place)

    def start_decode(self, state: DecodeState, max_new_tokens: int) -> None:
        """Hand the prefill's cache to the preallocated-cache decoder: one a mode, at the largest KV capacity asked so
        far, serving every shorter request too, so its KV stays within the plan's (the longest context)."""
        if not self.uses_static_decode():
            return
        replay = self.experts.replay
        routed_k = replay.trace.top_k if replay is not None else self.context.top_k
        capacity = capacity_for(max(layer.keys.shape[2] for layer in state.cache.layers) + max_new_tokens + 1)
        on_device = self.uses_device_decode()
        mapped = on_device and reads_host_in_place(self.device_decode_mapped, self)
        fused = on_device and compiles_layers(self.compile_decode, self.device)
        mode = (routed_k, on_device, mapped, fused, self.decode_gemv if fused else frozenset(), self.mapped_lookahead)
        decoder = self._decoders.get(mode)
        if decoder is None or decoder.cache.capacity < capacity:
            if (old := self._decoders.pop(mode, None)) is not None and old.on_device:
                old.settle()  # a token launched ahead may still read its buffers
            old = decoder = None  # its buffers and graphs are freed before the new ones are allocated
            graphs = self.cuda_graphs and self.device.type == "cuda"
            decoder = self._decoders[mode] = StaticDecoder(
                self, state.cache, capacity, routed_k, graphs=graphs, on_device=on_device, mapped=mapped, fused=fused
            )
        decoder.start(state.cache)
        state.static = decoder

    @torch.inference_mode()
    def decode_step(self, token_id: int, state: DecodeState) -> torch.Tensor:
        """One token through every layer; returns the next-token logits [vocab]."""
        with self._attention_kernels():
            if state.static is not None:
                return self._static_step(token_id, state)
            return self._decode_step(token_id, state)

    def _static_step(self, token_id: int, state: DecodeState) -> torch.Tensor:
        decoder = state.static
        assert decoder is not None
        past = decoder.host_length
        for observer in self.observers:
            observer.begin_step("decode", 1)
        logits = decoder.step(token_id, state.next_position)
        state.next_position += 1
        for observer in self.observers:
            observer.end_step("decode", past)
        return logits

    @torch.inference_mode()
    def device_token(
        self, token_id: int, state: DecodeState, sampling: SamplingConfig, produced: int, *, ahead: bool = False
    ) -> tuple[int, bool]:
        """One token through every layer and the sampler on the device; returns (next token, logits finite).
        `ahead`: another token will follow unless this one stops the reply (StaticDecoder.token_step)."""
        decoder = state.static
        assert decoder is not None and decoder.on_device
        for observer in self.observers:
            observer.begin_step("decode", 1)
        with self._attention_kernels():
            token, finite = decoder.token_step(token_id, state.next_position, sampling, produced, ahead=ahead)
        state.next_position += 1
        for observer in self.observers:
            observer.end_step("decode", decoder.host_length - 1)
        return token, finite

    def _decode_step(self, token_id: int, state: DecodeState) -> torch.Tensor:
        lm = self.language_model
        past = state.cache.get_seq_length()
        for observer in self.observers:
            observer.begin_step("decode", 1)
        hidden = lm.embed_tokens(torch.tensor([[token_id]], device=self.device))
        positions = torch.full((3, 1, 1), state.next_position, device=self.device, dtype=torch.long)
        cos_sin = self.ops.rotary(lm, hidden, positions)
        mask = create_causal_mask(
            config=self.text_config,
            inputs_embeds=hidden,
            attention_mask=torch.ones((1, past + 1), dtype=torch.long, device=self.device),
            cache=state.cache,
        )
        for layer in lm.layers:
            hidden = layer(hidden, attention_mask=mask, cache=state.cache, position_embeddings=cos_sin)
        state.next_position += 1
        logits = self.model.lm_head(lm.norm(hidden))[0, -1]
        for observer in self.observers:
            observer.end_step("decode", past)
        return logits

    # ---- telemetry and replay ----------------------------------------------------------------------
    def write_trace(self, path: str | Path) -> TraceWriter:
        """Record every step's routed experts and pipeline counters to a JSONL file (close it when done)."""
        writer = TraceWriter(path)
        catalogue = self.catalogue
        top_k = self.language_model.layers[catalogue.moe_layers[0]].mlp.gate.top_k
        recorder = TraceRecorder(self.experts, writer, model=str(self.model_dir), num_experts=catalogue.num_experts,
                                 moe_layers=catalogue.moe_layers, top_k=top_k)  # fmt: skip
        self.observers.append(recorder)
        return writer

    def replay_routing(self, path: str | Path, *, start_token: int = 0) -> TraceReplay:
        """Take routed expert ids from a trace file instead of the router (benchmarks on synthetic weights)."""
        catalogue = self.catalogue
        replay = TraceReplay(load_trace(path), catalogue.moe_layers, catalogue.num_experts, start_token=start_token)
        self.experts.replay = replay
        self.observers.insert(0, replay)
        return replay

    # ---- generation ---------------------------------------------------------------------------------
    def stream(
        self,
        inputs: PromptInputs,
        sampling: SamplingConfig | None = None,
        *,
        timings: Timings | None = None,
        should_stop: Callable[[], bool] | None = None,
        use_cache: bool = True,
    ) -> Iterator[int]:
        """Yield token ids as they are produced. `should_stop` is polled between tokens (cancellation);
        `use_cache=False` neither reads nor fills the prefix cache for this request."""
        sampling = sampling or SamplingConfig()
        sampling.validate()
        stop_ids = self.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids
        sampler = Sampler(sampling, stop_ids)
        timings = timings if timings is not None else Timings()
        start = time.perf_counter()
        logits, state = self.prefill(inputs, timings, use_cache=use_cache)
        self._check_finite(logits, "prefill", self.prefill, inputs)
        token = sampler(logits, 0)
        timings.prefill_s = time.perf_counter() - start
        yield token
        try:
            yield from self._decode_loop(token, state, sampling, sampler, stop_ids, timings, should_stop)
        finally:
            if state.static is not None and state.static.on_device:
                state.static.settle()  # a token launched ahead of a stop: nobody reads it

    def _decode_loop(
        self,
        token: int,
        state: DecodeState,
        sampling: SamplingConfig,
        sampler: Sampler,
        stop_ids: list[int],
        timings: Timings,
        should_stop: Callable[[], bool] | None,
    ) -> Iterator[int]:
        produced = 1
        decode_start = time.perf_counter()
        if sampling.max_new_tokens > 1 and token not in stop_ids:  # after the first token: a capacity's first
            self.start_decode(state, sampling.max_new_tokens)  # request builds its decoder (~1-2 s at 30B, H200)
        while produced < sampling.max_new_tokens and token not in stop_ids:
            if should_stop is not None and should_stop():
                return
            position = state.next_position
            decoder = state.static
            if decoder is not None and decoder.on_device and not sampling.logits_processors:
                if produced == 1:
                    decoder.sampler.seed(sampling.seed)
                    decoder.sampler.set_stops(stop_ids)
                previous = token
                ahead = produced + 1 < sampling.max_new_tokens
                token, finite = self.device_token(previous, state, sampling, produced, ahead=ahead)
                if not finite:  # the per-layer replay names the layer
                    self._check_finite(torch.tensor([float("nan")]), f"decode step {produced}",
                                       self._replay_decode, previous, state, position)  # fmt: skip
            else:
                logits = self.decode_step(token, state)
                self._check_finite(logits, f"decode step {produced}", self._replay_decode, token, state, position)
                token = sampler(logits, produced)
            produced += 1
            timings.decode_tokens += 1
            timings.decode_s = time.perf_counter() - decode_start
            yield token

    def _check_finite(self, logits: torch.Tensor, step: str, replay: Callable[..., object], *args: Any) -> None:
        check_finite(self.language_model, logits, step, replay, *args)

    def _replay_decode(self, token: int, state: DecodeState, position: int) -> None:
        state.cache.crop(-1)  # undo the failed step's KV entry, then run it again
        state.next_position = position
        self.decode_step(token, state)

    def generate(
        self,
        prompt: str,
        images: list[str | Path | Image.Image] | None = None,
        sampling: SamplingConfig | None = None,
        *,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Generate a reply to `prompt` about `images`; `on_text` receives text pieces as they are decoded."""
        inputs = self.encode(prompt, images)
        return self.generate_from_inputs(inputs, sampling, on_text=on_text, should_stop=should_stop)

    def generate_from_inputs(
        self,
        inputs: PromptInputs,
        sampling: SamplingConfig | None = None,
        *,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        use_cache: bool = True,
    ) -> GenerationResult:
        sampling = sampling or SamplingConfig()
        stop_ids = self.eos_token_ids if sampling.stop_token_ids is None else sampling.stop_token_ids
        self.experts.pipeline.reset_stats()
        timings = Timings()
        tokens: list[int] = []
        text = TextStream(self.processor.tokenizer)
        for token in self.stream(inputs, sampling, timings=timings, should_stop=should_stop, use_cache=use_cache):
            tokens.append(token)
            piece = text.push(token) if token not in stop_ids else ""
            if on_text is not None and piece:
                on_text(piece)
        if on_text is not None and (tail := text.finish()):
            on_text(tail)
        full = len(tokens) >= sampling.max_new_tokens
        reason = "stop_token" if tokens and tokens[-1] in stop_ids else "max_new_tokens" if full else "cancelled"
        return GenerationResult(prompt_token_ids=inputs.input_ids[0].tolist(), token_ids=tokens, text=text.text,
                                stop_reason=reason, timings=timings, experts=self.experts.pipeline.stats.as_dict(),
                                compression=self.last_compression)  # fmt: skip
