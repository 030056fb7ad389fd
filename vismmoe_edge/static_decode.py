"""Decode with a preallocated KV cache and, on CUDA, as CUDA graphs replayed between routing decisions.

Between two routing decisions a decode step is fixed-shape work: norms, attention over the KV cache, the
router, and (once the host knows where the routed experts sit) the experts from their slots. Each piece is
captured once as a `torch.cuda.CUDAGraph` and replayed, so a layer costs the host two graph launches instead
of ~70 kernel launches. The host still learns each MoE layer's routed experts, because it decides what to
fetch: one asynchronous copy of the top-k ids into pinned memory and one event per layer are the step's only
synchronisations. The per-layer path involves no compiler; on CUDA with Triton (which JetPack's torch may lack)
`engine.compile_decode` ("auto") compiles the device token's attention and router (kernels/decode_layer.py).

The layers are transformers' own modules: attention is the model's attention module writing through
`StaticCache.update`, so numerics match the eager path. The decoder layer's body (norm, attention, residual,
norm, router, experts, residual) is spelled out here for the Qwen3-VL-MoE layer shape; families whose MoE block
adds shared experts or other routers keep the eager path (the family's `PrefillOps.static_decode`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from vismmoe_edge.device_sampling import DeviceSampler
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.compute import OffloadedExperts
from vismmoe_edge.experts.promotion import count_host_reads, promote_host_reads
from vismmoe_edge.experts.table import ExpertTable
from vismmoe_edge.kernels.decode_layer import FusedLayers, aligned_rows, stack_every_qkv
from vismmoe_edge.kernels.decode_layer import supports as supports_fused
from vismmoe_edge.kernels.mapped_prefetch import Lookahead, Staging
from vismmoe_edge.kernels.moe_decode import HAS_TRITON, mapped_decode, moe_decode, pool_decode, use_triton
from vismmoe_edge.sampling import SamplingConfig
from vismmoe_edge.static_cache import StaticCache
from vismmoe_edge.switches import forced

# KV capacity grows in steps of this many tokens, so that a few capture sizes serve every request length.
CAPACITY_STEP = 512


def capacity_for(tokens: int) -> int:
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


def compiles_layers(mode: bool | str, device: torch.device) -> bool:
    """`engine.compile_decode` / VISMMOE_COMPILE_DECODE: "auto" compiles on CUDA with Triton; True or "1" always
    (a compiler failure still falls back to eager); False or "0" never."""
    choice = forced(mode, "VISMMOE_COMPILE_DECODE")
    return device.type == "cuda" and HAS_TRITON if choice is None else choice


def reads_host_in_place(mode: bool | str, engine: Any) -> bool:
    """`engine.device_decode_mapped` / VISMMOE_DEVICE_DECODE_MAPPED: whether a device token reads the experts no
    slot holds in place from the pinned host mirror (ExpertTable.map_host). True or "1": wherever it can; False or
    "0": never (a token that needs such an expert is redone per layer); "auto": where the slots cannot hold every
    expert and the mirror holds all of them slot-shaped, on CUDA with Triton (at 20 GiB on the H200: 38.7-40.8
    tok/s, against 18.6-22.0 redoing tokens and 20.6-21.6 on the per-layer path; docs/benchmarks.md)."""
    choice = forced(mode, "VISMMOE_DEVICE_DECODE_MAPPED")
    if choice is not None:
        return choice
    pipeline, catalogue = engine.experts.pipeline, engine.catalogue
    tier = pipeline.tier
    if engine.device.type != "cuda" or not HAS_TRITON or tier.mirror is None or tier.form is not None:
        return False
    if len(pipeline.pinned) + pipeline.capacity >= len(catalogue.experts):  # every expert fits: nothing to read
        return False
    mirrors_streamed = len(pipeline.pinned) + len(tier.mirror.keys) >= len(catalogue.experts)  # (it holds no pinned)
    return mirrors_streamed and use_triton(tier.gate_up) and tier.mirror.slot_shaped(tier.gate_up.dtype)


_capture_streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}


def capture_stream(device: torch.device, purpose: str = "capture") -> torch.cuda.Stream:
    """The one stream graphs are warmed up and captured on, from torch's high-priority pool (purpose "capture"), or
    the one a captured token forks its lookahead's copies onto ("lookahead": kernels/mapped_prefetch.py).

    torch hands out low-priority streams round-robin from a pool of 32 (c10/cuda/CUDAStream.h), so a stream taken
    per capture, or `torch.cuda.graph`'s shared default capture stream, sooner or later is the very CUDA stream an
    I/O thread copies on. That thread's DMA and slot event then land inside the capture (thread_local capture
    mode only relaxes checks, it does not keep other threads off the capturing stream), and the compute stream's
    later `wait_event` on the captured event fails with `invalid argument` (SlotPoolTier.ready). Nothing else in
    the package takes a high-priority stream (tests/test_capture_stream.py checks), and each is taken once.
    """
    stream = _capture_streams.get((device, purpose))
    if stream is None:
        stream = _capture_streams[(device, purpose)] = torch.cuda.Stream(device, priority=-1)
    return stream


@dataclass
class MoeBuffers:
    """One MoE layer's routing, on both sides of the bus."""

    router_index: torch.Tensor  # [1, k] long, the router's choice (device)
    router_weights: torch.Tensor  # [1, k]
    host_index: torch.Tensor  # pinned copies the host reads
    host_weights: torch.Tensor  # float32
    host_slots: torch.Tensor  # [1, r] pinned: the slot of each expert the token uses (r = k, or the trace's top-k)
    host_mix: torch.Tensor  # [1, r] float32: their weights
    slots: torch.Tensor  # device copies of the two above
    mix: torch.Tensor


