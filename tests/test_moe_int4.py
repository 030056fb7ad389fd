"""int4 expert records on the device decode path: the slot form that keeps row-major nibbles for the Triton GEMV
(quant/slot_form.py, experts/tiers/quant_slots.py) and the kernel itself (kernels/moe_int4.py) under
`TRITON_INTERPRET=1` against the dequantized weights' float computation (skipped otherwise: run
`TRITON_INTERPRET=1 pytest tests/test_moe_int4.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.quant_sources import one_thread  # noqa: F401 - autouse: one torch thread in this module
from tests.test_quant_pool import SLOTS, make_pool
from vismmoe_edge.experts.tiers.quant_slots import triton_int4_slots
from vismmoe_edge.kernels import moe_decode as md
from vismmoe_edge.quant.config import make_config
from vismmoe_edge.quant.kernels import CUDA_TINYGEMM
from vismmoe_edge.quant.packing import ROWMAJOR, native_cpu_layout
from vismmoe_edge.quant.record import ExpertSpec
from vismmoe_edge.quant.slot_form import MATRICES, SlotForm

CUDA = torch.device("cuda")  # a device object only: the forms are chosen without a GPU
interpreter = pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")


def make_records(hidden: int, inter: int, group: int, layout: str = ROWMAJOR, seed: int = 0):  # type: ignore[no-untyped-def]
    """SLOTS random int4 experts as records [SLOTS, nbytes] in `layout`, and their dequantized float32 weights."""
    return make_pool(4, layout, seed, hidden=hidden, inter=inter, group=group)


def expert_rows(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, dense: list, act) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Each routed expert's weighted output [k, H] in float32 from the dequantized weights."""
    rows = []
    for j, s in enumerate(slots[0].tolist()):
        gate_up, down = dense[s]
        gate, up = F.linear(x.float(), gate_up).chunk(2, dim=-1)
        rows.append(F.linear(act(gate) * up, down)[0] * weights[0, j].float())
    return torch.stack(rows)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b).abs().max() / b.abs().max()).item()


# ---- the slot form (no Triton needed) -----------------------------------------------------------------------


@pytest.mark.parametrize("layout", [ROWMAJOR, "cpu_b64_split"])
def test_the_cpu_keeps_its_layouts_and_cuda_keeps_tinygemm_unless_asked(layout: str) -> None:
    spec = ExpertSpec(make_config(4, 32, layout), 128, 96)
    cpu = SlotForm.for_device(spec, torch.device("cpu"))
    native = native_cpu_layout()
    want = native if native is not None else layout
    assert all(cpu.layouts[m] == want for m in MATRICES)  # this CPU's tiles, as before
    tinygemm = SlotForm.for_device(spec, CUDA)
    assert all(tinygemm.layouts[m] == CUDA_TINYGEMM for m in MATRICES) and not tinygemm.triton_int4
    triton = SlotForm.for_device(spec, CUDA, triton=True)
    assert all(triton.layouts[m] == ROWMAJOR for m in MATRICES) and triton.triton_int4 and not triton.tiles
    assert triton.rebuilds == (layout != ROWMAJOR)  # a row-major file is one DMA; CPU tiles are repacked


def test_groups_the_triton_gemv_cannot_take_and_int8_keep_their_forms() -> None:
    odd = ExpertSpec(make_config(4, 48, ROWMAJOR), 96, 48)  # not a power of two
    form = SlotForm.for_device(odd, CUDA, triton=True)
    assert form.layouts == SlotForm.for_device(odd, CUDA).layouts and not form.triton_int4
    int8 = ExpertSpec(make_config(8, None, ROWMAJOR), 128, 96)
    form = SlotForm.for_device(int8, CUDA, triton=True)
    assert all(form.layouts[m] == ROWMAJOR for m in MATRICES) and not form.triton_int4 and not form.rebuilds


