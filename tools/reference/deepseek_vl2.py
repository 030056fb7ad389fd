"""A straightforward, unoptimised DeepSeek-VL2 written from the public definition, for tests.

Read from deepseek-ai/DeepSeek-VL2 (deepseek_vl2/models/): siglip_vit.py (timm ViT: patch conv, pos_embed,
blocks with fused qkv, LayerNorm eps 1e-6, tanh-GELU MLP, final norm; no class token, head ignored),
modeling_deepseek_vl_v2.py (MlpProjector downsample_mlp_gelu; 2D tile tags: newline per row, view separator,
global view at the head) and modeling_deepseek.py (MoEGate greedy / group_limited_greedy / noaux_tc; MLA
attention with its interleaved-to-half RoPE permutation; LlamaAttention when use_mla is false; shared experts;
dense first layers). It works on the checkpoint's own tensor names, the whole model in memory, and decodes by
recomputing the whole sequence every step: no cache, no pipeline, plain loops. Nothing here is shared with
vismmoe_edge's model code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class DeepseekVL2Reference:
    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        self.config = json.loads((model_dir / "config.json").read_text())
        self.lang = self.config["language_config"]
        self.w: dict[str, torch.Tensor] = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            self.w |= {k: v.float() for k, v in load_file(str(shard)).items()}

    # ---- vision: timm VisionTransformer.forward_features -----------------------------------------------
    def vision(self, pixels: torch.Tensor) -> torch.Tensor:
        w, v = self.w, self.config["vision_config"]
        heads = v.get("heads", 16)
        x = F.conv2d(
            pixels, w["vision.patch_embed.proj.weight"], w["vision.patch_embed.proj.bias"], stride=v["patch_size"]
        )
        x = x.flatten(2).transpose(1, 2) + w["vision.pos_embed"]
        for i in range(v["layers"]):
            p = f"vision.blocks.{i}."
            h = F.layer_norm(x, x.shape[-1:], w[p + "norm1.weight"], w[p + "norm1.bias"], eps=1e-6)
            b, n, c = h.shape
            qkv = F.linear(h, w[p + "attn.qkv.weight"], w[p + "attn.qkv.bias"]).reshape(b, n, 3, heads, c // heads)
            q, k, val = (t.transpose(1, 2) for t in qkv.unbind(2))
            att = (q @ k.transpose(-2, -1) * (c // heads) ** -0.5).softmax(-1) @ val
            x = x + F.linear(att.transpose(1, 2).reshape(b, n, c), w[p + "attn.proj.weight"], w[p + "attn.proj.bias"])
            h = F.layer_norm(x, x.shape[-1:], w[p + "norm2.weight"], w[p + "norm2.bias"], eps=1e-6)
            h = F.gelu(F.linear(h, w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"]), approximate="tanh")
            x = x + F.linear(h, w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"])
        return F.layer_norm(x, x.shape[-1:], w["vision.norm.weight"], w["vision.norm.bias"], eps=1e-6)

    # ---- projector: MlpProjector(downsample_mlp_gelu), written as explicit 2x2 gathering ------------------
    def projector(self, feats: torch.Tensor) -> torch.Tensor:
        r = self.config["projector_config"].get("downsample_ratio", 2)
        tiles, hw, c = feats.shape
        side = int(hw**0.5)
        padded = math.ceil(side / r) * r
        grid = torch.zeros(tiles, padded, padded, c)
        grid[:, :side, :side] = feats.view(tiles, side, side, c)
        rows = []
        for i in range(0, padded, r):
            for j in range(0, padded, r):
                block = grid[:, i : i + r, j : j + r, :]  # [tiles, r, r, c]
                rows.append(block.permute(0, 3, 1, 2).reshape(tiles, c * r * r))  # F.unfold: channel-major
        x = torch.stack(rows, dim=1)
        x = F.gelu(F.linear(x, self.w["projector.layers.0.weight"], self.w["projector.layers.0.bias"]))
        return F.linear(x, self.w["projector.layers.2.weight"], self.w["projector.layers.2.bias"])

    def image_tokens(self, pixels: torch.Tensor, grid: list[list[int]]) -> torch.Tensor:
        feats = self.projector(self.vision(pixels))
        side = int(feats.shape[1] ** 0.5)
        newline, sep = self.w["image_newline"], self.w["view_seperator"]
        tokens, t = [], 0
        for _, th, tw in grid:
            glob = []
            for r in range(side):
                glob += [feats[t][r * side + c] for c in range(side)] + [newline]
            local = []
            for row in range(th * side):
                for col in range(tw * side):
                    tile = 1 + (row // side) * tw + col // side
                    local.append(feats[t + tile][(row % side) * side + col % side])
                local.append(newline)
            head = self.config.get("global_view_pos", "head") == "head"
            tokens += (glob + [sep] + local) if head else (local + [sep] + glob)
            t += 1 + th * tw
        return torch.stack(tokens)

    # ---- language model: modeling_deepseek.py --------------------------------------------------------------
    def rms(self, x: torch.Tensor, name: str, eps: float | None = None) -> torch.Tensor:
        eps = self.lang.get("rms_norm_eps", 1e-6) if eps is None else eps
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(self, x: torch.Tensor, interleaved: bool) -> torch.Tensor:
        """x [heads, seq, d] at positions 0..seq-1; MLA first permutes (x0, x1, x2, ...) pairs to halves."""
        heads, seq, d = x.shape
        inv = 1.0 / (self.lang.get("rope_theta", 10000.0) ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(seq).float(), inv)
        cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
        if interleaved:
            x = x.view(heads, seq, d // 2, 2).transpose(3, 2).reshape(heads, seq, d)
        rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * cos + rotated * sin

    def attention(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w, c = self.w, self.lang
        seq, heads = x.shape[0], c["num_attention_heads"]
        if c.get("use_mla", True):
            nope, rope, vdim = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            if c.get("q_lora_rank") is None:
                q = x @ w[p + "q_proj.weight"].T
            else:
                q = (
                    self.rms(x @ w[p + "q_a_proj.weight"].T, p + "q_a_layernorm.weight", 1e-6)
                    @ w[p + "q_b_proj.weight"].T
                )
            q = q.view(seq, heads, nope + rope).transpose(0, 1)
            kv_a = x @ w[p + "kv_a_proj_with_mqa.weight"].T
            latent, k_pe = kv_a[:, : c["kv_lora_rank"]], kv_a[:, c["kv_lora_rank"] :]
            kv = self.rms(latent, p + "kv_a_layernorm.weight", 1e-6) @ w[p + "kv_b_proj.weight"].T
            kv = kv.view(seq, heads, nope + vdim).transpose(0, 1)
            q_pe = self.rope(q[..., nope:], interleaved=True)
            k_pe = self.rope(k_pe.view(1, seq, rope), interleaved=True).expand(heads, -1, -1)
            query, key, value = (
                torch.cat([q[..., :nope], q_pe], -1),
                torch.cat([kv[..., :nope], k_pe], -1),
                kv[..., nope:],
            )
            scale = (nope + rope) ** -0.5
        else:
            hd = c["hidden_size"] // heads
            kv_heads = c.get("num_key_value_heads") or heads
            query = self.rope((x @ w[p + "q_proj.weight"].T).view(seq, heads, hd).transpose(0, 1), interleaved=False)
            key = self.rope((x @ w[p + "k_proj.weight"].T).view(seq, kv_heads, hd).transpose(0, 1), interleaved=False)
            value = (x @ w[p + "v_proj.weight"].T).view(seq, kv_heads, hd).transpose(0, 1)
            key, value = key.repeat_interleave(heads // kv_heads, 0), value.repeat_interleave(heads // kv_heads, 0)
            scale = hd**-0.5
        scores = query @ key.transpose(-2, -1) * scale
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ value).transpose(0, 1).reshape(seq, -1)
        return out @ w[p + "o_proj.weight"].T

    def mlp(self, x: torch.Tensor, p: str) -> torch.Tensor:
        w = self.w
        return (F.silu(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T

    def route(self, x: torch.Tensor, p: str) -> tuple[torch.Tensor, torch.Tensor]:
        """MoEGate.forward (inference) for every token: (expert ids [T, k], weights [T, k])."""
        c = self.lang
        k, experts, method = c["num_experts_per_tok"], c["n_routed_experts"], c.get("topk_method", "greedy")
        groups, topk_group = c.get("n_group") or 1, c.get("topk_group") or 1
        logits = x @ self.w[p + "gate.weight"].T
        scores = logits.softmax(-1) if c.get("scoring_func", "softmax") == "softmax" else logits.sigmoid()
        if method == "greedy":
            weights, index = scores.topk(k, dim=-1)
        else:
            choice = scores + self.w[p + "gate.e_score_correction_bias"] if method == "noaux_tc" else scores
            grouped = choice.view(-1, groups, experts // groups)
            group_scores = grouped.topk(2, -1)[0].sum(-1) if method == "noaux_tc" else grouped.max(-1).values
            kept = group_scores.topk(topk_group, -1)[1]
            mask = torch.zeros_like(group_scores).scatter(1, kept, 1.0).repeat_interleave(experts // groups, 1)
            index = choice.masked_fill(mask == 0, 0.0).topk(k, dim=-1)[1]
            weights = scores.gather(1, index)
        if k > 1 and c.get("norm_topk_prob", False):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return index, weights * c.get("routed_scaling_factor", 1.0)

    def moe(self, x: torch.Tensor, p: str) -> torch.Tensor:
        index, weights = self.route(x, p)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for e, g in zip(index[t].tolist(), weights[t], strict=True):
                out[t] += g * self.mlp(x[t : t + 1], f"{p}experts.{e}.")[0]
        return out + self.mlp(x, p + "shared_experts.")

    def logits(self, embeds: torch.Tensor) -> torch.Tensor:
        x = embeds
        for layer in range(self.lang["num_hidden_layers"]):
            p = f"language.model.layers.{layer}."
            x = x + self.attention(self.rms(x, p + "input_layernorm.weight"), p + "self_attn.")
            h = self.rms(x, p + "post_attention_layernorm.weight")
            dense = layer < self.lang.get("first_k_dense_replace", 0)
            x = x + (self.mlp(h, p + "mlp.") if dense else self.moe(h, p + "mlp."))
        return self.rms(x[-1], "language.model.norm.weight") @ self.w["language.lm_head.weight"].T

    @torch.no_grad()
    def generate(
        self,
        input_ids: list[int],
        image_token_id: int,
        pixels: torch.Tensor | None,
        grid: list[list[int]],
        new_tokens: int,
        suppress: list[int],
    ) -> list[int]:
        """Greedy tokens, `suppress` masked (as min_new_tokens does for stop tokens); the whole sequence is
        recomputed for every token."""
        visual = self.image_tokens(pixels, grid) if pixels is not None else None
        ids, out = list(input_ids), []
        for _ in range(new_tokens):
            embeds = self.w["language.model.embed_tokens.weight"][torch.tensor(ids)]
            if visual is not None:
                rows = [i for i, t in enumerate(input_ids) if t == image_token_id]
                assert len(rows) == visual.shape[0], (len(rows), visual.shape)
                embeds[rows] = visual
            logits = self.logits(embeds)
            logits[suppress] = float("-inf")
            token = int(logits.argmax())
            ids.append(token)
            out.append(token)
        return out
