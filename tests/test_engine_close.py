"""Engine.close: a service that reloads models gets its threads and file descriptors back."""

from __future__ import annotations

import os
from pathlib import Path

import vismmoe_edge
from vismmoe_edge.sampling import SamplingConfig


def _open_shards(model_dir: Path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(model_dir))
        except OSError:
            continue
    return count


def test_close_stops_the_threads_and_unmaps_the_shards(checkpoints) -> None:
    model_dir = checkpoints["v5"]
    before = _open_shards(model_dir)
    with vismmoe_edge.load(model_dir, memory_budget="25%", pinned_layers=1, device="cpu", tier="host") as engine:
        engine.generate("Hello", sampling=SamplingConfig(max_new_tokens=2))
        assert _open_shards(model_dir) > before  # the shards the experts are read from are mapped
        workers = list(engine.experts.pipeline._workers)
        assert workers and all(w.is_alive() for w in workers)
    assert not any(w.is_alive() for w in workers)
    assert _open_shards(model_dir) == before


def test_close_keeps_shards_that_compute_reads_in_place(checkpoints) -> None:
    """The unified tier computes from the mapped shards: close leaves those maps to their tensors, and says nothing."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="unified")
    engine.generate("Hello", sampling=SamplingConfig(max_new_tokens=2))
    engine.close()
    assert not any(w.is_alive() for w in engine.experts.pipeline._workers)