def test_the_pool_asks_for_the_triton_form_only_on_cuda_where_device_decode_reads_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    spec = ExpertSpec(make_config(4, 32, ROWMAJOR), 128, 96)
    experts = {(layer, e): None for layer in range(2) for e in range(8)}

    def store(device: str, quant=spec):  # type: ignore[no-untyped-def]
        return SimpleNamespace(device=torch.device(device), catalogue=SimpleNamespace(quant=quant, experts=experts))

    monkeypatch.delenv("VISMMOE_INT4_SLOTS", raising=False)
    monkeypatch.delenv("VISMMOE_DEVICE_DECODE", raising=False)
    assert not triton_int4_slots(store("cpu"), 16)  # the CPU keeps its tiles
    assert triton_int4_slots(store("cuda"), 16) == md.HAS_TRITON  # every expert fits: device decode "auto"
    assert not triton_int4_slots(store("cuda"), 15)  # some stream: the per-layer path, tinygemm
    assert not triton_int4_slots(store("cuda", None), 16)  # float experts
    assert not triton_int4_slots(store("cuda", ExpertSpec(make_config(8, None, ROWMAJOR), 128, 96)), 16)
    monkeypatch.setenv("VISMMOE_DEVICE_DECODE", "off")
    assert not triton_int4_slots(store("cuda"), 16)
    monkeypatch.setenv("VISMMOE_INT4_SLOTS", "triton")
    assert triton_int4_slots(store("cuda"), 15) and not triton_int4_slots(store("cpu"), 16)
    monkeypatch.setenv("VISMMOE_INT4_SLOTS", "tinygemm")
    assert not triton_int4_slots(store("cuda"), 16)


# ---- the kernel in the interpreter ---------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize(
    ("hidden", "inter", "group", "layout"),
    [
        (320, 40, 8, ROWMAJOR),  # partial row and column blocks; blocks of several groups
        (384, 128, 128, "cpu_b64_split"),  # a partial block's last group masked; down: blocks inside one group
        (64, 16, 2, ROWMAJOR),  # the smallest group: one byte each
    ],
)
def test_fused_int4_gemv_matches_the_dequantized_weights_in_the_interpreter(
    hidden: int, inter: int, group: int, layout: str
) -> None:
    spec, records, dense = make_records(hidden, inter, group, layout)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    for s in range(SLOTS):  # the fetch's repack of a file in CPU tiles into row-major nibbles
        if form.rebuilds:
            form.build(records[s])
    assert md.use_triton_int4(records, form)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    slots, weights = torch.tensor([[5, 0, 3, 2]]), torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    for act in (F.silu, F.gelu):  # SiLU folded into the down GEMV; another activation between the two
        want = expert_rows(x, slots, weights, dense, act)
        rows = md.fused_decode_records(x, slots, weights, records, form, act, summed=False)
        assert rows.shape == want.shape and rows.dtype == torch.float32
        assert rel(rows, want) < 2e-2, act  # bf16 inputs and inner activation (docs/quantization.md)
        out = md.fused_decode_records(x, slots, weights, records, form, act)
        assert out.dtype == x.dtype and rel(out, rows.sum(0, keepdim=True)) < 1e-2  # the rows sum to it
        if act is F.silu:  # pool_decode picks the kernel
            pool = SimpleNamespace(form=form, records=records)
            assert torch.equal(md.pool_decode(x, slots, weights, pool, act), out)


@interpreter
def test_float32_activations_are_not_rounded_and_the_per_layer_path_uses_the_kernel() -> None:
    from vismmoe_edge.experts.compute import OffloadedExperts

    spec, records, dense = make_records(256, 32, 32)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3))
    slots, weights = torch.tensor([[1, 4]]), torch.tensor([[0.7, 0.3]])
    want = expert_rows(x, slots, weights, dense, F.silu).sum(0, keepdim=True)
    out = md.fused_decode_records(x, slots, weights, records, form, F.silu)
    assert rel(out, want) < 1e-5  # float32 all the way: only the order of the sums differs
    pool = SimpleNamespace(form=form, records=records)
    layer = SimpleNamespace(runtime=SimpleNamespace(pipeline=SimpleNamespace(tier=SimpleNamespace(pool=pool))),
                            act_fn=F.silu)  # fmt: skip
    assert torch.equal(OffloadedExperts.pool_compute(layer, x, slots, weights), out)  # type: ignore[arg-type]


