"""The registration variant's bookkeeping on the CPU, with a runtime that refuses what CUDA refuses: no two
registrations overlap, shared edge pages are counted, an evicted range leaves the page cache, a refusal falls back
with one line, and a registered MAP_SHARED mapping holds no anonymous copy. Real registrations: igpu_checks.py."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

import vismmoe_edge
from tests.fake_cudart import FakeRuntime
from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.checkpoint_info import inspect_checkpoint
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.page_ranges import PAGE_SIZE
from vismmoe_edge.experts.store import ExpertStore, ShardFiles
from vismmoe_edge.experts.tiers import igpu_registered
from vismmoe_edge.experts.tiers.igpu_registered import (
    RegistrationRefused,
    SegmentRegistry,
    UnifiedRegisteredTier,
    mapping_anonymous_bytes,
    segments,
)
from vismmoe_edge.hardware import cudart
from vismmoe_edge.hardware.gpu_access import REGISTERED_TIER, SLOTS_TIER, igpu_tier, simulated_integrated
from vismmoe_edge.sampling import SamplingConfig

P = PAGE_SIZE
S = Path("shard")


def test_segments_split_edge_pages_from_the_interior():
    assert segments(S, 10, 100, 1 << 20) == [(S, 0, P)]
    assert segments(S, P - 10, 20, 1 << 20) == [(S, 0, P), (S, P, P)]
    assert segments(S, 100, 5 * P, 1 << 20) == [(S, 0, P), (S, P, 4 * P), (S, 5 * P, P)]
    # two neighbours sharing a page get the very same one-page segment for it, and nothing else in common
    a, b = segments(S, 100, 3 * P, 1 << 20), segments(S, 100 + 3 * P, 3 * P, 1 << 20)
    assert set(a) & set(b) == {(S, 3 * P, P)}


def test_the_registry_never_overlaps_and_counts_shared_pages():
    rt = FakeRuntime()
    registry = SegmentRegistry(rt, {S: 1 << 40})  # type: ignore[arg-type]
    a, b = segments(S, 100, 3 * P, 1 << 20), segments(S, 100 + 3 * P, 3 * P, 1 << 20)
    registry.acquire(a)
    registry.acquire(b)  # the fake refuses overlaps, as cudaHostRegister does (712): none happened
    assert all(flags == cudart.REGISTER_READ_ONLY for _, flags in rt.registered.values())
    assert registry.counts[(S, 3 * P, P)] == 2
    freed = registry.release(a)
    assert (S, 3 * P, P) not in freed and set(freed) == set(a) - {(S, 3 * P, P)}
    assert set(registry.release(b)) == set(b) and rt.registered == {} and registry.registered_bytes == 0


def test_a_refused_registration_undoes_the_others_and_says_why():
    rt = FakeRuntime(refuse_flags=cudart.REGISTER_READ_ONLY)
    registry = SegmentRegistry(rt, {S: 1 << 40})  # type: ignore[arg-type]
    with pytest.raises(RegistrationRefused, match="operation not supported"):
        registry.acquire(segments(S, 100, 5 * P, 1 << 20))
    assert rt.registered == {} and registry.counts == {}


def make_tier(model_dir: Path, runtime: FakeRuntime, slots: int = 8) -> tuple[UnifiedRegisteredTier, ExpertStore]:
    info = inspect_checkpoint(model_dir)
    store = ExpertStore(info.catalogue, ShardFiles(), TORCH_DTYPES[info.catalogue.dtype], torch.device("cpu"))
    return UnifiedRegisteredTier(store, slots, runtime=runtime), store  # type: ignore[arg-type]


def test_an_evicted_range_is_unregistered_and_leaves_the_page_cache(cold_checkpoints):
    rt = FakeRuntime()
    tier, store = make_tier(cold_checkpoints["v5"], rt)
    layer = store.catalogue.moe_layers[0]
    keys = [(layer, 0), (layer, 7)]  # far apart: no shared pages
    for slot, key in enumerate(keys):
        weights = tier.fetch(key, slot)
        reference = store.load(*key)
        assert torch.equal(weights.gate_up, reference.gate_up) and torch.equal(weights.down, reference.down)
    store.files.close()  # the reference's own mapping holds pages that no drop can free
    registered = {(a, n) for a, (n, _) in rt.registered.items()}
    for key in keys:
        for shard, offset, length in tier._segments[key]:
            assert (tier.shards.files[shard].base_address + offset, length) in registered
    tier.release(keys[0], 0)
    for part in store.catalogue.expert(*keys[0]).parts:
        mf = tier.shards.files[part.shard]
        assert pagecache.resident_pages(mf, [(part.offset, part.nbytes)]) == [0]  # gone from the page cache
    for part in store.catalogue.expert(*keys[1]).parts:
        mf = tier.shards.files[part.shard]
        assert pagecache.resident_fraction(mf, [(part.offset, part.nbytes)]) == 1.0  # still registered, resident
    tier.close()
    assert rt.registered == {}


def test_the_registered_tier_gives_the_host_tiers_tokens(checkpoints, images, monkeypatch):
    rt = FakeRuntime()
    monkeypatch.setattr(igpu_registered, "make", lambda store, slots, pinned=0, mirror=None: UnifiedRegisteredTier(
        store, slots, runtime=rt, pinned=pinned))  # fmt: skip
    sampling = SamplingConfig(max_new_tokens=4, min_new_tokens=4)
    tokens = {}
    for tier in ("host", REGISTERED_TIER):
        engine = vismmoe_edge.load(checkpoints["hub"], memory_budget="25%", pinned_layers=1, device="cpu", tier=tier)
        result = engine.generate_from_inputs(engine.encode("What shape is red?", images[:1]), sampling)
        tokens[tier] = result.token_ids
        assert result.experts["evictions"] > 0
        engine.experts.pipeline.close()
    assert tokens["host"] == tokens[REGISTERED_TIER]
    assert rt.calls and all(c[3] == cudart.REGISTER_READ_ONLY for c in rt.calls if c[0] == "register")


def test_refused_registration_falls_back_to_slots_with_one_line():
    for attrs, needle in [({"read_only_host_register_supported": False}, "113"),
                          ({"host_register_supported": False}, "99"),
                          ({"host_pointer_for_registered_mem": False}, "91")]:  # fmt: skip
        tier, note = igpu_tier(simulated_integrated(**attrs), REGISTERED_TIER)
        assert tier == SLOTS_TIER and note is not None and needle in note and "\n" not in note
    assert igpu_tier(simulated_integrated(), REGISTERED_TIER) == (REGISTERED_TIER, None)


def test_smaps_shows_the_private_copy_the_shared_mapping_avoids(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (16 * P))
    with pagecache.MappedFile(path) as shared:  # MAP_SHARED, PROT_READ: what the tier registers
        bytes(shared.buffer[: 16 * P])  # fault every page in
        assert mapping_anonymous_bytes(path) == 0
    with open(path, "r+b") as f:
        private = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # MAP_PRIVATE: safetensors' kind
        private[: 4 * P] = b"\2" * (4 * P)  # what a pin's write-fault does to every page
        assert mapping_anonymous_bytes(path) == 4 * P
        private.close()
    assert mapping_anonymous_bytes(path) is None
