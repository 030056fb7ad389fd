"""The daemon's decoder, built for its longest request before it reports ready.

On CUDA the first decode token of each new KV capacity waits for torch.compile and the graph capture: run 8's
daemon log (docs/benchmarks.md) shows a first 8-token reply at 0.8 tok/s, ~10 s on an H200, where the next ran at
190-200. The engine keeps one decoder a mode, at the largest capacity asked so far, and every shorter request
reuses it (Engine.start_decode). So two tokens of a short prompt, decoded with room for the daemon's longest
request (`--max-prompt-tokens` + `--max-tokens`), make every later request find its decoder compiled and captured;
the plan counts that KV already (the context it plans for). Nothing is kept in the prefix cache and the pipeline's
statistics are reset after. The daemon runs both on the worker's thread (`Worker.call`): torch.compile guards the
calling thread's state (its CPU thread count among it), and a warm-up on another thread left the first request
to compile again (run 15).
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("vismmoe_edge.serve")

WARMUP_PROMPT = "Hello."


def warm_decoder(engine: Any, positions: int) -> float | None:
    """Decode two tokens with a KV capacity of `positions`; returns the seconds it took, or None where the engine
    decodes without a preallocated decoder (the CPU by default, the page-cache tiers)."""
    # imported here: the daemon's modules import no torch (tests/test_server.py)
    from vismmoe_edge.sampling import SamplingConfig

    if not engine.uses_static_decode():
        return None
    start = time.perf_counter()
    inputs = engine.encode(WARMUP_PROMPT)
    room = positions - inputs.num_tokens - 1  # start_decode sizes the KV for the prompt, the reply and one more
    if room < 2:
        return None
    tokens = 0

    def two_tokens() -> bool:
        nonlocal tokens
        tokens += 1
        return tokens > 2

    sampling = SamplingConfig(max_new_tokens=room, min_new_tokens=2)
    engine.generate_from_inputs(inputs, sampling, should_stop=two_tokens, use_cache=False)
    engine.experts.pipeline.reset_stats()
    return time.perf_counter() - start


def warm_suffix_graphs(engine: Any) -> float | None:
    """Compile the explicit attention of the question after a cached frame (suffix_graph.py,
    kernels/suffix_layer.py) for its warm shapes (suffix_graph.WARM_SHAPES), so that no request waits for it;
    returns the seconds it took, or None where nothing compiles (the CPU, no prefix cache, layers that need the
    host). A failure is logged and turns the suffix graphs off: the daemon serves on, prefilling such questions
    eagerly."""
    if engine.prefix_cache is None:
        return None
    start = time.perf_counter()
    try:
        warmed = engine.suffix_graphs.warm()
    except Exception:  # an optimisation's warm-up must not keep the daemon from serving
        log.exception("warming the suffix graphs failed; prefilling questions after a cached frame eagerly")
        engine.suffix_graphs.enabled = False
        return None
    engine.experts.pipeline.reset_stats()
    return time.perf_counter() - start if warmed else None
