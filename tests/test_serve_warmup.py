"""The daemon builds its decoder for its longest request before it reports ready (serve/warmup.py): later
requests reuse it (one decoder, no new capacity, hence no compile or capture in a request) with transformers'
tokens, nothing stays in the prefix cache and the pipeline's statistics start at zero."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

import vismmoe_edge
from tests.hf_reference import NEW_TOKENS
from vismmoe_edge.prefix_cache import PrefixCache
from vismmoe_edge.sampling import SamplingConfig
from vismmoe_edge.serve.metrics import Metrics
from vismmoe_edge.serve.protocol import Limits
from vismmoe_edge.serve.warmup import warm_decoder
from vismmoe_edge.serve.worker import Worker
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


def worker(threads: int) -> Worker:
    engine = SimpleNamespace(text_config=SimpleNamespace(max_position_embeddings=64))
    w = Worker(engine, Limits(), Metrics(), threads=threads)  # type: ignore[arg-type]
    w.thread.start()  # as the daemon starts it before its warm-ups
    return w


def compiles_after_warming(warm_on_worker: bool, threads: int) -> int:
    """Graphs torch.compile builds for a request on a worker of `threads` CPU threads, after a warm-up on the
    worker's thread (`Worker.call`, as the daemon does) or on the loading thread, which runs on one (daemon.py)."""
    graphs = []

    def counting(gm, example_inputs):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, backend=counting, dynamic=False)
    x = torch.randn(8)
    main_threads = torch.get_num_threads()
    w = worker(threads)
    torch.set_num_threads(1)
    try:
        w.call(fn, x) if warm_on_worker else fn(x)
        assert torch.get_num_threads() == 1  # the loading thread's own count is left as it was
        warmed = len(graphs)
        w.call(fn, x)  # a request, on the worker's thread
    finally:
        w.stop.set()
        w.thread.join(timeout=10)
        torch.set_num_threads(main_threads)
        torch._dynamo.reset()
    assert warmed == 1
    return len(graphs) - warmed


def test_the_warm_up_compiles_on_the_workers_thread() -> None:
    """Run 15's daemon log: "GLOBAL_STATE changed: num_threads" recompiled the suffix attention on the first
    question after a cached frame (2.0 s), because the warm-up ran on the loading thread (one CPU thread) and the
    request on the worker (the default count). Warmed on the worker's thread, the request compiles nothing."""
    assert compiles_after_warming(warm_on_worker=True, threads=2) == 0
    assert compiles_after_warming(warm_on_worker=False, threads=2) == 1  # the guard the daemon used to fail


def test_a_call_on_the_worker_returns_and_raises_on_the_caller() -> None:
    w = worker(3)
    try:
        assert w.call(lambda: (torch.get_num_threads(), threading.current_thread().name)) == (3, "vismmoe-worker")
        with pytest.raises(ZeroDivisionError):
            w.call(lambda: 1 / 0)
        assert w.call(lambda: "still serving") == "still serving"
    finally:
        w.stop.set()
        w.thread.join(timeout=10)
