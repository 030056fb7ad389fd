"""Experts computed as they arrive (experts/arrival.py): in waves, the token's output is the batched call's bit for
bit for bf16 slots and quantized records (float32 slots within the batched matmul's own rounding); an engine whose
reads are slow takes that path and still gives transformers' tokens and logits."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import vismmoe_edge
from tests.hf_reference import NEW_TOKENS, assert_matches
from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.test_quant_pool import make_pool
from vismmoe_edge.experts import arrival
from vismmoe_edge.experts import compute as compute_module
from vismmoe_edge.experts.pool_compute import decode_experts
from vismmoe_edge.experts.quant_pool import decode_quantized
from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.quant.packing import ROWMAJOR, native_cpu_layout
from vismmoe_edge.quant.slot_form import SlotForm
from vismmoe_edge.sampling import SamplingConfig

ROUTED = [7, 2, 11, 4]  # the token's experts in the router's order
SLOT_OF = {7: 3, 2: 0, 11: 5, 4: 1}
# (resident at the routing, then the batches in which the others land)
WAVES = [
    [[7, 2, 11, 4]],  # everything resident: one batch
    [[2, 4], [7], [11]],  # two resident, then two landing one after the other
    [[], [11, 4], [2], [7]],  # nothing resident: two land together, then one at a time
]


def in_waves(pool, x: torch.Tensor, weights: torch.Tensor, waves: list[list[int]]) -> torch.Tensor:
    form = arrival.row_form(pool, F.silu)
    assert form is not None
    resident, landings = waves[0], iter(waves[1:])
    reading = [e for wave in waves[1:] for e in wave]
    taken: list[list[int]] = []

    def arrived(still: list[int]) -> list[int]:
        assert still == [e for e in reading if not any(e in t for t in taken)]  # only those not yet computed
        return next(landings)

    def slots_of(batch: list[int]) -> dict[int, int]:
        taken.append(batch)
        return {e: SLOT_OF[e] for e in batch}

    out = arrival.compute_as_they_arrive(x, ROUTED, weights, resident, reading, arrived, slots_of, form,
                                         torch.device("cpu"))  # fmt: skip
    assert taken == [w for w in waves if w]  # the resident batch first, then each landing as it came
    return out


@pytest.mark.parametrize("waves", WAVES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_slots_in_waves_equal_the_batched_call(dtype: torch.dtype, waves: list[list[int]]) -> None:
    g = torch.Generator().manual_seed(0)
    hidden, inter, slots = 64, 48, 6
    pool = SimpleNamespace(gate_up=(torch.randn(slots, 2 * inter, hidden, generator=g) * 0.1).to(dtype),
                           down=(torch.randn(slots, hidden, inter, generator=g) * 0.1).to(dtype))  # fmt: skip
    x = torch.randn(1, hidden, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(1, len(ROUTED), generator=g), -1).to(dtype)
    batched = decode_experts(x, torch.tensor([[SLOT_OF[e] for e in ROUTED]]), weights, pool.gate_up, pool.down, F.silu)
    ours = in_waves(pool, x, weights, waves)
    if dtype == torch.bfloat16 or len(waves) == 1:
        assert torch.equal(ours, batched)
    else:  # the CPU's float32 batched matmul rounds a row differently with the batch's size (module docstring)
        torch.testing.assert_close(ours, batched, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("waves", WAVES)
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_records_in_waves_equal_the_batched_call(bits: int, waves: list[list[int]]) -> None:
    spec, records, _ = make_pool(bits, native_cpu_layout() or ROWMAJOR if bits == 4 else ROWMAJOR)
    pool = SimpleNamespace(records=records, form=SlotForm.for_device(spec, torch.device("cpu")))
    x = torch.randn(1, spec.hidden).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(1, len(ROUTED)), -1).to(torch.bfloat16)
    slots = torch.tensor([[SLOT_OF[e] for e in ROUTED]])
    batched = decode_quantized(x, slots, weights, records, pool.form, F.silu)
    assert torch.equal(in_waves(pool, x, weights, waves), batched)


@pytest.mark.parametrize("tier,static", [("unified-slots", False), ("host", False), ("host", True)])
def test_an_engine_with_slow_reads_computes_experts_as_they_arrive(
    checkpoints, references, monkeypatch: pytest.MonkeyPatch, tier: str, static: bool
) -> None:
    """Every fill slowed by 5 ms: a decode token's layer finds experts still being read, computes the others
    first, and the tokens and logits stay transformers'; `static`: the preallocated-cache decoder (what CUDA
    graphs replay, eager here), whose layer then runs eagerly instead of its experts' graph."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=1, tier=tier, device="cpu")
    if static:
        engine.static_decode = "on"
        assert engine.uses_static_decode()
    pipeline_tier = engine.experts.pipeline.tier
    fetch = pipeline_tier.fetch

    def slow_fetch(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.005)
        return fetch(*args, **kwargs)

    monkeypatch.setattr(pipeline_tier, "fetch", slow_fetch)
    monkeypatch.setattr(compute_module, "ARRIVAL_MIN_BYTES", 0)  # this checkpoint's experts are a few KB
    splits: list[tuple[list[int], list[int]]] = []
    original = compute_module.compute_as_they_arrive

    def spy(x, routed, weights, resident, reading, *args):  # type: ignore[no-untyped-def]
        splits.append((resident, reading))
        return original(x, routed, weights, resident, reading, *args)

    monkeypatch.setattr(compute_module, "compute_as_they_arrive", spy)
    stepped: list[int] = []
    arriving_step = compute_module.OffloadedExperts.arriving_step

    def step_spy(self, *args):  # type: ignore[no-untyped-def]
        stepped.append(self.layer)
        return arriving_step(self, *args)

    monkeypatch.setattr(compute_module.OffloadedExperts, "arriving_step", step_spy)
    assert_matches(engine, references, static=static, atol=1e-5)
    assert splits, "no layer found an expert still being read"
    assert all(reading for _, reading in splits) and any(resident for resident, _ in splits)
    assert bool(stepped) == static  # the static decoder's layer step, or the module's forward


