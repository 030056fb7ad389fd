"""The whole decode token on the device (StaticDecoder.token_step): routing read through the expert table, the
next token chosen by the device sampler. Run eagerly on the CPU here, exactly against transformers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3VLMoeForConditionalGeneration
from transformers.activations import ACT2FN

import vismmoe_edge
from tests.hf_reference import NEW_TOKENS
from vismmoe_edge.device_sampling import DeviceSampler
from vismmoe_edge.experts.pool_compute import decode_experts
from vismmoe_edge.experts.table import ABSENT
from vismmoe_edge.experts.tier import TierDefaults
from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.sampling import SamplingConfig


@pytest.mark.parametrize(
    ("budget", "fused", "ahead"),
    [("100%", False, "auto"), ("25%", False, "off"), ("25%", False, "on"), ("25%", True, "auto")],
)
def test_device_token_matches_transformers(checkpoints, references, budget: str, fused: bool, ahead: str) -> None:
    """`fused`: the layers' attention and router as kernels/decode_layer.py spells them (compiled on CUDA).
    `ahead`: tokens launched before the host read the one before ("auto": once every expert has a slot; "on" at
    25%: a miss also discards the token launched after it)."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget=budget, pinned_layers=1, device="cpu", tier="host")
    engine.static_decode = "on"
    engine.device_decode = "on"
    engine.compile_decode = fused
    engine.decode_ahead = ahead
    assert engine.uses_static_decode() and engine.uses_device_decode()
    for name, ref in references.items():
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert engine.generate_from_inputs(ref.inputs, sampling).token_ids == ref.tokens, name
    (decoder,) = engine._decoders.values()
    assert decoder.on_device and (decoder.fused is not None) == fused
    rows = [decoder.missed[m] for m in range(len(decoder.moe))]
    rows += [decoder.cache.lengths[i : i + 1] for i in range(len(decoder.cache.keys))]
    assert all(r.data_ptr() % 16 == 0 for r in rows)  # what compiled layers take a row at a time: never cloned
    assert decoder.host_length == int(decoder.cache.lengths[0])  # the host's count of positions stayed exact
    assert decoder.pending is None  # the reply's end discarded the token launched after its last
    tokens = len(references) * (NEW_TOKENS - 1)
    if ahead == "off" or (ahead == "auto" and budget == "25%"):
        assert decoder.ran_ahead == decoder.discarded == 0
    elif ahead == "auto":  # no stop token ends these replies early: only cold misses throw tokens away
        assert decoder.ran_ahead > 0 and decoder.discarded <= decoder.redone
    else:  # at 25% every token misses here, so each token launched after one is thrown away
        assert decoder.discarded > 0
    if ahead != "off" and not (ahead == "auto" and budget == "25%"):  # all but each reply's first were launched ahead
        assert decoder.ran_ahead + decoder.discarded == tokens - len(references)
    pipeline = engine.experts.pipeline
    if budget == "25%":  # misses: tokens redone through the per-layer path, and still transformers' tokens
        assert 0 < decoder.redone <= tokens
    else:  # the first tokens fetch what the table lacks; once everything is in, no token is redone
        assert decoder.redone < tokens
        assert decoder.table.version == pipeline.residency_version  # the last token read a current table
    decoder.table.sync(pipeline)
    resident = pipeline.resident_slots()
    assert int((decoder.table.slots >= 0).sum()) == len(resident) > 0
    assert all(int(decoder.table.slots[layer, expert]) == slot for (layer, expert), slot in resident.items())


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_the_one_kernel_router_gives_transformers_tokens_in_the_interpreter(
    checkpoints, references, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled token's router on CUDA (kernels/decode_router.py route_and_lookup: GEMV, top-k, table lookup
    and the routing rows in one kernel), here under Triton's interpreter in the fused decoder: transformers' tokens
    with every expert resident, and the routing rows the host reads are the router's."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=1, device="cpu", tier="host")
    engine.static_decode = engine.device_decode = "on"
    engine.compile_decode = True  # the fused layers, eager on the CPU
    ref = references["one_image"]
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert engine.generate_from_inputs(ref.inputs, sampling).token_ids == ref.tokens  # slots filled on the way
    (decoder,) = engine._decoders.values()
    assert decoder.fused.router_counter is None  # the CPU's own choice: transformers' router
    import vismmoe_edge.kernels.decode_layer as dl

    calls, kernel = [], dl.route_and_lookup
    monkeypatch.setattr(dl, "route_and_lookup", lambda *a: (calls.append(1), kernel(*a))[1])
    pipeline = engine.experts.pipeline
    touch = pipeline.touch
    seen: dict[str, list[tuple[int, list[int]]]] = {"transformers": [], "one kernel": []}
    for router in seen:
        if router == "one kernel":
            decoder.fused.router_counter = torch.zeros(1, dtype=torch.int32)  # as a compiled CUDA decoder holds it
        redone = decoder.redone
        pipeline.touch = lambda layer, experts, router=router: (seen[router].append((layer, list(experts))),
                                                                touch(layer, experts))  # fmt: skip
        assert engine.generate_from_inputs(ref.inputs, sampling).token_ids == ref.tokens, router
        assert decoder.redone == redone  # every expert resident: no token redone
    assert int(decoder.fused.router_counter) == 0 and len(calls) == (NEW_TOKENS - 1) * len(decoder.moe)
    assert seen["one kernel"] == seen["transformers"] and len(seen["transformers"]) > 0  # the rows the host reads


