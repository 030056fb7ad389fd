"""The integrated-GPU slot tier's filling code on the CPU: one host write per expert byte, straight into the slot,
no page cache left behind, O_DIRECT where aligned, slot reuse after the GPU's `freed` event, and the same
tokens as the other tiers in every expert layout. What needs CUDA is in tools/device/igpu_checks.py."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
import torch

import vismmoe_edge
from vismmoe_edge.checkpoint import TORCH_DTYPES
from vismmoe_edge.checkpoint_info import inspect_checkpoint
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts import pagecache
from vismmoe_edge.experts.page_ranges import PAGE_SIZE, page_span
from vismmoe_edge.experts.store import ExpertStore, ShardFiles
from vismmoe_edge.experts.tiers import slot_fill
from vismmoe_edge.experts.tiers.igpu_slots import UnifiedSlotTier
from vismmoe_edge.experts.tiers.slot_fill import DirectAlignment, Read, SlotFiller, split
from vismmoe_edge.sampling import SamplingConfig


def io_counters() -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


class CountingReader:
    """Wraps the real pread path and records every destination it writes to."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, int, int, bool]] = []  # (dest, length, file offset, O_DIRECT)

    def __call__(self, fd: int, ranges, dests) -> None:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        self.writes += [(d, n, o, direct) for (o, n), d in zip(ranges, dests, strict=True)]
        slot_fill.default_reader(fd, ranges, dests)