@interpreter
@pytest.mark.parametrize(
    ("block_n", "block_k", "acc2d", "words"),
    [(4, 2048, False, False), (8, 2048, False, False), (4, 1024, False, False), (8, 512, False, False),
     (32, 128, True, False), (16, 128, True, False), (8, 256, True, False), (32, 128, False, True),
     (16, 256, False, True), (8, 64, False, True), (4, 2048, False, True)],
)  # fmt: skip
def test_the_added_autotune_configs_compute_the_same(  # type: ignore[no-untyped-def]
    monkeypatch, block_n: int, block_k: int, acc2d: bool, words: bool
) -> None:
    """The autotuner's added configs, forced in the interpreter, where the CPU tests otherwise run one fixed block:
    few rows with long blocks (one load a row at 30B-A3B shapes; blocks longer than a row, so masked columns and
    groups), ACC2D (products kept per column, one reduction after the loop; int4: blocks of one group, and of two,
    where it falls back to the per-block reduction), for the int4 and the bf16 GEMVs; and int4's WORDS (codes read
    as 32-bit words, each made a float under 1.0's exponent: blocks of one group, of two, of half of one, and
    longer than a row)."""
    from vismmoe_edge.kernels import moe_int4

    config = {"BLOCK_N": block_n, "BLOCK_K": block_k, "ACC2D": acc2d, "WORDS": words}
    monkeypatch.setattr(moe_int4, "blocks", lambda kk: config)
    monkeypatch.setattr(md, "blocks", lambda kk: {k: v for k, v in config.items() if k != "WORDS"})
    spec, records, dense = make_records(768, 128, 128)  # down's K (128, one group) far shorter than a block
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    x = torch.randn(1, 768, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    slots, weights = torch.tensor([[2, 5, 0]]), torch.tensor([[0.5, 0.3, 0.2]])
    want = expert_rows(x, slots, weights, dense, F.silu)
    assert rel(md.fused_decode_records(x, slots, weights, records, form, F.silu, summed=False), want) < 2e-2
    gate_up = torch.stack([d[0] for d in dense]).to(torch.bfloat16)  # the same experts as a bf16 pool
    down = torch.stack([d[1] for d in dense]).to(torch.bfloat16)
    assert rel(md.fused_decode(x, slots, weights, gate_up, down, F.silu, summed=False), want) < 2e-2


@interpreter
@pytest.mark.parametrize(
    ("hidden", "inter", "group", "block_n"), [(256, 32, 32, 16), (256, 32, 8, 16), (320, 40, 8, 32)]
)
def test_words_keep_float32_activations_as_close_as_bytes(  # type: ignore[no-untyped-def]
    monkeypatch, hidden: int, inter: int, group: int, block_n: int
) -> None:
    """WORDS sums f * a with f = 1 + code / 16 and takes 24 * sum a off after: float32 inputs give the float32
    reference to within 1e-5 of its largest value, as the byte path does (groups of 32: blocks inside one group,
    of two, of eight; of 8: a group a word; 320 x 40: rows of 5 words, so masked words and masked rows)."""
    from vismmoe_edge.kernels import moe_int4

    spec, records, dense = make_records(hidden, inter, group)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(3))
    slots, weights = torch.tensor([[1, 4]]), torch.tensor([[0.7, 0.3]])
    want = expert_rows(x, slots, weights, dense, F.silu).sum(0, keepdim=True)
    for block_k in (16, 64, 256):
        config = {"BLOCK_N": block_n, "BLOCK_K": block_k, "WORDS": True}
        monkeypatch.setattr(moe_int4, "blocks", lambda kk, c=config: c)
        assert rel(md.fused_decode_records(x, slots, weights, records, form, F.silu), want) < 1e-5