def test_small_reads_keep_the_batched_call(checkpoints, references, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads still in flight of fewer than ARRIVAL_MIN_BYTES (this checkpoint's experts are a few KB): the layer
    waits for them and runs its one batched call, as the host work of computing in batches would cost more."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", pinned_layers=1, tier="host", device="cpu")
    pipeline_tier = engine.experts.pipeline.tier
    assert 8 * pipeline_tier.slot_bytes < compute_module.ARRIVAL_MIN_BYTES
    fetch = pipeline_tier.fetch

    def slow_fetch(*args, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(0.005)
        return fetch(*args, **kwargs)

    monkeypatch.setattr(pipeline_tier, "fetch", slow_fetch)
    monkeypatch.setattr(compute_module, "compute_as_they_arrive", lambda *a: pytest.fail("computed in batches"))
    ref = references["one_image"]
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    result = engine.generate_from_inputs(ref.inputs, sampling)
    assert result.token_ids == ref.tokens and result.experts["misses"] > 0


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("waves", WAVES)
def test_triton_int4_rows_in_waves_equal_the_batched_kernel(waves: list[list[int]]) -> None:
    """int4 records in the Triton form (the GPU's): each batch is one launch of the GEMVs over its experts, a row
    a program, so the rows and their sum are the batched launch's bit for bit."""
    spec, records, _ = make_pool(4, ROWMAJOR, hidden=256, inter=64, group=32)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    pool = SimpleNamespace(records=records, form=form)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights = torch.softmax(torch.randn(1, len(ROUTED)), -1).to(torch.bfloat16)
    slots = torch.tensor([[SLOT_OF[e] for e in ROUTED]])
    batched = md.fused_decode_records(x, slots, weights, records, form, F.silu)
    assert torch.equal(in_waves(pool, x, weights, waves), batched)
