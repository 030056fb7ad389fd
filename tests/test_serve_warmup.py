"""The daemon builds its decoder for its longest request before it reports ready (serve/warmup.py): later
requests reuse it (one decoder, no new capacity, hence no compile or capture in a request) with transformers'
tokens, nothing stays in the prefix cache and the pipeline's statistics start at zero."""

from __future__ import annotations

import pytest

import vismmoe_edge
from tests.hf_reference import NEW_TOKENS
from vismmoe_edge.prefix_cache import PrefixCache
from vismmoe_edge.sampling import SamplingConfig
from vismmoe_edge.serve.warmup import on_worker_threads, warm_decoder
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


def compiles_on_threads(warm_threads: int, serve_threads: int) -> int:
    """Graphs torch.compile builds for one function warmed by `on_worker_threads(warm_threads)` on a loading
    thread that runs on one (as daemon.py's), then called on a worker thread that runs on `serve_threads`."""
    import threading

    import torch

    graphs = []

    def counting(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, backend=counting, dynamic=False)
    x = torch.randn(8)
    main_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        on_worker_threads(warm_threads, fn, x)
        assert torch.get_num_threads() == 1  # the loading thread's own count is left as it was
        warmed = len(graphs)

        def serve() -> None:
            torch.set_num_threads(serve_threads)
            fn(x)

        worker = threading.Thread(target=serve)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(main_threads)
        torch._dynamo.reset()
    assert warmed == 1
    return len(graphs) - warmed


def test_the_warm_up_compiles_with_the_workers_thread_count() -> None:
    """Run 15's daemon log: "GLOBAL_STATE changed: num_threads" recompiled the suffix attention on the first
    question after a cached frame (2.0 s), because the warm-up ran on the loading thread (one thread) and the
    request on the worker (the default count). Warmed with the worker's count, the request compiles nothing."""
    assert compiles_on_threads(warm_threads=2, serve_threads=2) == 0
    assert compiles_on_threads(warm_threads=1, serve_threads=2) == 1  # the guard the daemon used to fail


def test_on_worker_threads_returns_and_raises_on_the_caller() -> None:
    import torch

    assert on_worker_threads(3, torch.get_num_threads) == 3
    with pytest.raises(ZeroDivisionError):
        on_worker_threads(1, lambda: 1 / 0)