def test_words_configs_only_where_rows_are_whole_words() -> None:
    """The autotuner's pruning (moe_int4.words_fit): WORDS configs stay only where the codes' offset, a slot's
    stride and a row's bytes are multiples of 4 and a group is whole words; the others always stay."""
    from vismmoe_edge.kernels.moe_int4 import words_fit

    configs = [SimpleNamespace(kwargs={"BLOCK_N": 8, "WORDS": True}), SimpleNamespace(kwargs={"BLOCK_N": 8})]
    fits = {"q_off": 0, "stride_slot": 2_506_752, "K": 2048}
    assert words_fit(configs, fits, GROUP=128) == configs
    for bad, group in (({"q_off": 2}, 128), ({"stride_slot": 6}, 128), ({"K": 772}, 128), ({}, 4)):
        assert words_fit(configs, {**fits, **bad}, GROUP=group) == configs[1:]


def test_dot_configs_only_for_bf16_inputs_and_groups_of_16_words() -> None:
    """The autotuner's pruning (moe_int4.configs_fit): DOT configs stay only where a group is at least 128 codes,
    rows are whole words and the input is bf16 exactly (a bf16 tensor, or the SiLU input rounded to bf16)."""
    from vismmoe_edge.kernels.moe_int4 import configs_fit

    dot, words, plain = (SimpleNamespace(kwargs={"BLOCK_N": 64, key: True}) for key in ("DOT", "WORDS", "ACC2D"))
    configs = [dot, words, plain]
    fits = {"q_off": 0, "stride_slot": 2_506_752, "K": 2048, "v": torch.zeros(1, dtype=torch.bfloat16)}
    assert configs_fit(configs, fits, GROUP=128) == configs
    assert configs_fit(configs, {**fits, "v": torch.zeros(1)}, GROUP=128) == [words, plain]  # float32 input
    assert configs_fit(configs, {**fits, "v": torch.zeros(1)}, GROUP=128, SILU=True, ROUND=1) == configs
    assert configs_fit(configs, fits, GROUP=64) == [words, plain]  # a dot's inner size is 16 words at least
    assert configs_fit(configs, {**fits, "q_off": 2}, GROUP=128) == [plain]
    # SPLIT parts share a row's groups evenly: 30B-A3B's gate_up has 16 groups of 128, its down 6
    splits = [SimpleNamespace(kwargs={"BLOCK_N": 64, "DOT": True, "SPLIT": n}) for n in (1, 2, 3, 4, 6, 8)]
    assert configs_fit(splits, fits, GROUP=128) == [splits[i] for i in (0, 1, 3, 5)]
    assert configs_fit(splits, {**fits, "K": 768}, GROUP=128) == [splits[i] for i in (0, 1, 2, 4)]


