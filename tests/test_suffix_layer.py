"""kernels/suffix_layer.py: the explicit attention of a suffix graph's rows is transformers' computation, bit for
bit, eagerly on the CPU (compiled on CUDA it is checked under the near-tie rule instead:
tools/device/prefix_cache_checks.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3VLMoeForConditionalGeneration
from transformers.masking_utils import create_causal_mask

from vismmoe_edge.kernels.decode_layer import supports
from vismmoe_edge.kernels.suffix_layer import SuffixLayers
from vismmoe_edge.prefix_cache import restore_prefix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_is_transformers_attention_and_router_after_a_reused_prefix(checkpoints, dtype) -> None:
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"], dtype=dtype).eval()
    lm = model.model.language_model
    assert supports(lm, set(range(len(lm.layers))))
    explicit = SuffixLayers(lm, compile=False)
    g = torch.Generator().manual_seed(5)
    reused, rows, layers = 7, 8, len(lm.layers)  # 8 rows after 7 reused positions, as a suffix graph pads them
    kv_heads, head_dim = lm.config.num_key_value_heads, lm.layers[0].self_attn.head_dim
    prefix = torch.randn(2, layers, 1, kv_heads, reused, head_dim, generator=g).to(dtype)
    positions = torch.arange(reused, reused + rows).view(1, 1, -1).expand(3, 1, -1)
    with torch.inference_mode():
        cache = DynamicCache(config=lm.config)
        restore_prefix(cache, list(prefix[0]), list(prefix[1]), reused)
        hidden = torch.randn(1, rows, lm.config.hidden_size, generator=g).to(dtype)
        ones = torch.ones(1, reused + rows, dtype=torch.long)
        mask = create_causal_mask(config=lm.config, inputs_embeds=hidden, attention_mask=ones, cache=cache)
        cos_sin = lm.rotary_emb(hidden, positions)
        for i, layer in enumerate(lm.layers):
            a, normed, keys, values, index, weights = explicit.attend(i, hidden, cos_sin, prefix[0, i],
                                                                      prefix[1, i], mask)  # fmt: skip
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden), position_embeddings=cos_sin,
                                      attention_mask=mask, cache=cache)  # fmt: skip
            b = hidden + attn
            assert torch.equal(a, b) and torch.equal(normed, layer.post_attention_layernorm(b)), i
            assert torch.equal(keys, cache.layers[i].keys) and torch.equal(values, cache.layers[i].values), i
            _, their_weights, their_index = layer.mlp.gate(normed.view(rows, -1))
            assert torch.equal(index, their_index) and torch.equal(weights, their_weights), i
            hidden = torch.randn(1, rows, lm.config.hidden_size, generator=g).to(dtype)  # each layer its own rows


def test_the_suffix_layers_compile_only_on_cuda_and_fall_back_eagerly(checkpoints, no_compiler: None) -> None:
    """A compiler failure runs the same code eagerly, with a warning; the CPU never compiles them."""
    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"]).eval()
    lm = model.model.language_model
    explicit = SuffixLayers(lm, compile=True)
    eager = SuffixLayers(lm, compile=False)
    kv_heads, head_dim = lm.config.num_key_value_heads, lm.layers[0].self_attn.head_dim
    prefix = torch.zeros(1, kv_heads, 3, head_dim)
    hidden = torch.ones(1, 2, lm.config.hidden_size)
    cos_sin = lm.rotary_emb(hidden, torch.arange(3, 5).view(1, 1, -1).expand(3, 1, -1))
    with pytest.warns(UserWarning, match="suffix layers failed"):
        out = explicit.attend(0, hidden, cos_sin, prefix, prefix, None)
    assert not explicit.compiled and out[0].shape == hidden.shape and out[2].shape[2] == 5
    torch.testing.assert_close(out[1], eager.attend(0, hidden, cos_sin, prefix, prefix, None)[1])


def test_compiled_after_two_shapes_it_takes_any_length_without_compiling_again(checkpoints) -> None:
    """The daemon compiles the suffix attention for two shapes before READY (serve/warmup.py): from then on a
    question after any prefix, padded to any length, must not wait for the compiler. Compiled here by inductor's
    CPU backend (on CUDA its Triton one); its outputs are the eager ones within bf16 rounding."""
    from torch._dynamo.utils import counters

    model = Qwen3VLMoeForConditionalGeneration.from_pretrained(checkpoints["v5"], dtype=torch.bfloat16).eval()
    lm = model.model.language_model
    eager, compiled = SuffixLayers(lm, compile=False), SuffixLayers(lm, compile=True)
    kv_heads, head_dim = lm.config.num_key_value_heads, lm.layers[0].self_attn.head_dim
    g = torch.Generator().manual_seed(7)
    torch._dynamo.reset()  # shapes another test compiled this function for would count here
    counters.clear()
    with torch.inference_mode():
        for reused, rows in ((24, 8), (40, 16), (27, 32), (33, 8)):  # the daemon's two, then two others
            pk, pv = (torch.randn(1, kv_heads, reused, head_dim, generator=g).to(torch.bfloat16) for _ in range(2))
            cache = DynamicCache(config=lm.config)
            restore_prefix(cache, [pk] * len(lm.layers), [pv] * len(lm.layers), reused)
            hidden = torch.randn(1, rows, lm.config.hidden_size, generator=g).to(torch.bfloat16)
            ones = torch.ones(1, reused + rows, dtype=torch.long)
            mask = create_causal_mask(config=lm.config, inputs_embeds=hidden, attention_mask=ones, cache=cache)
            cos_sin = lm.rotary_emb(hidden, torch.arange(reused, reused + rows).view(1, 1, -1).expand(3, 1, -1))
            ours, theirs = (
                compiled.attend(0, hidden, cos_sin, pk, pv, mask),
                eager.attend(0, hidden, cos_sin, pk, pv, mask),
            )
            for a, b in zip(ours[:4], theirs[:4], strict=True):  # the float outputs; the router's picks may flip
                torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=0.05)  # at a bf16 near-tie
            index, weights = ours[4:]
            assert index.shape == weights.shape == theirs[4].shape == (rows, lm.config.num_experts_per_tok)
            torch.testing.assert_close(weights.float().sum(-1), torch.ones(rows), atol=0.02, rtol=0)
    assert compiled.compiled and counters["stats"]["unique_graphs"] == 2