def shards_of(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def make_tier(model_dir: Path, slots: int = 8, **kw) -> tuple[UnifiedSlotTier, ExpertStore]:
    info = inspect_checkpoint(model_dir)
    dtype = TORCH_DTYPES[info.catalogue.dtype]
    store = ExpertStore(info.catalogue, ShardFiles(), dtype, torch.device("cpu"))
    return UnifiedSlotTier(store, slots, **kw), store


@pytest.mark.parametrize("layout", ["v5", "hub", "per_expert"])
def test_a_miss_writes_each_byte_once_into_its_slot_and_leaves_no_page_cache(cold_checkpoints, layout):
    reader = CountingReader()
    tier, store = make_tier(cold_checkpoints[layout], reader=reader)
    keys = [(store.catalogue.moe_layers[i % 3], 3 * i) for i in range(5)]
    for shard in shards_of(cold_checkpoints[layout]):
        tier.filler.shard(shard)  # opened (and its O_DIRECT alignment asked) before anything is counted
        assert pagecache.evict_file(shard, attempts=50) == 0
    copies: list[torch.Size] = []
    original_copy = torch.Tensor.copy_

    def counting_copy(self, *args, **kwargs):
        copies.append(self.shape)
        return original_copy(self, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    fetched = []
    try:
        for slot, key in enumerate(keys):
            before, n_writes, n_copies = io_counters(), len(reader.writes), len(copies)
            weights = tier.fetch(key, slot)
            after = io_counters()
            assert len(copies) == n_copies  # no staging buffer, no torch copy: the reads are the only writes
            writes = sorted(reader.writes[n_writes:])
            loc = store.catalogue.expert(*key)
            # every write lands in this slot, the writes tile the slot exactly once, and they are the expert's bytes
            spans = tier.slot_ranges(slot)
            assert all(any(a <= d and d + n <= a + s for a, s in spans) for d, n, _, _ in writes)
            assert sum(n for _, n, _, _ in writes) == loc.nbytes == tier.read_bytes(key) == tier.slot_bytes
            covered = sorted((d, d + n) for d, n, _, _ in writes)
            assert all(b[0] >= a[1] for a, b in zip(covered, covered[1:], strict=False))  # no byte written twice
            # the kernel delivered each byte once (rchar also counts this /proc read, < 1 KiB), read from disk
            assert loc.nbytes <= after["rchar"] - before["rchar"] < loc.nbytes + 1024
            span_bytes = sum(e - s for s, e in (page_span(p.offset, p.nbytes) for p in loc.parts))
            assert 0 < after["read_bytes"] - before["read_bytes"] <= span_bytes  # FADV_RANDOM: no read-around
            for part in loc.parts:  # and none of those pages stays in the page cache
                with pagecache.MappedFile(part.shard) as mf:
                    assert pagecache.resident_pages(mf, [(part.offset, part.nbytes)]) == [0], part
            fetched.append((key, weights))
    finally:
        torch.Tensor.copy_ = original_copy
    for key, weights in fetched:  # the right bytes, in nn.Linear orientation (read last: faults read around)
        reference = store.load(*key)
        assert torch.equal(weights.gate_up, reference.gate_up) and torch.equal(weights.down, reference.down)
    fills = tier.fill_stats  # where the fills' time went: the reads, and no GPU to wait for on the CPU
    assert fills.read_s > 0 and fills.wait_s >= 0 and fills.direct_bytes + fills.buffered_bytes == 5 * tier.slot_bytes
    tier.close()


def test_direct_reads_skip_the_page_cache_and_the_cpu(tmp_path):
    path = tmp_path / "aligned.bin"
    payload = os.urandom(3 << 20)
    path.write_bytes(payload)
    pagecache.evict_file(path)
    dest = torch.zeros(4 << 20, dtype=torch.uint8)  # page-aligned by torch's allocator (64-byte at least)
    base = dest.data_ptr() + (-dest.data_ptr()) % PAGE_SIZE
    reader = CountingReader()
    filler = SlotFiller(reader=reader)
    shard = filler.shard(path)
    if shard.direct_fd is None:
        pytest.skip(f"no O_DIRECT on {path.parent}")
    # [1000, 1000 + 2 MiB + 5000): an unaligned head and tail around an aligned interior
    start, length = 1000, (2 << 20) + 5000
    stats = filler.fill([Read(path, start, length, base + start)])
    direct = [(d, n) for d, n, _, is_direct in reader.writes if is_direct]
    assert stats.direct_bytes == sum(n for _, n in direct) > 2 << 20
    assert stats.direct_bytes + stats.buffered_bytes == length
    got = dest[base - dest.data_ptr() + start : base - dest.data_ptr() + start + length].numpy().tobytes()
    assert got == payload[start : start + length]
    with pagecache.MappedFile(path) as mf:
        assert pagecache.resident_pages(mf, [(start, length)]) == [0]
    filler.close()


def test_split_puts_only_the_aligned_interior_on_o_direct():
    a = DirectAlignment(512, 512, "test")
    direct, buffered = split(Read(Path("x"), 1000, 10_000, 5000), a)  # dest - offset = 4000: not a multiple
    assert direct == [] and buffered == [(1000, 10_000, 5000)]
    direct, buffered = split(Read(Path("x"), 1000, 10_000, 1000 + 8192), a)
    assert direct == [(1024, 9728, 8192 + 1024)]
    assert buffered == [(1000, 24, 8192 + 1000), (10752, 248, 8192 + 10752)]
    assert sum(n for _, n, _ in direct + buffered) == 10_000
    assert split(Read(Path("x"), 0, 100, 0), a) == ([], [(0, 100, 0)])  # too short for one aligned block
    assert split(Read(Path("x"), 0, 100, 0), None) == ([], [(0, 100, 0)])


def test_a_slot_is_refilled_only_after_the_gpu_says_it_is_done(checkpoints):
    log = []
    reader = CountingReader()

    def logging_reader(fd, ranges, dests):
        log.append("read")
        reader(fd, ranges, dests)

    tier, store = make_tier(checkpoints["v5"], reader=logging_reader)

    class Event:
        def __init__(self, slot: int) -> None:
            self.slot = slot

        def synchronize(self) -> None:
            log.append(f"wait freed[{self.slot}]")

        def record(self, stream=None) -> None:
            log.append(f"record freed[{self.slot}]")

    tier.on_gpu = True  # the CUDA ordering, with events that log instead of waiting
    tier.freed = [Event(i) for i in range(8)]
    key = (store.catalogue.moe_layers[0], 0)
    tier.fetch(key, 2)
    assert log[0] == "wait freed[2]" and set(log[1:]) == {"read"}


def test_the_slot_tier_serves_every_layout_like_the_host_tier(checkpoints, images):
    prompt, sampling = "What shape is red?", SamplingConfig(max_new_tokens=4, min_new_tokens=4)
    for layout in ("hub", "per_expert"):
        tokens = {}
        for tier in ("host", "unified-slots"):
            engine = vismmoe_edge.load(checkpoints[layout], memory_budget="25%", pinned_layers=1, device="cpu",
                                       tier=tier)  # fmt: skip
            result = engine.generate_from_inputs(engine.encode(prompt, images[:1]), sampling)
            tokens[tier] = result.token_ids
            assert result.experts["misses"] > 0 and result.experts["evictions"] > 0
            assert engine.experts.pipeline.tier.name == ("host-slots" if tier == "host" else "unified-slots")
            engine.experts.pipeline.close()
        assert tokens["host"] == tokens["unified-slots"], layout


def test_the_compute_dtype_must_be_the_checkpoints(checkpoints):
    info = inspect_checkpoint(checkpoints["v5"])
    store = ExpertStore(info.catalogue, ShardFiles(), torch.bfloat16, torch.device("cpu"))
    with pytest.raises(VismmoeError, match="compute dtype must be the checkpoint's"):
        UnifiedSlotTier(store, 4)


def test_after_loading_the_page_cache_holds_no_weight(cold_checkpoints):
    """Non-expert weights live once, in the model's tensors; experts in the slots (shared DRAM on a Jetson)."""
    model_dir = cold_checkpoints["v5"]
    info = inspect_checkpoint(model_dir)  # before: reading the headers reads ahead into the tensors
    for shard in shards_of(model_dir):
        assert pagecache.evict_file(shard, attempts=50) == 0
    engine = vismmoe_edge.load(model_dir, memory_budget="50%", pinned_layers=2, device="cpu", tier="unified-slots")
    resident = 0
    for tensor in info.table.values():
        with pagecache.MappedFile(tensor.shard) as mf:
            resident += pagecache.resident_pages(mf, [(tensor.offset, tensor.nbytes)])[0]
    assert resident == 0
    assert engine.experts.pipeline.stats.pinned_bytes == 2 * info.catalogue.layer_bytes(info.catalogue.moe_layers[0])
    engine.experts.pipeline.close()


def test_a_quantized_files_slot_form_on_cuda_is_its_own_rows(tmp_path):
    """On CUDA the records' int4 codes must already be row-major (the Triton GEMV reads them where the read left
    them); a file in a CPU's tiles is refused in one line naming `--layout rowmajor`. Pure bookkeeping: no CUDA
    needed to decide it."""
    from vismmoe_edge.conversion import quantize_checkpoint
    from vismmoe_edge.experts.tiers.igpu_slots import record_form
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    src = build_tiny_checkpoint(tmp_path / "src", seed=7, num_layers=2, moe_intermediate=96)
    forms = {}
    for layout in ("rowmajor", "cpu_b16_pairs"):
        q = quantize_checkpoint(src, tmp_path / layout, 4, 32, progress=False, layout=layout)
        store = ExpertStore(inspect_checkpoint(q).catalogue, ShardFiles(), torch.bfloat16, torch.device("cuda"))
        try:
            forms[layout] = record_form(store)
        except VismmoeError as e:
            forms[layout] = str(e)
    assert forms["rowmajor"].triton_int4 and not forms["rowmajor"].rebuilds
    assert "cpu_b16_pairs" in forms["cpu_b16_pairs"] and "--layout rowmajor" in forms["cpu_b16_pairs"]
