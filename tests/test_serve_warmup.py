"""The daemon builds its decoder for its longest request before it reports ready (serve/warmup.py): later
requests reuse it (one decoder, no new capacity, hence no compile or capture in a request) with transformers'
tokens, nothing stays in the prefix cache and the pipeline's statistics start at zero."""

from __future__ import annotations

import vismmoe_edge
from tests.hf_reference import NEW_TOKENS
from vismmoe_edge.prefix_cache import PrefixCache
from vismmoe_edge.sampling import SamplingConfig
from vismmoe_edge.serve.warmup import warm_decoder
from vismmoe_edge.static_decode import capacity_for


def test_the_warm_decoder_serves_every_later_request(checkpoints, references) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=1, device="cpu", tier="host")
    assert warm_decoder(engine, 1024) is None  # the CPU decodes without a preallocated decoder by default
    engine.static_decode = "on"  # as on CUDA
    engine.prefix_cache = cache = PrefixCache(64 << 20, salt="test")
    assert warm_decoder(engine, 1024) is not None
    (warm,) = engine._decoders.values()
    assert warm.cache.capacity == capacity_for(1024)
    assert engine.experts.pipeline.stats.hits == engine.experts.pipeline.stats.misses == 0
    assert cache.stats().entries == 0
    for name, ref in references.items():
        result = engine.generate_from_inputs(
            ref.inputs, SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        )
        assert result.token_ids == ref.tokens, name
        assert list(engine._decoders.values()) == [warm], name
    assert cache.stats().entries > 0  # the requests did keep their prefixes: the warm-up alone kept none