def test_tokens_launched_ahead_change_no_token(checkpoints, references) -> None:
    """A stop token ends a reply with the next token already launched: it is discarded and the KV position rolled
    back. Sampled replies draw the same tokens for the same seed as without launching ahead."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu", tier="host")
    engine.static_decode = engine.device_decode = "on"
    ref = references["one_image"]
    stop = ref.tokens[3]
    until_stop = ref.tokens[: ref.tokens.index(stop) + 1]
    greedy = SamplingConfig(max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
    sampled = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, temperature=1.0, seed=3)
    replies = {}
    for ahead in ("off", "auto"):
        engine.decode_ahead = ahead
        replies[ahead] = [engine.generate_from_inputs(ref.inputs, c).token_ids for c in (greedy, sampled, greedy)]
    (decoder,) = engine._decoders.values()
    assert replies["off"] == replies["auto"] and replies["auto"][0] == until_stop
    assert decoder.ran_ahead > 0 and decoder.discarded >= 1  # the token launched after the stop token
    assert decoder.host_length == int(decoder.cache.lengths[0])


def test_device_decode_is_off_where_something_watches_the_routing(checkpoints) -> None:
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="host",
                               predictor="previous-token")  # fmt: skip
    engine.device_decode = "on"
    assert not engine.uses_device_decode()  # the predictor needs each layer's routing as it happens
    plain = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu", tier="host")
    assert not plain.uses_device_decode()  # "auto" on the CPU: the host path


def _pool(slots: int = 5, inter: int = 8, hidden: int = 16, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)

    class Pool:
        gate_up = torch.randn(slots, 2 * inter, hidden, generator=g, dtype=dtype)
        down = torch.randn(slots, hidden, inter, generator=g, dtype=dtype)

    return Pool, torch.randn(1, hidden, generator=g, dtype=dtype)


def test_moe_decode_reads_the_table_and_flags_absent_experts() -> None:
    pool, x = _pool()
    table = torch.full((10,), ABSENT, dtype=torch.int32)
    table[[3, 7, 9]] = torch.tensor([4, 0, 2], dtype=torch.int32)
    index, weights = torch.tensor([[7, 3]]), torch.tensor([[0.25, 0.75]])
    out, missed = md.moe_decode(x, index, weights, table, pool, F.silu)
    assert not bool(missed)
    expect = decode_experts(x, torch.tensor([[0, 4]]), weights, pool.gate_up, pool.down, F.silu)
    assert torch.equal(out, expect)  # the same computation as the per-layer path: exact
    _, missed = md.moe_decode(x, torch.tensor([[7, 5]]), weights, table, pool, F.silu)
    assert bool(missed)  # expert 5 is in no slot


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_fused_gemv_matches_the_torch_path_in_the_interpreter() -> None:
    pool, x = _pool(slots=4, inter=24, hidden=40, dtype=torch.bfloat16)  # shapes that leave partial blocks
    slots, weights = torch.tensor([[3, 1]]), torch.tensor([[0.6, 0.4]])
    assert md.use_triton(pool.gate_up)
    for act in (F.silu, ACT2FN["silu"], F.gelu):  # SiLU folds into the down GEMV; others run between the two
        fused = md.fused_decode(x, slots, weights, pool.gate_up, pool.down, act).float()
        ref = decode_experts(x.float(), slots, weights, pool.gate_up.float(), pool.down.float(), act)
        assert torch.allclose(fused, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
        rows = md.fused_decode(x, slots, weights, pool.gate_up, pool.down, act, summed=False)  # summed by the caller
        assert rows.shape == (2, 40) and torch.equal(rows.sum(0, keepdim=True).to(x.dtype).float(), fused)
    assert md.is_silu(torch.nn.SiLU()) and md.is_silu(ACT2FN["silu"]) and not md.is_silu(F.gelu)


def test_device_sampler_greedy_masks_stop_tokens_until_min_new_tokens() -> None:
    sampler = DeviceSampler(5, torch.device("cpu"))
    sampler.set_stops([4])
    logits = torch.tensor([0.0, 1.0, 3.0, 0.5, 9.0])
    assert sampler.configure(SamplingConfig(min_new_tokens=2))
    sampler.count_from(1)
    sampler.choose(logits)
    assert int(sampler.token) == 2  # the stop token 4 is masked while fewer than 2 tokens exist
    assert not sampler.configure(SamplingConfig(min_new_tokens=2))  # the same knobs: nothing rewritten
    sampler.choose(logits)  # the device counter advanced: 2 tokens exist now
    assert int(sampler.token) == 4 and int(sampler.produced) == 3
    assert sampler.configure(SamplingConfig(temperature=1e-9))  # a tiny temperature is greedy, not inf
    assert not sampler.sampling
    sampler.choose(logits)
    assert int(sampler.token) == 4


def test_device_sampler_draws_from_the_nucleus_in_proportion() -> None:
    sampler = DeviceSampler(4, torch.device("cpu"))
    sampler.seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampler.configure(SamplingConfig(temperature=1.0, top_p=0.8))  # nucleus: tokens 0 and 1
    counts = torch.zeros(4)
    for _ in range(2000):
        sampler.choose(probs.log())
        counts[int(sampler.token)] += 1
    assert counts[2] == 0 and counts[3] == 0
    share = counts[0] / counts[:2].sum()
    assert abs(share - 0.5 / 0.8) < 0.04  # 0.625, four standard errors ~ 0.043
    sampler.configure(SamplingConfig(temperature=1.0, top_p=1e-9))  # the top token always survives
    sampler.choose(probs.log())
    assert int(sampler.token) == 0


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/device/decode_checks.sh checks runs it)"
)
@pytest.mark.parametrize("budget,mode", [("100%", "auto"), ("25%", "on")])
def test_cuda_device_token_matches_transformers(tmp_path: Path, images: list[Path], budget: str, mode: str) -> None:
    """One graph per token on the GPU, float32 (the torch path of the table-read decode): transformers' tokens
    and logits within 1e-4; bf16 is decode_checks.py's, under the near-tie rule."""
    from tests.hf_reference import PROMPTS, hf_kwargs
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "m", seed=5, dtype=torch.float32, layout="hub", num_layers=8)
    engine = vismmoe_edge.load(model_dir, memory_budget=budget, pinned_layers=1, device="cuda", host_tier=True)
    engine.device_decode = mode
    assert engine.uses_device_decode()
    ref = Qwen3VLMoeForConditionalGeneration.from_pretrained(model_dir, experts_implementation="eager").to("cuda")
    for prompt, n_images in PROMPTS.values():
        inputs = engine.encode(prompt, images[:n_images])
        kwargs = {k: v.to("cuda") for k, v in hf_kwargs(inputs).items()}
        with torch.no_grad():
            out = ref.eval().generate(**kwargs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False)  # fmt: skip
        ref.model.rope_deltas = None
        sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        assert engine.generate_from_inputs(inputs, sampling).token_ids == out[0, inputs.num_tokens :].tolist(), prompt
    decoders = [d for d in engine._decoders.values() if d.on_device]
    assert decoders and all(d.graphs for d in decoders)
    if budget == "100%":  # the budget holds every expert: all loaded at load (runtime.resident_layers)
        assert len(engine.experts.pipeline.pinned) == len(engine.catalogue.experts) and engine.pinned_layers == 1
        assert sum(d.redone for d in decoders) == 0 and sum(d.ran_ahead for d in decoders) > 0
    if budget == "25%":
        assert sum(d.redone for d in decoders) > 0  # misses redone on the per-layer path, tokens still equal


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/device/decode_checks.sh checks runs it)"
)
def test_cuda_compiled_decoder_keeps_the_weights_earlier_graphs_read(tmp_path: Path, images: list[Path]) -> None:
    """One engine decodes eagerly (graphs captured), then compiled, then eagerly again, as the benchmark's rows
    take turns: the compiled decoder's stacked q/k/v must not move weights the first graphs read (this replayed
    them from freed memory: an illegal address at the 30B-A3B geometry), and the eager tokens stay the same."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    model_dir = build_tiny_checkpoint(tmp_path / "m", seed=5, dtype=torch.bfloat16, layout="hub", num_layers=8)
    engine = vismmoe_edge.load(model_dir, memory_budget="100%", pinned_layers=1, device="cuda", host_tier=False)
    assert engine.uses_device_decode()
    inputs = engine.encode("Describe the image.", images[:1])
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    attention = [layer.self_attn for layer in engine.language_model.layers]

    def weight_addresses() -> list[int]:
        return [p.weight.data_ptr() for a in attention for p in (a.q_proj, a.k_proj, a.v_proj)]

    runs, addresses = [], []
    for compiled in (False, True, False):
        engine.compile_decode = compiled
        runs.append(engine.generate_from_inputs(inputs, sampling).token_ids)
        torch.cuda.synchronize()
        addresses.append(weight_addresses())
    assert addresses[1] == addresses[0] == addresses[2]  # nothing moved after the first graphs were captured
    assert runs[2] == runs[0]
    assert len(runs[1]) == NEW_TOKENS
    assert {d.fused.compiled for d in engine._decoders.values() if d.fused is not None} == {True}


def test_gpu_slots_load_every_expert_where_the_budget_holds_them_all() -> None:
    """runtime.resident_layers: GPU slots whose budget holds every expert load them all now (a cold pool would
    redo a device token per miss); short of that, or in host memory, only the pinned prefix."""
    from vismmoe_edge.experts.runtime import resident_layers

    layers, layer_bytes = [1, 2, 3, 4], 100
    assert resident_layers("device", layers, [1], layer_bytes, 400) == layers
    assert resident_layers("device", layers, [1], layer_bytes, 399) == [1]
    assert resident_layers("host", layers, [1], layer_bytes, 400) == [1]  # CPU slots start cold, as before
    assert resident_layers("device", layers, [], layer_bytes, 10_000) == layers


def test_host_mirror_of_an_untransposed_checkpoint_is_mapped(checkpoints) -> None:
    """ExpertTable.map_host: each mirrored expert's gate_up and down addresses inside the mirror's bytes; a
    transposed (hub) checkpoint cannot be read in place and maps nothing."""
    from vismmoe_edge.experts.table import ExpertTable
    from vismmoe_edge.experts.tiers.host_mirror import HostMirror

    for layout, expect_mapped in (("v5", True), ("hub", False)):
        engine = vismmoe_edge.load(checkpoints[layout], memory_budget="100%", device="cpu", tier="host")
        catalogue = engine.catalogue
        keys = sorted(catalogue.experts)[:5]
        mirror = HostMirror(catalogue, keys, pin=False)
        table = ExpertTable(len(engine.language_model.layers), catalogue.num_experts, torch.device("cpu"))
        mapped = table.map_host(mirror, catalogue, engine.dtype)
        assert mapped == (len(keys) if expect_mapped else 0), layout
        if expect_mapped:
            assert table.host_addrs is not None
            layer, expert = keys[2]
            gate_up_bytes = catalogue.expert(layer, expert).parts[0].nbytes
            assert int(table.host_addrs[layer, expert, 0]) == mirror.expert(keys[2]).data_ptr()
            assert int(table.host_addrs[layer, expert, 1]) == mirror.expert(keys[2]).data_ptr() + gate_up_bytes
            assert int((table.host_addrs[..., 0] != 0).sum()) == len(keys)


def test_auto_reads_experts_in_place_only_where_the_host_tier_can_serve_every_miss(
    checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VISMMOE_DEVICE_DECODE_MAPPED "auto" (static_decode.reads_host_in_place): on CUDA with Triton, where the
    slots cannot hold every expert and the pinned mirror holds every streamed one slot-shaped; "1" and "0" as
    given; anything else one line. The device itself is faked (engine-like objects over real catalogues)."""
    from vismmoe_edge import static_decode as sd
    from vismmoe_edge.errors import VismmoeError
    from vismmoe_edge.experts.tiers.host_mirror import HostMirror

    monkeypatch.setattr(sd, "HAS_TRITON", True)
    monkeypatch.setattr(sd, "use_triton", lambda w: True)
    engines = {layout: vismmoe_edge.load(checkpoints[layout], memory_budget="100%", device="cpu", tier="host")
               for layout in ("v5", "hub")}  # fmt: skip

    def engine_like(layout: str, *, drop: int = 0, capacity: int = 4, device: str = "cuda") -> SimpleNamespace:
        engine = engines[layout]
        keys = sorted(engine.catalogue.experts)[drop:]
        tier = SimpleNamespace(mirror=HostMirror(engine.catalogue, keys, pin=False), form=None,
                               gate_up=torch.zeros(1, dtype=engine.dtype))  # fmt: skip
        pipeline = SimpleNamespace(tier=tier, pinned={}, capacity=capacity)
        return SimpleNamespace(device=torch.device(device), catalogue=engine.catalogue,
                               experts=SimpleNamespace(pipeline=pipeline))  # fmt: skip

    every = len(engines["v5"].catalogue.experts)
    assert sd.reads_host_in_place("auto", engine_like("v5"))
    assert not sd.reads_host_in_place("auto", engine_like("v5", capacity=every))  # every expert fits a slot
    assert not sd.reads_host_in_place("auto", engine_like("v5", drop=1))  # one expert only on disk
    assert not sd.reads_host_in_place("auto", engine_like("hub"))  # transposed: the kernels cannot read it
    assert not sd.reads_host_in_place("auto", engine_like("v5", device="cpu"))
    assert sd.reads_host_in_place("1", engine_like("hub")) and not sd.reads_host_in_place("0", engine_like("v5"))
    with pytest.raises(VismmoeError, match="VISMMOE_DEVICE_DECODE_MAPPED='yes': use auto, 1 or 0"):
        sd.reads_host_in_place("yes", engine_like("v5"))


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("act", [F.silu, F.gelu], ids=["silu", "gelu"])
def test_mapped_decode_reads_slots_and_host_memory_in_the_interpreter(act) -> None:  # type: ignore[no-untyped-def]
    """Two experts in pool slots, one read in place from a slot-shaped host buffer, one absent and unmapped. SiLU
    experts take the fused down GEMV (activation and routing weight in the kernel), others the activation in torch."""
    pool, x = _pool(slots=3, inter=24, hidden=40, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    host_gate_up = torch.randn(24 * 2, 40, generator=g).to(torch.bfloat16)
    host_down = torch.randn(40, 24, generator=g).to(torch.bfloat16)
    record = torch.cat([host_gate_up.view(-1), host_down.view(-1)])  # one expert's bytes, as the mirror holds them
    table = torch.full((6,), ABSENT, dtype=torch.int32)
    table[[1, 4]] = torch.tensor([2, 0], dtype=torch.int32)
    host_row = torch.zeros(6, 2, dtype=torch.int64)
    host_row[3] = torch.tensor([record.data_ptr(), record.data_ptr() + host_gate_up.nbytes])
    weights = torch.tensor([[0.5, 0.3, 0.2]]).to(torch.bfloat16)
    index = torch.tensor([[4, 3, 1]])
    out, missed = md.mapped_decode(x, index, table, weights, host_row, pool, act)
    assert not bool(missed)
    w_gate_up = torch.stack([pool.gate_up[0], host_gate_up, pool.gate_up[2]]).float()
    w_down = torch.stack([pool.down[0], host_down, pool.down[2]]).float()
    from vismmoe_edge.experts.pool_compute import gathered_experts

    ref = gathered_experts(x.float(), w_gate_up, w_down, weights.float(), act)
    assert torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    # the token's miss row: overwritten (the router wrote True: two experts are in no slot), each expert's weighted
    # output kept for the next layer's attention to sum
    row = torch.tensor(True)
    rows, flag = md.mapped_decode(x, index, table, weights, host_row, pool, act, summed=False, missed=row)
    assert flag is row and not bool(row)
    assert rows.shape == (3, 40) and rows.dtype == torch.float32
    assert torch.equal(rows.sum(0, keepdim=True).to(x.dtype), out)
    _, missed = md.mapped_decode(x, torch.tensor([[4, 5, 1]]), table, weights, host_row, pool, act)
    assert bool(missed)  # expert 5: in no slot and not mapped


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize(("block_n", "block_k"), [(32, 256), (16, 64), (8, 16)])
def test_gemv_at_blocks_give_the_same_rows(block_n: int, block_k: int) -> None:
    """The address GEMV's blocks that tools/device/kernel_sweep.py times over the bus: every row against float32,
    with rows and columns that no block divides."""
    g = torch.Generator().manual_seed(2)
    mats = [torch.randn(37, 72, generator=g).to(torch.bfloat16) for _ in range(2)]
    v = torch.randn(2, 72, generator=g).to(torch.bfloat16)
    addrs = torch.tensor([m.data_ptr() for m in mats], dtype=torch.int64)
    out = md.gemv_at(addrs, v, 37, torch.bfloat16, block_n=block_n, block_k=block_k)
    want = torch.stack([m.float() @ x.float() for m, x in zip(mats, v, strict=True)])
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-4)


