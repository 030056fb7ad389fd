"""kernels/decode_layer.py: the explicit attention and router of a decode token are transformers' computation,
bit for bit, eagerly on the CPU (compiled on CUDA they are checked under the near-tie rule instead)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3VLMoeForConditionalGeneration

from vismmoe_edge.kernels.decode_layer import FusedLayers, stack_qkv, supports
from vismmoe_edge.static_decode import StaticCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_and_route_are_transformers_computation(checkpoints, dtype: torch.dtype) -> None:
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"], dtype=dtype).eval()
    lm = model.model.language_model
    assert supports(lm, set(range(len(lm.layers))))
    fused = FusedLayers(lm, compile=False)
    g = torch.Generator().manual_seed(3)
    hidden_size, layers = lm.config.hidden_size, len(lm.layers)
    prefill = DynamicCache()
    kv_heads, head_dim = lm.config.num_key_value_heads, lm.layers[0].self_attn.head_dim
    for i in range(layers):  # a 5-position prompt, different per layer
        kv = torch.randn(2, 1, kv_heads, 5 + i % 2, head_dim, generator=g).to(dtype)
        prefill.update(kv[0], kv[1], i)
    mine, theirs = StaticCache(prefill, 16), StaticCache(prefill, 16)
    mine.fill(prefill)
    theirs.fill(prefill)
    positions = torch.full((3, 1, 1), 6, dtype=torch.long)
    with torch.inference_mode():
        for i, layer in enumerate(lm.layers):
            hidden = torch.randn(1, 1, hidden_size, generator=g).to(dtype)
            cos, sin = lm.rotary_emb(hidden, positions)
            a, b = hidden.clone(), hidden.clone()
            experts = torch.randn(1, hidden_size, generator=g).to(dtype)  # the previous layer's, as the CPU gives
            normed = fused.attend(i, experts, a, (cos, sin), mine)
            b.add_(experts.view_as(b))
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(b), position_embeddings=(cos, sin),
                                      attention_mask=theirs.mask(i, dtype), cache=theirs)  # fmt: skip
            b.add_(attn)
            assert torch.equal(a, b) and torch.equal(normed, layer.post_attention_layernorm(b)), i
            assert torch.equal(mine.keys[i], theirs.keys[i]) and torch.equal(mine.values[i], theirs.values[i])
            table_row = torch.arange(lm.layers[i].mlp.gate.num_experts, dtype=torch.int32) - 1  # expert 0 absent
            routing = torch.full((layers, lm.layers[i].mlp.gate.top_k), -1, dtype=torch.long)
            missed_rows = torch.zeros(layers, dtype=torch.bool)
            index, weights, slots, missed = fused.route(i, normed.view(1, -1), table_row, routing[i],
                                                        missed_rows[i])  # fmt: skip
            _, their_weights, their_index = layer.mlp.gate(normed.view(1, -1))
            assert torch.equal(index, their_index) and torch.equal(weights, their_weights)
            assert torch.equal(slots, (index - 1).clamp_min(0)) and bool(missed) == bool((index == 0).any())
            # the token's record: this layer's row written, the others untouched
            assert torch.equal(routing[i], index[0]) and bool(missed_rows[i]) == bool(missed)
            assert (routing[torch.arange(layers) != i] == -1).all() and int(missed_rows.sum()) == int(missed)
            slots_again, missed_again = fused.lookup(index, table_row, routing[i], missed_rows[i])  # replayed
            assert torch.equal(slots_again, slots) and bool(missed_again) == bool(missed)


def test_quantized_or_other_layers_keep_the_modules(checkpoints) -> None:
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"]).eval()
    lm = model.model.language_model
    assert not supports(lm, set())  # a dense (non-MoE) layer has no router to fuse
    lm.layers[0].self_attn.q_proj = torch.nn.Linear(lm.config.hidden_size, 8, bias=True)
    assert not supports(lm, set(range(len(lm.layers))))


def test_a_compiler_failure_runs_the_layers_eagerly(checkpoints, no_compiler: None) -> None:
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"]).eval()
    lm = model.model.language_model
    fused = FusedLayers(lm, compile=True)
    prefill = DynamicCache()
    kv = torch.zeros(2, 1, lm.config.num_key_value_heads, 3, lm.layers[0].self_attn.head_dim)
    for i in range(len(lm.layers)):
        prefill.update(kv[0], kv[1], i)
    cache = StaticCache(prefill, 8)
    cache.fill(prefill)
    hidden = torch.ones(1, 1, lm.config.hidden_size)
    with torch.no_grad():
        cos_sin = lm.rotary_emb(hidden, torch.full((3, 1, 1), 3, dtype=torch.long))
    with torch.no_grad(), pytest.warns(UserWarning, match="no C compiler"):
        normed = fused.attend(0, torch.zeros(1, lm.config.hidden_size), hidden, cos_sin, cache)
    assert not fused.compiled and torch.isfinite(normed).all()
    with torch.no_grad():
        experts = lm.layers[0].mlp.gate.num_experts
        k = lm.layers[0].mlp.gate.top_k
        routing, missed = torch.zeros(k, dtype=torch.long), torch.ones((), dtype=torch.bool)
        index, *_ = fused.route(0, normed.view(1, -1), torch.zeros(experts, dtype=torch.int32), routing, missed)
    assert index.shape == (1, k) and torch.equal(routing, index[0]) and not missed  # the eager router and record


def test_stacked_qkv_holds_no_byte_twice(checkpoints) -> None:
    """Compiled, a layer's q, k and v projections are one GEMV: the modules' weights become views of the stacked
    tensor (the same values; on the CPU even a copy of a weight read from its shard may round a GEMV differently,
    which is why only the compiled CUDA path stacks), and a second decoder reuses it."""
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"]).eval()
    lm = model.model.language_model
    a = lm.layers[0].self_attn
    before = [p.weight.detach().clone() for p in (a.q_proj, a.k_proj, a.v_proj)]
    x = torch.randn(1, 1, lm.config.hidden_size)
    with torch.no_grad():
        outputs = [p(x) for p in (a.q_proj, a.k_proj, a.v_proj)]
    stacked = stack_qkv(a)
    assert stacked.shape[0] == sum(w.shape[0] for w in before)
    for p, w in zip((a.q_proj, a.k_proj, a.v_proj), before, strict=True):
        assert (
            torch.equal(p.weight, w) and p.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        )
    assert stack_qkv(a) is stacked  # another decoder (another KV capacity) takes the same tensor
    with torch.no_grad():  # the stacked GEMV is the three GEMVs up to rounding (on the CPU not always bit for bit)
        q, k, v = torch.nn.functional.linear(x, stacked).split([o.shape[-1] for o in outputs], dim=-1)
    for mine, theirs in zip((q, k, v), outputs, strict=True):
        assert torch.allclose(mine, theirs, atol=1e-6)


def test_per_layer_rows_are_16_byte_aligned_views() -> None:
    """The KV lengths and miss flags a compiled layer takes one row at a time: every row at a 16-byte boundary, so
    inductor never clones (and copies back) a row it compiled as aligned; the view takes in-place updates."""
    from vismmoe_edge.kernels.decode_layer import aligned_rows

    for dtype in (torch.long, torch.bool, torch.int32):
        rows = aligned_rows(48, dtype, torch.device("cpu"))
        assert rows.shape == (48,) and not rows.any()
        assert all(rows[i : i + 1].data_ptr() % 16 == 0 and rows[i].data_ptr() % 16 == 0 for i in range(48))
    lengths = aligned_rows(4, torch.long, torch.device("cpu"))
    lengths.copy_(torch.tensor([3, 5, 7, 9]))
    lengths += 1
    assert lengths.tolist() == [4, 6, 8, 10] and lengths.long().tolist() == [4, 6, 8, 10]