@dataclass
class TokenOutputs:
    """What one device-side token (`StaticDecoder.token_step`) leaves in pinned memory for the host: views of one
    packed long buffer, so reading a token back is one copy."""

    token: torch.Tensor  # [1] long: the chosen next token
    finite: torch.Tensor  # [1]: 1 where the logits are all finite
    missed: torch.Tensor  # [moe layers]: 1 where the table said absent for one of the layer's experts
    routing: torch.Tensor  # [moe layers, r]: each MoE layer's routed experts, for the host's bookkeeping

    @classmethod
    def of(cls, packed: torch.Tensor, layers: int) -> TokenOutputs:
        return cls(packed[0:1], packed[1:2], packed[2 : 2 + layers], packed[2 + layers :].view(layers, -1))


@dataclass
class Launched:
    """A device token launched and not yet read back: the output buffer it writes, and what it was given. `token`
    is None until the token before it is read (it was launched on that token's choice, on the device)."""

    parity: int
    token: int | None
    position: int
    event: torch.cuda.Event | None


class StaticDecoder:
    """Decode steps over a `StaticCache`, for any request whose prompt and reply fit in `capacity` positions.

    With `graphs` (CUDA only) each piece of a step is captured on its first use and replayed after; without, the
    same functions run eagerly (the CPU path, and the check that capture changes nothing). One decoder serves
    request after request (`start` takes over each prefill's cache), so capture happens once per capacity.
    """

    def __init__(
        self,
        engine: Any,
        like: DynamicCache,
        capacity: int,
        routed_k: int,
        *,
        graphs: bool,
        on_device: bool = False,
        mapped: bool = False,
        fused: bool = False,
    ) -> None:
        self.engine = engine
        self.lm = engine.language_model
        self.device = engine.device
        self.cache = StaticCache(like, capacity)
        self.graphs = graphs and self.device.type == "cuda"
        on_gpu = self.device.type == "cuda"
        hidden_size, dtype = self.lm.config.hidden_size, engine.dtype

        def dev(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        def host(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=on_gpu)

        self.token, self.host_token = dev(1, 1, dtype=torch.long), host(1, 1, dtype=torch.long)
        self.position, self.host_position = dev(3, 1, 1, dtype=torch.long), host(3, 1, 1, dtype=torch.long)
        self.hidden, self.normed = dev(1, 1, hidden_size), dev(1, 1, hidden_size)
        # an embedding read by row from the shard (quant/dense.py) is read on the host before the graph runs
        rows = self.lm.embed_tokens
        self.host_row = host(1, 1, hidden_size, dtype=dtype) if hasattr(rows, "host_rows") else None
        self.logits = dev(engine.model.lm_head.out_features)
        self.cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.moe: dict[int, OffloadedExperts] = {}
        self.buffers: dict[int, MoeBuffers] = {}
        for i, layer in enumerate(self.lm.layers):
            experts = getattr(layer.mlp, "experts", None)
            if isinstance(experts, OffloadedExperts):
                k = layer.mlp.gate.top_k
                self.moe[i] = experts
                self.buffers[i] = MoeBuffers(
                    dev(1, k, dtype=torch.long), dev(1, k), host(1, k, dtype=torch.long),
                    host(1, k, dtype=torch.float32), host(1, routed_k, dtype=torch.long),
                    host(1, routed_k, dtype=torch.float32), dev(1, routed_k, dtype=torch.long), dev(1, routed_k),
                )  # fmt: skip
        self.routed = torch.cuda.Event() if on_gpu else None
        self.on_device = on_device
        if on_device:
            self._init_on_device(routed_k, on_gpu, mapped)
        # the device token's attention and router as explicit tensor code, compiled on CUDA (eager elsewhere: the
        # CPU check that it is transformers' computation)
        if on_gpu and supports_fused(self.lm, set(self.moe)):
            # before this decoder captures anything: a compiled decoder made later stacks q, k and v, which would
            # move those weights under every graph captured before it (an illegal address at the next replay)
            stack_every_qkv(self.lm)
        self.fused: FusedLayers | None = None
        self.no_experts: torch.Tensor | None = None
        if fused and on_device and supports_fused(self.lm, set(self.moe)):
            compile = on_gpu and HAS_TRITON
            if on_gpu and not compile:
                warnings.warn("torch.compile needs Triton: the decode layers run eagerly", stacklevel=2)
            self.fused = FusedLayers(self.lm, compile=compile, gemv=engine.decode_gemv)
            # the first layer's "previous experts": zeros of the shape the Triton path gives, an inference tensor
            # as the later layers' rows are (torch.compile guards the dispatch keys: else two compilations)
            with torch.inference_mode():
                self.no_experts = dev(routed_k, hidden_size, dtype=torch.float32)
        self.graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.host_length = 0  # layer 0's filled positions, known on the host without a sync

    def start(self, prefill: DynamicCache) -> None:
        if self.on_device:
            self.settle()
        self.cache.fill(prefill)
        self.host_length = prefill.layers[0].keys.shape[2]

    # ---- the pieces of a step (each one graph) ------------------------------------------------------------------
    def _embed(self) -> None:
        self.token.copy_(self.host_token, non_blocking=True)
        self.position.copy_(self.host_position, non_blocking=True)
        if self.host_row is not None:
            self.hidden.copy_(self.host_row, non_blocking=True)
        else:
            self.hidden.copy_(self.lm.embed_tokens(self.token))
        self._rotary()

    def _rotary(self) -> None:
        cos, sin = self.engine.ops.rotary(self.lm, self.hidden, self.position)
        if self.cos_sin is None:
            self.cos_sin = (cos.clone(), sin.clone())
        else:
            self.cos_sin[0].copy_(cos)
            self.cos_sin[1].copy_(sin)

    def _attend(self, i: int) -> torch.Tensor:
        """Norm, attention (writing this position's K/V), residual; returns the post-attention norm."""
        layer = self.lm.layers[i]
        h = layer.input_layernorm(self.hidden)
        mask = self.cache.mask(i, self.hidden.dtype)
        attn, _ = layer.self_attn(
            hidden_states=h, position_embeddings=self.cos_sin, attention_mask=mask, cache=self.cache
        )
        self.hidden.add_(attn)
        return layer.post_attention_layernorm(self.hidden)

    def _attention(self, i: int) -> None:
        """`_attend`, then for a MoE layer its router; for a dense layer its MLP too."""
        layer = self.lm.layers[i]
        normed = self._attend(i)
        if i not in self.moe:
            self.hidden.add_(layer.mlp(normed))
            return
        b = self.buffers[i]
        self.normed.copy_(normed)
        _, weights, index = layer.mlp.gate(normed.view(-1, normed.shape[-1]))
        b.router_index.copy_(index)
        b.router_weights.copy_(weights)
        b.host_index.copy_(index, non_blocking=True)
        b.host_weights.copy_(weights, non_blocking=True)

    def _experts(self, i: int) -> None:
        """The token's experts from their slots, mixed by their weights, added to the residual."""
        b = self.buffers[i]
        b.slots.copy_(b.host_slots, non_blocking=True)
        b.mix.copy_(b.host_mix, non_blocking=True)
        out = self.moe[i].pool_compute(self.normed.view(1, -1), b.slots, b.mix)
        self.hidden.add_(out.view_as(self.hidden))

    def _tail(self) -> None:
        self.logits.copy_(self.engine.model.lm_head(self.lm.norm(self.hidden))[0, -1])
        self.cache.advance()

    # ---- the whole token on the device (one graph) -----------------------------------------------------------
    def _init_on_device(self, routed_k: int, on_gpu: bool, mapped: bool) -> None:
        """Buffers of the device-side token: the expert table, the sampler, the routing to hand back, and under
        trace replay the routing handed in. `mapped`: read experts not in a slot from the pinned host mirror in
        place, where the mirror and the kernels allow it (ExpertTable.map_host), with `engine.mapped_lookahead` of
        the next layer's likely ones staged in HBM a layer ahead (kernels/mapped_prefetch.py)."""
        layers = self.moe_layers = sorted(self.moe)
        num_experts = self.engine.catalogue.num_experts
        self.table = ExpertTable(len(self.lm.layers), num_experts, self.device)
        self.mapped_experts = 0
        tier = self.engine.experts.pipeline.tier
        if mapped and on_gpu and tier.mirror is not None and tier.form is None and use_triton(tier.gate_up):
            self.mapped_experts = self.table.map_host(tier.mirror, self.engine.catalogue, tier.gate_up.dtype)
        self.lookahead: Lookahead | None = None
        if self.mapped_experts and (per_layer := self.engine.mapped_lookahead):
            down_at = tier.gate_up[0].numel()  # a record is gate_up then down, as the host mirror holds it
            record = down_at + tier.down[0].numel()
            staging = Staging.allocate(per_layer, record, down_at, tier.gate_up.dtype, self.device)
            self.lookahead = Lookahead(staging, capture_stream(self.device, "lookahead"), len(layers), self.normed[0])
        if mapped and not self.mapped_experts:
            warnings.warn("experts cannot be read in place from host memory here (needs CUDA, Triton, the pinned "
                          "host tier and an untransposed bf16/fp16 checkpoint): absent experts redo the token",
                          stacklevel=2)  # fmt: skip
        self.sampler = DeviceSampler(self.logits.shape[0], self.device)
        self.routing = torch.zeros(len(layers), routed_k, dtype=torch.long, device=self.device)
        self.missed = aligned_rows(len(layers), torch.bool, self.device)
        self.finite = torch.zeros(1, dtype=torch.bool, device=self.device)
        self.packed = torch.zeros(2 + len(layers) * (1 + routed_k), dtype=torch.long, device=self.device)
        # two pinned copies used in turn: a token launched ahead writes one while the host reads the other
        self.host_packed = [torch.zeros_like(self.packed, device="cpu", pin_memory=on_gpu) for _ in range(2)]
        self.done = [torch.cuda.Event() for _ in range(2)] if on_gpu else None
        self.parity = 0
        self.pending: Launched | None = None  # the token launched ahead, not yet read
        self.ran_ahead = 0  # tokens launched before the host read the token before them, and used
        self.discarded = 0  # tokens launched ahead and thrown away (a stop, a miss, other inputs)
        self.replay_index = torch.zeros_like(self.routing)
        self.replay_weights = torch.zeros(len(layers), routed_k, dtype=torch.float32, device=self.device)
        self.host_replay_index = torch.zeros(len(layers), routed_k, dtype=torch.long, pin_memory=on_gpu)
        self.host_replay_weights = torch.zeros(len(layers), routed_k, dtype=torch.float32, pin_memory=on_gpu)
        self.redone = 0  # tokens whose table lookup missed and that ran again through the per-layer path
        self.promoted = 0  # experts brought into slots after tokens read them from the host tier
        self.host_reads = 0  # routed experts that device tokens read in place from the host tier

    def _token(self) -> None:
        """Embed, every layer with its experts read through the table, the head, the next token: no host. The
        token's input is the device's `token` and `position` (the host's fill, or the previous token's choice), and
        it leaves its own choice there, so the next token can be launched before the host reads this one."""
        if self.host_row is not None:
            self.hidden.copy_(self.host_row, non_blocking=True)
        else:
            self.hidden.copy_(self.lm.embed_tokens(self.token))
        self._rotary()
        replay = self.engine.experts.replay is not None
        if replay:
            self.replay_index.copy_(self.host_replay_index, non_blocking=True)
            self.replay_weights.copy_(self.host_replay_weights, non_blocking=True)
        pool = self.engine.experts.pipeline.tier.pool
        fused = self.fused
        experts = self.no_experts  # fused: a layer's expert outputs, summed into the residual by the next attend
        for i in range(len(self.lm.layers)):
            layer = self.lm.layers[i]
            if fused is None:
                normed = self._attend(i)
            else:
                normed = fused.attend(i, experts, self.hidden, self.cos_sin, self.cache)
            if i not in self.moe:
                self.hidden.add_(layer.mlp(normed))
                continue
            m = self.moe_layers.index(i)
            x = normed.view(-1, normed.shape[-1])
            table_row = self.table.slots[i]
            host_row = None if self.table.host_addrs is None else self.table.host_addrs[i]
            act = self.moe[i].act_fn
            if replay:
                index, weights = self.replay_index[m : m + 1], self.replay_weights[m : m + 1]
            if fused is not None and host_row is None:  # router, table lookup and its record compiled
                if replay:
                    slots, _ = fused.lookup(index, table_row, self.routing[m], self.missed[m])
                else:
                    index, weights, slots, _ = fused.route(i, x, table_row, self.routing[m], self.missed[m])
                out = pool_decode(x, slots, weights, pool, act, summed=False)
            else:
                if fused is not None and not replay:  # the router kernel (its record writes the routing row)
                    index, weights, _, _ = fused.route(i, x, table_row, self.routing[m], self.missed[m])
                else:
                    if not replay:
                        _, weights, index = layer.mlp.gate(x)
                    self.routing[m].copy_(index[0])
                if host_row is not None:  # reading in place: a miss is an expert in no slot and not mapped
                    staged = self._look_ahead(m, x)
                    out, _ = mapped_decode(x, index, table_row, weights, host_row, pool, act, summed=fused is None,
                                           missed=self.missed[m], staged=staged)  # fmt: skip
                else:
                    out, missed = moe_decode(x, index, weights, table_row, pool, act)
                    self.missed[m].copy_(missed)
            if fused is None:
                self.hidden.add_(out.view_as(self.hidden))
            else:
                experts = out
        if fused is not None:
            self.hidden.add_(experts.sum(0).to(self.hidden.dtype).view_as(self.hidden))
        self._tail()
        self.sampler.choose(self.logits)
        self.finite.copy_(torch.isfinite(self.logits).all().view(1))
        self.token.copy_(self.sampler.token)
        self.position += 1
        parts = (self.sampler.token.view(1), self.finite.long(), self.missed.long(), self.routing.view(-1))
        self.packed.copy_(torch.cat(parts))

    def _look_ahead(self, m: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """MoE layer m's staged experts (waited for), after starting the next MoE layer's on the second stream."""
        if self.lookahead is None:
            return None
        staged = self.lookahead.staged(m)
        if m + 1 < len(self.moe_layers):
            nxt = self.moe_layers[m + 1]
            gate = self.lm.layers[nxt].mlp.gate
            self.lookahead.stage_next(m, x, gate.weight, self.table.slots[nxt], self.table.host_addrs[nxt], gate.top_k)
        return staged

    @torch.inference_mode()
    def token_step(
        self, token: int, position: int, sampling: SamplingConfig, produced: int, *, ahead: bool = False
    ) -> tuple[int, bool]:
        """One token through every layer and the sampler, as one graph; returns (next token, logits finite).

        The host's one synchronisation is the token's end (it needs the token for the stop check anyway). With
        `ahead` (the caller will want another token after this one) and where no token can miss
        (`runs_ahead`), the next token is launched on this one's choice before the host waits for this one, so the
        GPU never idles while the host reads a token back, checks it and launches the next; a stop token, or a
        caller that feeds something else, discards the token launched ahead (its KV position rolled back).

        A miss (the table said absent) discards the token: the KV position is rolled back and the token runs again
        on the per-layer path, which fetches what it needs; the table is synced before the next token.
        """
        pipeline = self.engine.experts.pipeline
        if self.sampler.configure(sampling):
            self.settle()  # the token launched ahead ran with the old knobs
        current = self._take(token, position)
        self.ran_ahead += current is not None
        if current is None:
            self.table.sync(pipeline)
            replay = self.engine.experts.replay
            if replay is not None:
                for m, layer in enumerate(self.moe_layers):
                    index, weights = replay.route(layer, 1)
                    self.host_replay_index[m].copy_(index[0])
                    self.host_replay_weights[m].copy_(weights[0].float())
            current = self._launch(token, position, produced)
        following = None
        if ahead and self.runs_ahead():  # (with host reads, the slots the last promotions filled are synced first)
            following = self._launch(None, position + 1, sync=bool(self.mapped_experts))
        out = self._read(current)
        if bool(out.missed.any()):
            if following is not None:
                self._discard(following)
            self.redone += 1
            self.cache.lengths -= 1  # the token's K/V are rewritten at the same position
            logits = self.step(token, position)  # counts the token in host_length
            self.sampler.count_from(produced)
            self.sampler.choose(logits)
            finite = bool(torch.isfinite(logits).all())
            return int(self.sampler.token), finite
        self.host_length += 1
        for m, layer in enumerate(self.moe_layers):  # after the fact: the eviction order sees this token's use
            pipeline.touch(layer, out.routing[m].tolist())
        if self.mapped_experts:  # experts read over the bus move into slots for later tokens
            self.host_reads += count_host_reads(self.table, self.moe_layers, out.routing)
            limit = self.engine.promotions_per_token
            self.promoted += promote_host_reads(pipeline, self.table, self.moe_layers, out.routing, limit=limit)
        chosen = int(out.token)
        if following is not None:
            following.token = chosen
            self.pending = following
        return chosen, bool(out.finite)

    def runs_ahead(self) -> bool:
        """Whether a token may be launched before the one before it is read: never when the host must act between
        the two (replayed routing, an embedding read on the host); under "auto" only when no token can miss: the
        slot pool holds every expert, or the host tier every one it does not (read in place; a promotion made
        after a token waits for the token launched ahead before it fills a slot: ExpertPipeline.promote)."""
        mode = self.engine.decode_ahead
        if mode not in ("auto", "on", "off"):
            raise VismmoeError(f"VISMMOE_DECODE_AHEAD={mode!r}: use auto, on or off")
        rt = self.engine.experts
        if mode == "off" or self.host_row is not None or rt.replay is not None:
            return False
        pipeline, total = rt.pipeline, len(self.engine.catalogue.experts)
        held = len(pipeline.pinned) + max(pipeline.capacity, self.mapped_experts)
        return mode == "on" or held >= total

    def settle(self) -> None:
        """Discard the token launched ahead, if any (a new request, other knobs, the end of a reply)."""
        if self.pending is not None:
            self._discard(self.pending)
            self.pending = None

    def _take(self, token: int, position: int) -> Launched | None:
        """The token launched ahead if it was given these inputs; otherwise it is discarded."""
        launched, self.pending = self.pending, None
        if launched is not None and (launched.token, launched.position) == (token, position):
            return launched
        if launched is not None:
            self._discard(launched)
        return None

    def _launch(self, token: int | None, position: int, produced: int | None = None, *, sync: bool = False) -> Launched:
        """Queue one device token. A `token` from the host is filled in by kernels whose arguments carry the
        values (so no pinned buffer a token in flight reads is rewritten); None runs on the device's last choice.
        `sync`: bring the expert table up to date first (stream-ordered after the tokens in flight)."""
        if sync:
            self.table.sync(self.engine.experts.pipeline)
        if token is not None:
            self.token.fill_(token)
            self.position.fill_(position)
            assert produced is not None
            self.sampler.count_from(produced)
            if self.host_row is not None:  # nothing is in flight: runs_ahead is off with host rows
                self.host_row.copy_(self.lm.embed_tokens.host_rows(torch.tensor([[token]])))
        self._run("token.sampled" if self.sampler.sampling else "token.greedy", self._token)
        parity, self.parity = self.parity, 1 - self.parity
        self.host_packed[parity].copy_(self.packed, non_blocking=True)
        event = None
        if self.done is not None:
            event = self.done[parity]
            event.record()
        return Launched(parity, token, position, event)

    def _read(self, launched: Launched) -> TokenOutputs:
        if launched.event is not None:
            launched.event.synchronize()
        return TokenOutputs.of(self.host_packed[launched.parity], len(self.moe_layers))

    def _discard(self, launched: Launched) -> None:
        """Wait for a token nobody will read, and roll back the KV position it wrote (its device inputs are
        filled anew by the next launch from the host)."""
        if launched.event is not None:
            launched.event.synchronize()
        self.cache.lengths -= 1
        self.discarded += 1

    # ---- running them -----------------------------------------------------------------------------------------
    def _run(self, name: str, fn: Callable[..., None], *args: Any) -> None:
        if not self.graphs:
            fn(*args)
            return
        graph = self._graphs.get(name)
        if graph is None:
            try:
                graph = self._graphs[name] = self._capture(fn, *args)
            except RuntimeError as e:  # a capture this torch build refuses: the same steps, eagerly
                warnings.warn(f"CUDA graph capture of {name} failed ({e}); decoding without graphs", stacklevel=2)
                self.graphs = False
                self._graphs.clear()
                torch.cuda.synchronize(self.device)
                fn(*args)
                return
        graph.replay()

    def _capture(self, fn: Callable[..., None], *args: Any) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (allocator, library handles), undo what the warm-up wrote, then capture. A
        capture records kernels without running them: the caller replays the graph once to run it."""
        state = [self.hidden, self.normed, self.cache.lengths, self.token, self.position]
        if self.on_device:
            state += [self.sampler.token, self.sampler.produced, self.packed]
        saved = [t.clone() for t in state]
        side = capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        for t, old in zip(state, saved, strict=True):
            t.copy_(old)
        graph = torch.cuda.CUDAGraph()
        if self.on_device and hasattr(graph, "register_generator_state"):  # draws advance per replay
            graph.register_generator_state(self.sampler.generator)
        # thread_local: I/O threads keep queueing copies on their own streams while this thread captures
        with torch.cuda.graph(graph, pool=self.graph_pool, stream=side, capture_error_mode="thread_local"):
            fn(*args)
        return graph

    @torch.inference_mode()
    def step(self, token: int, position: int) -> torch.Tensor:
        """One token through every layer; returns the next-token logits [vocab] (a buffer the next step reuses)."""
        self.host_token.fill_(token)
        self.host_position.fill_(position)
        if self.host_row is not None:
            self.host_row.copy_(self.lm.embed_tokens.host_rows(self.host_token))
        self._run("embed", self._embed)
        for i in range(len(self.lm.layers)):
            self._run(f"attention.{i}", self._attention, i)
            experts = self.moe.get(i)
            if experts is None:
                continue
            if self.routed is not None:
                self.routed.record()
                self.routed.synchronize()  # the host decides what to fetch from this layer's routing
            b = self.buffers[i]
            slots, mix = experts.prepare_pool_step(self.normed.view(1, -1), b.host_index, b.host_weights)
            b.host_mix.copy_(mix)
            if slots is None:  # some experts still being read: eagerly, as they land (experts/arrival.py)
                b.mix.copy_(b.host_mix, non_blocking=True)
                out = experts.arriving_step(self.normed.view(1, -1), b.mix)
                self.hidden.add_(out.view_as(self.hidden))
            else:
                b.host_slots.copy_(slots)
                self._run(f"experts.{i}", self._experts, i)
            experts.finish_pool_step()
        self._run("tail", self._tail)
        self.host_length += 1
        return self.logits