class _InlineTier(TierDefaults):
    """A tier whose fetches only queue a copy (as from the pinned host tier): what promotion may use."""

    name = "fake-inline"
    slot_bytes = 100

    def __init__(self) -> None:
        self.released: list[tuple[int, int]] = []
        self.calls: list[tuple[str, tuple[int, int]]] = []  # ("done" | "fetch", key) in order

    def can_fetch_inline(self, key) -> bool:  # type: ignore[no-untyped-def]
        return True

    def fetch(self, key, slot):  # type: ignore[no-untyped-def]
        from vismmoe_edge.experts.store import ExpertWeights

        self.calls.append(("fetch", key))
        return ExpertWeights(torch.zeros(1), torch.zeros(1))

    def release(self, key, slot) -> None:  # type: ignore[no-untyped-def]
        self.released.append(key)

    def ready(self, key, slot) -> None:  # type: ignore[no-untyped-def]
        pass

    def done(self, key, slot) -> None:  # type: ignore[no-untyped-def]
        self.calls.append(("done", key))

    def read_bytes(self, key) -> int:  # type: ignore[no-untyped-def]
        return 100


def test_promotion_fills_free_slots_then_evicts_the_oldest_and_the_table_follows() -> None:
    from vismmoe_edge.experts.pipeline import ExpertPipeline
    from vismmoe_edge.experts.promotion import count_host_reads, promote_host_reads
    from vismmoe_edge.experts.table import ExpertTable

    tier = _InlineTier()
    pipeline = ExpertPipeline(tier, capacity=2, policy="lru")
    try:
        table = ExpertTable(2, 8, torch.device("cpu"))
        assert pipeline.promote(1, 1) is not None and pipeline.promote(1, 2) is not None
        assert pipeline.promote(1, 1) is None  # already in a slot
        assert pipeline.promote(1, 3) is not None and tier.released == [(1, 1)]  # the oldest made room
        # compute's last read of the victim is marked before its slot is filled: a token launched ahead may read it
        assert tier.calls[-2:] == [("done", (1, 1)), ("fetch", (1, 3))]
        assert set(pipeline.resident_slots()) == {(1, 2), (1, 3)}
        table.sync(pipeline)
        routing = torch.tensor([[3, 5, 6]])  # expert 3 read from its slot; 5 and 6 from the host tier
        assert count_host_reads(table, [1], routing) == 2
        assert promote_host_reads(pipeline, table, [1], routing, limit=0) == 0  # promotion off
        assert promote_host_reads(pipeline, table, [1], routing, limit=1) == 1  # the cap holds
        assert set(table.arriving) == {(1, 5)}
        table.sync(pipeline)  # on the CPU a fill has landed when the fetch returns: the table takes it at once
        assert not table.arriving and int(table.slots[1, 5]) >= 0 and int(table.slots[1, 2]) == ABSENT
    finally:
        pipeline.close()


@pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
def test_fused_int8_gemv_matches_the_dequantized_weights_in_the_interpreter() -> None:
    """int8 records read in place by the Triton kernel (codes and row scales from each slot's record)."""
    from tests.test_quant_pool import make_pool, reference, rel
    from vismmoe_edge.quant.packing import ROWMAJOR
    from vismmoe_edge.quant.slot_form import SlotForm

    spec, records, dense = make_pool(8, ROWMAJOR)
    form = SlotForm.for_device(spec, torch.device("cpu"))
    assert md.use_triton_int8(records, form)
    x = torch.randn(1, spec.hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    slots, weights = torch.tensor([[5, 0, 3, 2]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    ref = reference(x.float(), slots, weights, dense)
    for act in (F.silu, F.gelu):  # SiLU folded into the down GEMV; another activation between the two
        out = md.fused_decode_records(x, slots, weights, records, form, act)
        want = ref if act is F.silu else md.decode_quantized(x.float(), slots, weights, records, form, act).float()
        assert rel(out, want) < 2e-2, act
    # float32 activations keep the inner activation unrounded: the kernel is the dequantized float computation
    out = md.fused_decode_records(x.float(), slots, weights, records, form, F.silu)
    assert rel(out, ref) < 1e-5


def test_decode_switches_refuse_unknown_values(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment switches of the device path fail with one line naming the variable and its values."""
    from vismmoe_edge.errors import VismmoeError
    from vismmoe_edge.experts.tiers.quant_slots import triton_int4_slots
    from vismmoe_edge.static_decode import compiles_layers

    with pytest.raises(VismmoeError, match="VISMMOE_COMPILE_DECODE='yes': use auto, 1 or 0"):
        compiles_layers("yes", torch.device("cpu"))
    assert compiles_layers("auto", torch.device("cpu")) is False and compiles_layers("1", torch.device("cpu"))
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu", tier="host")
    engine.static_decode = engine.device_decode = "on"
    engine.decode_ahead = "sometimes"
    inputs = engine.encode("Hello", [])
    with pytest.raises(VismmoeError, match="VISMMOE_DECODE_AHEAD='sometimes': use auto, on or off"):
        engine.generate_from_inputs(inputs, SamplingConfig(max_new_tokens=3))
    monkeypatch.setenv("VISMMOE_INT4_SLOTS", "fast")
    int4 = SimpleNamespace(quant=SimpleNamespace(bits=4))  # an int4 catalogue's ExpertSpec, as far as it is read
    store = SimpleNamespace(device=torch.device("cuda"), catalogue=SimpleNamespace(quant=int4, experts=[]))
    with pytest.raises(VismmoeError, match="VISMMOE_INT4_SLOTS='fast': use auto, triton or tinygemm"):
        triton_int4_slots(store, 1)  # type: ignore[arg-type]
    from vismmoe_edge.experts.promotion import PROMOTIONS_PER_TOKEN, promotions_per_token

    assert promotions_per_token(None) == PROMOTIONS_PER_TOKEN and promotions_per_token("0") == 0
    with pytest.raises(VismmoeError, match="VISMMOE_PROMOTIONS_PER_TOKEN='-1': use a whole number >= 0"):
        promotions_per_token("-1")
    monkeypatch.setenv("VISMMOE_PROMOTIONS_PER_TOKEN", "0")
    assert vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu").promotions_per_token == 0
    from vismmoe_edge.kernels.mapped_prefetch import LOOKAHEAD_PER_LAYER, lookahead_per_layer

    assert lookahead_per_layer(None) == LOOKAHEAD_PER_LAYER and lookahead_per_layer("2") == 2
    with pytest.raises(VismmoeError, match="VISMMOE_MAPPED_LOOKAHEAD='two': use a whole number >= 0"):
        lookahead_per_layer("two")
    monkeypatch.setenv("VISMMOE_MAPPED_LOOKAHEAD", "3")
    assert vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", device="cpu").mapped_lookahead == 3


def test_tokens_run_ahead_where_no_token_can_miss() -> None:
    """StaticDecoder.runs_ahead under "auto": the pool holds every expert, or the host tier every one it does not
    (read in place: a promotion waits for the token in flight, ExpertPipeline.promote); never with a replayed
    trace or the embedding read on the host; "off" never."""
    from vismmoe_edge.static_decode import StaticDecoder

    def decoder(capacity: int, mapped: int, *, mode: str = "auto", replay: object = None) -> SimpleNamespace:
        pipeline = SimpleNamespace(pinned={(0, e): None for e in range(4)}, capacity=capacity)
        engine = SimpleNamespace(decode_ahead=mode, catalogue=SimpleNamespace(experts=range(16)),
                                 experts=SimpleNamespace(pipeline=pipeline, replay=replay))  # fmt: skip
        return SimpleNamespace(engine=engine, host_row=None, mapped_experts=mapped)

    assert StaticDecoder.runs_ahead(decoder(12, 0))  # 4 pinned + 12 slots: every expert
    assert not StaticDecoder.runs_ahead(decoder(6, 0))  # a miss would redo a token
    assert StaticDecoder.runs_ahead(decoder(6, 12))  # every streamed expert readable in place
    assert not StaticDecoder.runs_ahead(decoder(6, 11))
    assert not StaticDecoder.runs_ahead(decoder(12, 0, replay=object()))
    assert not StaticDecoder.runs_ahead(decoder(12, 0, mode="off"))
    assert StaticDecoder.runs_ahead(decoder(6, 0, mode="on"))


def test_replayed_routing_on_the_fused_device_path_is_recorded(checkpoints, tmp_path: Path) -> None:
    """Under trace replay the fused decoder only looks the routing up in the table; that lookup also writes the
    token's routing rows the host reads (kernels/decode_layer.record): they hold the trace's experts."""
    import numpy as np

    from vismmoe_edge.trace import synthetic_trace

    trace = synthetic_trace(200, 3, 12, 2, locality=0.5, seed=3)
    np.savez(tmp_path / "synthetic.npz", expert_ids=trace.expert_ids, prompt_offsets=np.array([0, 200]),
             moe_layer_ids=np.arange(3, dtype=np.int16), num_experts=np.array(12))  # fmt: skip
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=1, device="cpu", tier="host")
    engine.static_decode = engine.device_decode = "on"
    engine.compile_decode = True  # the fused layers, eager on the CPU
    replay = engine.replay_routing(tmp_path / "synthetic.npz")
    assert engine.uses_device_decode()
    engine.generate("hello", None, SamplingConfig(max_new_tokens=4, min_new_tokens=4))
    (decoder,) = engine._decoders.values()
    assert decoder.fused is not None and decoder.on_device
    last = replay.cursor - 1  # the row the last decoded token replayed
    layers = len(engine.language_model.layers)
    want = np.stack([trace.expert_ids[last, layer % 3] for layer in range(layers)])
    assert np.array_equal(decoder.routing.numpy(), want) and not decoder.missed.any()


def test_every_layer_hands_the_compiled_attention_the_same_kind_of_expert_rows(checkpoints, references) -> None:
    """torch.compile guards each tensor argument's dispatch keys, and an inference tensor has other keys than a
    plain one: run 15's daemon log showed the compiled `attend` compiled twice for every new decoder ("tensor
    'experts' dispatch key set mismatch"), because layer 0 took the decoder's zeros, made outside inference mode,
    and every later layer the previous layer's expert rows, made inside it. The zeros are an inference tensor."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="100%", pinned_layers=1, device="cpu", tier="host")
    engine.static_decode = engine.device_decode = "on"
    engine.compile_decode = True  # the fused layers, eager on the CPU
    ref = next(iter(references.values()))
    engine.generate_from_inputs(ref.inputs, SamplingConfig(max_new_tokens=2, min_new_tokens=2))
    (decoder,) = engine._decoders.values()
    kinds: list[bool] = []
    attend = decoder.fused.attend

    def recording(i, experts, *args):  # type: ignore[no-untyped-def]
        kinds.append(experts.is_inference())
        return attend(i, experts, *args)

    decoder.fused.attend = recording
    engine.generate_from_inputs(ref.inputs, SamplingConfig(max_new_tokens=3, min_new_tokens=3))
    assert len(kinds) >= 2 * len(decoder.lm.layers) and all(kinds), kinds