@interpreter
@pytest.mark.parametrize(("hidden", "inter", "group"), [(64, 32, 16), (80, 48, 16), (256, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_dequantize_kernel_is_dequantize_rowmajor_exactly(hidden: int, inter: int, group: int,
                                                             dtype: torch.dtype) -> None:  # fmt: skip
    """kernels/dequant_int4.py reads the chosen slots' nibbles and (scale, zero) in place and gives each weight
    the value of quant_pool.dequantize_rowmajor (the int4 prefill's torch path), bit for bit; rows and bytes that
    do not fill a block (80 rows, 48 codes) are masked."""
    from vismmoe_edge.experts.quant_pool import dequantize_rowmajor, dequantize_slots
    spec, records, _ = make_records(hidden, inter, group, seed=3)
    form = SlotForm.for_device(spec, CUDA, triton=True)
    assert md.use_triton_int4(records, form)
    chosen = torch.tensor([2, 0, SLOTS - 1])
    for name in MATRICES:
        got = dequantize_slots(records, form, chosen, name, dtype)
        assert torch.equal(got, dequantize_rowmajor(form, records.index_select(0, chosen), name, dtype)), name


@interpreter
@pytest.mark.parametrize(
    ("hidden", "inter", "group", "block_n", "words"),
    [(256, 32, 32, 8, False), (320, 40, 8, 4, False), (320, 40, 8, 16, True), (256, 32, 32, 64, True)],
)
@pytest.mark.parametrize("act_of", [torch.bfloat16, torch.float32])
def test_gated_gate_up_ends_in_the_activation_and_down_weighs_its_rows(  # type: ignore[no-untyped-def]
    monkeypatch, hidden: int, inter: int, group: int, block_n: int, words: bool, act_of: torch.dtype
) -> None:
    """moe_int4.gated_int4: a program's rows are half gate rows and the same up rows, and it writes
    silu(gate) * up rounded to the compute dtype; the down GEMV with `weigh` loads that input and scales each
    expert's rows by its routing weight. Against the dequantized weights in float32: within 1e-5 of the largest
    value unrounded; rounded to bf16, within one bf16 step of it (a sum's order can move a value across a rounding
    boundary). 40 rows: the last gate/up blocks masked (4 and 16 rows a program); 64: one program wider than I."""
    from vismmoe_edge.kernels import moe_int4
    from vismmoe_edge.kernels.slot_matrix import record_matrix

    monkeypatch.setattr(moe_int4, "blocks", lambda kk: {"BLOCK_N": block_n, "BLOCK_K": 64, "WORDS": words})
    spec, records, dense = make_records(hidden, inter, group)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    gate_up, down = record_matrix(records, form, "gate_up_proj"), record_matrix(records, form, "down_proj")
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(5)).to(act_of)
    slot_ids, mix = torch.tensor([3, 0, 5]), torch.tensor([0.5, 0.3, 0.2], dtype=act_of)
    a = moe_int4.gated_int4(gate_up, slot_ids, x.expand(3, -1), act_of)
    gates_ups = [F.linear(x.float(), dense[s][0])[0].chunk(2) for s in slot_ids.tolist()]
    want = torch.stack([F.silu(g) * u for g, u in gates_ups])  # [k, I] float32, unrounded
    assert a.shape == (3, inter) and a.dtype == act_of  # bf16 values kept in bf16: the down GEMV may take DOT
    if act_of == torch.float32:
        assert rel(a, want) < 1e-5
    else:
        assert ((a.float() - want).abs() <= want.abs() * 2**-7 + 1e-6).all()  # one bf16 step at most
    out = moe_int4.gemv_int4(down, slot_ids, a, mix, weigh=True)
    want_out = torch.stack([F.linear(a[j].float(), dense[s][1]) * mix[j].float()
                            for j, s in enumerate(slot_ids.tolist())])  # fmt: skip
    assert out.shape == (3, hidden) and rel(out, want_out) < 1e-5


@interpreter
@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_dot_configs_sum_the_products_by_tensor_cores_exactly_enough(monkeypatch, block_n: int) -> None:  # type: ignore[no-untyped-def]
    """DOT: two codes of a 32-bit word made bf16 16 + code under one exponent with a shift and a mask-or, one dot a
    group (each word's halves side by side in its inner order, the input gathered to match) against the input in
    column 0 of 16, 24 sum a taken off per group. Forced for both GEMVs of a
    layer with bf16 inputs at g128 (gate_up ending in the activation: 3 groups; down: 1), against the dequantized
    weights and against the byte loop (the same bf16 activation, summed in another order); and for the down GEMV
    that computes silu(gate) * up from [gate | up] rounded to bf16, which dot_fit also admits."""
    from vismmoe_edge.kernels import moe_int4
    from vismmoe_edge.kernels.slot_matrix import record_matrix

    spec, records, dense = make_records(384, 128, 128)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    x = torch.randn(1, 384, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    slots, weights = torch.tensor([[4, 1, 5]]), torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.bfloat16)
    byte_loop = {"BLOCK_N": 16, "BLOCK_K": 64}
    dot = {"BLOCK_N": block_n, "BLOCK_K": 128, "DOT": True}

    def layer(config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        monkeypatch.setattr(moe_int4, "blocks", lambda kk: config)
        rows = md.fused_decode_records(x, slots, weights, records, form, F.silu, summed=False)
        gate_up, down = record_matrix(records, form, "gate_up_proj"), record_matrix(records, form, "down_proj")
        h = moe_int4.gemv_int4(gate_up, slots[0], x.expand(3, -1), weights[0])  # [3, 2I] float32
        silu_down = moe_int4.gemv_int4(down, slots[0], h, weights[0], silu_of=torch.bfloat16)
        return rows, silu_down

    bytes_rows, bytes_silu = layer(byte_loop)
    rows, silu_rows = layer(dot)
    assert rel(rows, expert_rows(x, slots, weights, dense, F.silu)) < 2e-2  # bf16 inputs and activation
    assert rel(rows, bytes_rows) < 1e-5  # the same values up to the sums' order (9e-8 at this seed)
    assert rel(silu_rows, bytes_silu) < 1e-5


@interpreter
@pytest.mark.parametrize("split", [2, 4])
def test_dot_split_between_programs_adds_the_parts_in_order(monkeypatch, split: int) -> None:  # type: ignore[no-untyped-def]
    """SPLIT: a row block's groups shared by `split` programs, each storing its sums; the last to finish adds them
    in part order and writes the output (gate_up ending in the activation, 4 groups; the weighted down, 2 groups a
    row at split 2; split 4 leaves the down GEMV on one part, as dot_fit prunes it). The same values as one program
    a block up to the sums' order, the same bits on a second launch, and every block's count back at zero."""
    from vismmoe_edge.kernels import moe_int4
    from vismmoe_edge.kernels.slot_matrix import record_matrix

    spec, records, dense = make_records(512, 256, 128)
    form = SlotForm.for_device(spec, torch.device("cpu"), triton=True)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    slots, weights = torch.tensor([[2, 0, 5]]), torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.bfloat16)
    gate_up, down = record_matrix(records, form, "gate_up_proj"), record_matrix(records, form, "down_proj")

    def layer(split_gate_up: int, split_down: int) -> tuple[torch.Tensor, torch.Tensor]:
        dot = {"BLOCK_N": 64, "BLOCK_K": 128, "DOT": True}
        monkeypatch.setattr(moe_int4, "blocks", lambda kk: {**dot, "SPLIT": split_gate_up})
        a = moe_int4.gated_int4(gate_up, slots[0], x.expand(3, -1), torch.bfloat16)  # [3, I]
        monkeypatch.setattr(moe_int4, "blocks", lambda kk: {**dot, "SPLIT": split_down})
        return a, moe_int4.gemv_int4(down, slots[0], a, weights[0], weigh=True)  # [3, H]

    one_a, one_out = layer(1, 1)
    down_split = split if (256 // 128) % split == 0 else 1
    a, out = layer(split, down_split)
    assert rel(out, expert_rows(x, slots, weights, dense, F.silu)) < 2e-2  # bf16 inputs and activation
    assert rel(a.float(), one_a.float()) <= 2**-8  # the activation rounded to bf16: at most a step apart
    assert rel(out, one_out) < 1e-5
    again_a, again = layer(split, down_split)
    assert torch.equal(again_a, a) and torch.equal(again, out)  # the parts are added in a fixed order
    for n in (gate_up.n, down.n):
        assert not moe_int4.split_scratch(torch.device("cpu"), 3, n)[1].any()  # every count reset
