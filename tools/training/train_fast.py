"""A training forward of Qwen3-VL-MoE with static shapes, and a training step that can be captured as a CUDA graph.

transformers' forward is written for any input: it loops over images in the vision tower's attention, turns grids
into Python lists (`.tolist()`), finds image tokens with boolean masks and routes experts through per-expert loops;
each of these syncs the GPU with Python or launches hundreds of small kernels, and a training step of this 10 M
parameter model was bound by exactly that (docs/training/README.md). Here every batch holds images of one size
(tools/training/train_data.py: buckets), so

- the vision tower runs all images of the batch through one batched attention call per layer, with the position
  embeddings and rotary angles of that size computed once per bucket by transformers' own helpers;
- the image tokens sit at fixed positions, so visual features are joined to the text by slicing;
- experts run densely: every expert on every token as two large matmuls, mixed by the router's top-k weights
  (zero elsewhere): the same function as the sparse loop (checked by tests/test_train_demo.py), a few kernels;
- the turn slots attend to the image context and to themselves only (a static mask per bucket).

The module uses the model's own submodules and weights, so what it trains is exactly what transformers and our
engine load; tests/test_train_demo.py checks its outputs against transformers' forward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from train_data import AUX_CLASSES, IGNORE, Bucket, TurnEncoder
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_vision,
    repeat_kv,
)
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

METRICS = ("loss", "answer_loss", "balance_loss", "token_loss", "answer_acc", "answers")


class AuxiliaryHead(torch.nn.Module):
    """Linear probes on the vision tower's merged tokens: colour, shape, text and object centre of each token's
    cell (tools/training/train_data.py: token_labels). Trained with the model, thrown away after training."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList(torch.nn.Linear(width, n) for n in AUX_CLASSES)

    def loss(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        feats = features.float()
        return sum(F.cross_entropy(head(feats), labels[:, i]) for i, head in enumerate(self.heads))


def dense_experts(experts: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """Every expert on every token, mixed by the router weights (zero for experts a token is not routed to)."""
    tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = experts.gate_up_proj.shape
    weights = torch.zeros(tokens, num_experts, device=hidden.device, dtype=top_k_weights.dtype)
    weights = weights.scatter(1, top_k_index, top_k_weights)
    gate_up = (hidden @ experts.gate_up_proj.reshape(num_experts * two_i, hidden_size).T).view(tokens, num_experts, -1)
    gate, up = gate_up.chunk(2, dim=-1)
    inner = experts.act_fn(gate) * up * weights.unsqueeze(-1).to(gate.dtype)  # [T, E, I]
    down = experts.down_proj.transpose(1, 2).reshape(num_experts * (two_i // 2), hidden_size)  # [E*I, H]
    return inner.reshape(tokens, -1) @ down.to(inner.dtype)


@dataclass
class BucketConstants:
    """What depends on the image size only: computed once per bucket, reused by every step of it."""

    interp_indices: torch.Tensor  # [patches, 4] into the learned position grid
    interp_weights: torch.Tensor  # [patches, 4]
    vision_cos: torch.Tensor  # [patches, head_dim]
    vision_sin: torch.Tensor
    positions: torch.Tensor  # [3, 1, seq_len] M-RoPE positions (every slot starts after the image)
    slot_mask: torch.Tensor  # [slots * slot_len, seq_len] bool: what each slot token may attend to


@dataclass
class FastModel:
    model: Any
    encoder: TurnEncoder
    device: torch.device
    aux: AuxiliaryHead | None = None
    aux_weight: float = 0.5
    balance_weight: float = 0.01
    constants: dict[tuple[int, int, int, int], BucketConstants] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.visual = self.model.model.visual
        self.lm = self.model.model.language_model
        self.text_config = self.lm.config
        self.top_k = self.text_config.num_experts_per_tok
        self.num_experts = self.text_config.num_experts

    # ---- constants ---------------------------------------------------------------------------------------
    def bucket_constants(self, bucket: Bucket) -> BucketConstants:
        key = (bucket.width, bucket.height, bucket.slots, bucket.slot_len)
        if key not in self.constants:
            self.constants[key] = self._constants(bucket)
        return self.constants[key]

    @torch.no_grad()
    def _constants(self, bucket: Bucket) -> BucketConstants:
        visual, dev = self.visual, self.device
        gh, gw = bucket.grid
        grid = torch.tensor([[1, gh, gw]])
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=visual.num_grid_per_side,
            mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners,
            spatial_merge_size=visual.config.spatial_merge_size,
        )
        vision_positions = get_vision_position_ids(grid, visual.spatial_merge_size)
        probe = torch.zeros(1, visual.config.hidden_size)
        cos, sin = visual.rotary_pos_emb(probe, vision_positions)
        # M-RoPE of the context by the model's own rule; slot tokens continue right after <|vision_end|>, each
        # slot from the same position, as the one question of an eval prompt does.
        ctx = torch.tensor([self.encoder.ctx_ids(bucket.visual_tokens)])
        token_types = (ctx == self.encoder.image_id).long()
        ctx_pos, _ = self.model.model.get_rope_index(ctx, mm_token_type_ids=token_types, image_grid_thw=grid)
        last = ctx_pos[:, :, -1:]
        offsets = torch.arange(1, bucket.slot_len + 1).repeat(bucket.slots).view(1, 1, -1)
        positions = torch.cat([ctx_pos, last + offsets], dim=2)
        # slot token i (slot s_i, place p_i) sees the whole context and the tokens of its own slot up to itself
        n = bucket.slots * bucket.slot_len
        slot_of = torch.arange(n) // bucket.slot_len
        same = (slot_of[:, None] == slot_of[None, :]) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
        mask = torch.cat([torch.ones(n, bucket.ctx_len, dtype=torch.bool), same], dim=1)
        return BucketConstants(
            indices.to(dev), weights.to(dev), cos.to(dev), sin.to(dev), positions.to(dev), mask.to(dev)
        )

    # ---- vision tower ------------------------------------------------------------------------------------
    def patchify(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] -> [B * patches, 3 * 16 * 16] float, normalised as the processor does and in its
        patch order (2x2 merge blocks in raster order, then the patches of a block); one frame: the processor's
        two temporal copies are folded into the patch-embedding weight instead."""
        b, h, w, _ = images.shape
        x = images.permute(0, 3, 1, 2).float() * (1 / 255)
        x = (x - 0.5) / 0.5
        p = self.visual.patch_size
        x = x.view(b, 3, h // (2 * p), 2, p, w // (2 * p), 2, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        return x.reshape(-1, 3 * p * p)

    def vision(self, images: torch.Tensor, c: BucketConstants) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Merged visual tokens [B * visual_tokens, D] and the DeepStack features, for B images of one size."""
        visual = self.visual
        b = images.shape[0]
        proj = visual.patch_embed.proj
        weight = proj.weight.sum(dim=2).reshape(proj.weight.shape[0], -1)  # both temporal copies are one frame
        x = F.linear(self.patchify(images), weight, proj.bias)
        patches, width = c.interp_indices.shape[0], x.shape[-1]
        pos = (visual.pos_embed(c.interp_indices) * c.interp_weights[:, :, None]).sum(1)
        x = x.view(b, patches, width) + pos.to(x.dtype)
        deepstack = []
        for layer, block in enumerate(visual.blocks):
            attn = block.attn
            qkv = attn.qkv(block.norm1(x)).view(b, patches, 3, attn.num_heads, -1)
            q, k, v = qkv.unbind(2)
            q, k = apply_rotary_pos_emb_vision(q, k, c.vision_cos, c.vision_sin)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            x = x + attn.proj(out.transpose(1, 2).reshape(b, patches, -1))
            x = x + block.mlp(block.norm2(x))
            if layer in visual.deepstack_visual_indexes:
                merger = visual.deepstack_merger_list[visual.deepstack_visual_indexes.index(layer)]
                deepstack.append(merger(x.reshape(b * patches, width)))
        return visual.merger(x.reshape(b * patches, width)), deepstack

    # ---- language model ----------------------------------------------------------------------------------
    def _attention(self, attn: Any, x: torch.Tensor, cos_sin: tuple, ctx_len: int, slot_mask: torch.Tensor):
        b, n, _ = x.shape
        shape = (b, n, -1, attn.head_dim)
        q = attn.q_norm(attn.q_proj(x).view(shape)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(shape)).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
        # the context is plainly causal (flash attention); only the slot rows need the mask
        ctx = F.scaled_dot_product_attention(
            q[:, :, :ctx_len], k[:, :, :ctx_len], v[:, :, :ctx_len], is_causal=True, scale=attn.scaling
        )
        parts = [ctx]
        if n > ctx_len:
            parts.append(
                F.scaled_dot_product_attention(q[:, :, ctx_len:], k, v, attn_mask=slot_mask, scale=attn.scaling)
            )
        out = torch.cat(parts, dim=2).transpose(1, 2).reshape(b, n, -1)
        return attn.o_proj(out)

    def _moe(self, mlp: Any, x: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The router exactly as transformers' (softmax, top-k, renormalised), dense experts, and this layer's
        load-balancing loss over real tokens (Switch: num_experts * sum_i f_i P_i; 4.0 = balanced for top-4)."""
        b, n, d = x.shape
        h = x.reshape(-1, d)
        logits = F.linear(h, mlp.gate.weight)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        top_v, top_i = torch.topk(probs, self.top_k, dim=-1)
        top_v = (top_v / top_v.sum(dim=-1, keepdim=True)).to(logits.dtype)
        out = dense_experts(mlp.experts, h, top_i, top_v).view(b, n, d)
        m = real.reshape(-1, 1).float() if real is not None else torch.ones_like(probs[:, :1])
        routed = torch.zeros_like(probs).scatter(1, top_i, 1.0)
        total = m.sum()
        balance = self.num_experts * ((routed * m).sum(0) / total * (probs * m).sum(0) / total).sum()
        return out, balance

    def language(
        self,
        ids: torch.Tensor,
        visual: torch.Tensor,
        deepstack: list[torch.Tensor],
        bucket: Bucket,
        c: BucketConstants,
        real: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states of the slot region [B, slots * slot_len, D] and the mean load-balancing loss."""
        lm = self.lm
        b = ids.shape[0]
        start, nv = bucket.prefix_len, bucket.visual_tokens
        emb = lm.embed_tokens(ids)
        hidden = torch.cat([emb[:, :start], visual.view(b, nv, -1).to(emb.dtype), emb[:, start + nv :]], dim=1)
        cos_sin = lm.rotary_emb(hidden, c.positions)
        pad = (0, 0, start, bucket.seq_len - start - nv)
        balance = []
        for i, layer in enumerate(lm.layers):
            x = layer.input_layernorm(hidden)
            hidden = hidden + self._attention(layer.self_attn, x, cos_sin, bucket.ctx_len, c.slot_mask)
            out, lb = self._moe(layer.mlp, layer.post_attention_layernorm(hidden), real)
            hidden = hidden + out
            balance.append(lb)
            if i < len(deepstack):  # DeepStack: vision features added to the image tokens after the first layers
                hidden = hidden + F.pad(deepstack[i].view(b, nv, -1).to(hidden.dtype), pad)
        return lm.norm(hidden[:, bucket.ctx_len :]), torch.stack(balance).mean()

    def logits(self, images: torch.Tensor, ids: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        c = self.bucket_constants(bucket)
        visual, deepstack = self.vision(images, c)
        hidden, _ = self.language(ids, visual, deepstack, bucket, c, None)
        return self.model.lm_head(hidden)

    def loss(self, batch: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
        """[len(METRICS)] tensor: total loss first (the one to backpropagate), then its parts and answer accuracy."""
        c = self.bucket_constants(bucket)
        visual, deepstack = self.vision(batch["images"], c)
        hidden, balance = self.language(batch["ids"], visual, deepstack, bucket, c, batch["real"])
        logits = self.model.lm_head(hidden).float()
        targets = batch["targets"]
        answer_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
        valid = targets != IGNORE
        answers = valid.sum()
        acc = ((logits.argmax(-1) == targets) & valid).sum() / answers
        loss = answer_loss + self.balance_weight * balance
        token_loss = torch.zeros((), device=loss.device)
        if self.aux is not None:
            token_loss = self.aux.loss(visual, batch["token_labels"].reshape(-1, len(AUX_CLASSES)))
            loss = loss + self.aux_weight * token_loss
        return torch.stack([loss, answer_loss, balance, token_loss, acc, answers.float()])


# ---------------------------------------------------------------------------------------------------------------
# The training step: plain, or captured once per bucket as a CUDA graph


class StepRunner:
    """forward + backward + gradient clipping + AdamW as one function of static input buffers.

    mode "graph": the first batch of each bucket runs plainly (on a side stream, as CUDA graph capture requires
    for warm-up), then the whole step is captured once and every later batch of that bucket is copied into the
    static inputs and replayed: one launch per step instead of thousands. All graphs share one memory pool; that
    is safe because each replay's outputs are read (accumulated into `totals`) before the next replay, and
    parameters, optimizer state and inputs live outside the pool. If a capture fails, every later step runs
    plainly (the failure is kept in `fallbacks`). mode "plain": the same step without graphs."""

    def __init__(
        self,
        fast: FastModel,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        lr: torch.Tensor | None,
        mode: str,
        clip: float = 1.0,
    ) -> None:
        self.fast, self.params, self.opt, self.lr, self.clip = fast, params, optimizer, lr, clip
        self.mode = mode
        self.device = fast.device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor]] = {}
        self.fallbacks: dict[int, str] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode == "graph" else None
        self.capture_seconds = 0.0
        self.totals = torch.zeros(len(METRICS) + 1, device=self.device)  # + grad norm

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)

    def _body(self, batch: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
        with self._autocast():
            metrics = self.fast.loss(batch, bucket)
        metrics[0].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=self.device.type == "cuda")
        self.opt.step()
        return torch.cat([metrics.detach(), grad_norm.detach().float().view(1)])

    def set_lr(self, value: float) -> None:
        if self.lr is not None:
            self.lr.fill_(value)
        else:
            for group in self.opt.param_groups:
                group["lr"] = value

    def step(self, index: int, bucket: Bucket, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.mode != "graph" or index in self.fallbacks:
            return self._plain(batch, bucket)
        if index in self.graphs:
            graph, static, out = self.graphs[index]
            for key, value in static.items():
                value.copy_(batch[key], non_blocking=True)
            graph.replay()
            self.totals += out
            return out
        return self._capture(index, bucket, batch)

    def _plain(self, batch: dict[str, torch.Tensor], bucket: Bucket) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        out = self._body(batch, bucket)
        self.totals += out
        return out

    def _capture(self, index: int, bucket: Bucket, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        static = {k: v.clone() for k, v in batch.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: a real training step on this batch
            self.opt.zero_grad(set_to_none=True)
            out = self._body(static, bucket)
            self.totals += out
        torch.cuda.current_stream().wait_stream(side)
        try:
            graph = torch.cuda.CUDAGraph()
            self.opt.zero_grad(set_to_none=True)
            # thread_local: the DataLoader's pin-memory thread keeps pinning batches while this thread captures
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                captured = self._body(static, bucket)
            self.graphs[index] = (graph, static, captured)
        except Exception as exc:  # noqa: BLE001 - any capture failure: plain steps from here on, for every bucket
            self.fallbacks[index] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"CUDA graph capture failed for bucket {bucket.name}; plain steps from now: {self.fallbacks[index]}")
            self.mode = "plain"
            torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's blocks: the graphs' pool holds what the replays need
        self.capture_seconds += time.perf_counter() - start
        return out


# ---------------------------------------------------------------------------------------------------------------
# Quick greedy evaluation with the same forward (batched by image size)


@torch.no_grad()
def greedy_answers(
    fast: FastModel,
    items: list[tuple[Any, str]],
    render: Callable[[Any], Any],
    *,
    max_new_tokens: int = 8,
    batch: int = 32,
    autocast: bool = False,
    deadline: float | None = None,
) -> list[str | None]:
    """Greedy answers to (scene, question) pairs, one question per image as `vismmoe-edge eval` asks it, decoded
    until <|im_end|> or <|endoftext|> or `max_new_tokens`; the same tokens the engine's greedy decode produces
    (up to floating-point differences). Each decoding step re-runs the language model over the whole prompt (no
    KV cache; a few milliseconds on a GPU). Items after `deadline` (time.perf_counter) are left None."""
    import numpy as np

    enc = fast.encoder
    stops = {enc.im_end, enc.pad_id, enc.tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    by_size: dict[tuple[int, int], list[int]] = {}
    for i, (scene, _) in enumerate(items):
        by_size.setdefault((scene.width, scene.height), []).append(i)
    answers: list[str | None] = [None] * len(items)
    ctx_manager = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for (w, h), members in by_size.items():
        for chunk_start in range(0, len(members), batch):
            if deadline is not None and time.perf_counter() > deadline:
                return answers
            chunk = members[chunk_start : chunk_start + batch]
            prompts = [enc.prompt_ids(items[i][1]) for i in chunk]
            slot_len = max(len(p) for p in prompts) + max_new_tokens
            bucket = Bucket(w, h, len(chunk), 1, slot_len, len(enc.prefix))
            ids = torch.full((len(chunk), bucket.seq_len), enc.pad_id, dtype=torch.long)
            ids[:, : bucket.ctx_len] = torch.tensor(enc.ctx_ids(bucket.visual_tokens))
            for row, p in enumerate(prompts):
                ids[row, bucket.ctx_len : bucket.ctx_len + len(p)] = torch.tensor(p)
            images = torch.from_numpy(np.stack([np.asarray(render(items[i][0])) for i in chunk]))
            images, ids = images.to(fast.device), ids.to(fast.device)
            lengths = [len(p) for p in prompts]
            generated: list[list[int]] = [[] for _ in chunk]
            done = [False] * len(chunk)
            with ctx_manager:
                c = fast.bucket_constants(bucket)
                visual, deepstack = fast.vision(images, c)
                for _ in range(max_new_tokens):
                    hidden, _ = fast.language(ids, visual, deepstack, bucket, c, None)
                    last = torch.tensor(lengths, device=fast.device) - 1
                    logits = fast.model.lm_head(hidden[torch.arange(len(chunk), device=fast.device), last])
                    tokens = logits.float().argmax(-1).tolist()
                    for row, token in enumerate(tokens):
                        if done[row]:
                            continue
                        if token in stops:
                            done[row] = True
                            continue
                        generated[row].append(token)
                        ids[row, bucket.ctx_len + lengths[row]] = token
                        lengths[row] += 1
                    if all(done):
                        break
            for row, i in enumerate(chunk):
                answers[i] = enc.tokenizer.decode(generated[row], skip_special_tokens=True)
    return answers
