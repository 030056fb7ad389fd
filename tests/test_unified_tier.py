"""The unified tier on real files and the real page cache: residency follows the pipeline's decisions."""

from __future__ import annotations

from pathlib import Path

import pytest

import vismmoe_edge
from vismmoe_edge.experts import pagecache
from vismmoe_edge.sampling import SamplingConfig


def resident_pages_per_part(tier, key) -> list[int]:
    return [n for s, r in tier.shards.ranges(key).items() for n in pagecache.resident_pages(tier.shards.files[s], r)]


def missing_pages_per_part(tier, key) -> list[int]:
    out = []
    for s, r in tier.shards.ranges(key).items():
        resident = pagecache.resident_pages(tier.shards.files[s], r)
        out += [total - n for total, n in zip(pagecache.span_pages(r), resident, strict=True)]
    return out


def expert_residency(tier, key) -> float:
    fractions = [pagecache.resident_fraction(tier.shards.files[s], r) for s, r in tier.shards.ranges(key).items()]
    return min(fractions)


@pytest.fixture()
def fresh_checkpoint(cold_checkpoints) -> Path:
    return cold_checkpoints["v5"]


def test_resident_pages_follow_the_cache(fresh_checkpoint: Path, images) -> None:
    engine = vismmoe_edge.load(fresh_checkpoint, memory_budget="25%", pinned_layers=1, tier="unified")
    pipeline = engine.experts.pipeline
    tier = pipeline.tier
    if not next(iter(tier.shards.files.values())).truthful_mincore:
        pytest.skip("mincore does not tell the truth to this user (not the files' owner)")
    # the pinned prefix is in the page cache now, before any request
    assert all(expert_residency(tier, (0, e)) == 1.0 for e in range(16))
    assert engine.experts.lock_report.locked_bytes + engine.experts.lock_report.failed_bytes > 0

    engine.generate("Count the shapes.", [images[0]], SamplingConfig(max_new_tokens=6, min_new_tokens=6))
    pipeline.drain()
    resident = pipeline.resident_keys()
    streamed = [(layer, e) for layer in range(1, 10) for e in range(16)]
    kept = [k for k in streamed if k in resident]
    dropped = [k for k in streamed if k not in resident]
    assert kept and dropped and pipeline.stats.evictions > 0
    # what the pipeline holds is in memory; what it evicted is gone, but for the first and last page of each
    # byte range, which a resident neighbour may share
    assert max(max(missing_pages_per_part(tier, k)) for k in kept) <= 2
    # A drop is best effort: CI once saw one evicted expert's 13 pages stay (the run before and after were
    # clean), so one stray expert in twenty is allowed; a tier that did not release would keep them all.
    stuck = [k for k in dropped if max(resident_pages_per_part(tier, k)) > 2]
    assert len(stuck) <= max(1, len(dropped) // 20), stuck
    pipeline.close()


@pytest.mark.parametrize("method", ["pread", "madvise"])
def test_prefetch_makes_an_expert_resident(fresh_checkpoint: Path, method: str) -> None:
    engine = vismmoe_edge.load(fresh_checkpoint, memory_budget="50%", tier="unified")
    pipeline = engine.experts.pipeline
    tier = pipeline.tier
    tier.method = method
    if not next(iter(tier.shards.files.values())).truthful_mincore:
        pytest.skip("mincore does not tell the truth to this user (not the files' owner)")
    assert expert_residency(tier, (9, 3)) == 0.0
    pipeline.prefetch([((9, 3), 1.0)], current_layer=0)
    pipeline.drain()
    assert expert_residency(tier, (9, 3)) == 1.0
    assert pipeline.stats.speculative_bytes == engine.catalogue.expert_bytes
    pipeline.close()


def test_unified_tier_refuses_a_dtype_it_cannot_compute_from_the_page_cache(checkpoints) -> None:
    with pytest.raises(vismmoe_edge.VismmoeError, match="compute dtype must be the checkpoint's"):
        vismmoe_edge.load(checkpoints["v5"], memory_budget="50%", tier="unified", dtype="bfloat16")
