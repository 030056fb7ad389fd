"""The device token's lookahead over the host tier (kernels/mapped_prefetch.py): which experts are staged, that
their records arrive whole, and that the expert GEMVs read a staged expert from its record. Triton kernels in
the interpreter (TRITON_INTERPRET=1); the graph with its second stream runs on the GPU (decode_checks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vismmoe_edge.experts.table import ABSENT
from vismmoe_edge.kernels import moe_decode as md

pytestmark = pytest.mark.skipif(not md.HAS_TRITON or not md.INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")

INTER, HIDDEN = 24, 40
GATE_UP = 2 * INTER * HIDDEN
RECORD = GATE_UP + HIDDEN * INTER


def host_records(n: int, seed: int) -> torch.Tensor:
    """n expert records as the host mirror lays them out: gate_up [2I, H] then down [H, I], bf16."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, RECORD, generator=g).to(torch.bfloat16)


def next_router(scores: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H] and a router weight [E, H] whose logits order the experts as `scores` does."""
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    x[0, 0] = 1
    weight = torch.zeros(len(scores), HIDDEN, dtype=torch.bfloat16)
    weight[:, 0] = torch.tensor(scores)
    return x, weight


def test_the_first_predicted_host_experts_are_staged_whole() -> None:
    from vismmoe_edge.kernels.mapped_prefetch import Staging, predict_and_stage

    records = host_records(6, seed=0)
    x, weight = next_router([5, 4, 3, 2, 1, 0])  # top-4: experts 0, 1, 2, 3 in that order
    table = torch.full((6,), ABSENT, dtype=torch.int32)
    table[0] = 2  # in a slot: not staged
    host = torch.zeros(6, 2, dtype=torch.int64)
    for e in (1, 3, 4, 5):  # expert 2 is in no memory: not staged either
        host[e, 0] = records[e].data_ptr()
        host[e, 1] = records[e].data_ptr() + GATE_UP * 2
    staging = Staging.allocate(3, RECORD, GATE_UP, torch.bfloat16, torch.device("cpu"))
    predict_and_stage(x, weight, table, host, 4, staging, area=1)
    assert staging.ids[1].tolist() == [1, 3, -1]
    assert torch.equal(staging.records[1, 0], records[1]) and torch.equal(staging.records[1, 1], records[3])
    assert not staging.records[1, 2].any() and not staging.records[0].any()  # nothing else written
    assert staging.ids[0].tolist() == [-1, -1, -1]
    # fewer places than wanted experts: the first in the prediction's order
    staging = Staging.allocate(1, RECORD, GATE_UP, torch.bfloat16, torch.device("cpu"))
    predict_and_stage(x, weight, table, host, 4, staging, area=0)
    assert staging.ids[0].tolist() == [1] and torch.equal(staging.records[0, 0], records[1])


def test_long_records_are_copied_by_every_program(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A record longer than the copy programs' first pass (the 30B-A3B record is ~288 chunks a program)."""
    from vismmoe_edge.kernels import mapped_prefetch as mp

    monkeypatch.setattr(mp, "CHUNK", 64)
    monkeypatch.setattr(mp, "COPY_PROGRAMS", 4)
    records = host_records(2, seed=1)
    x, weight = next_router([1, 2])
    host = torch.tensor([[records[0].data_ptr(), 0], [records[1].data_ptr(), 0]])
    staging = mp.Staging.allocate(2, RECORD, GATE_UP, torch.bfloat16, torch.device("cpu"))
    mp.predict_and_stage(x, weight, torch.full((2,), ABSENT, dtype=torch.int32), host, 2, staging, area=0)
    assert staging.ids[0].tolist() == [1, 0]
    assert torch.equal(staging.records[0], records.flip(0))


@pytest.mark.parametrize("act", [F.silu, F.gelu], ids=["silu", "gelu"])
def test_the_expert_gemvs_read_a_staged_expert_from_its_record(act) -> None:  # type: ignore[no-untyped-def]
    """Expert 3's staged record differs from its host copy: the output is that of the staged weights, while
    expert 1 (not staged) is read from the host and expert 4 from its slot."""
    g = torch.Generator().manual_seed(2)
    pool = type("Pool", (), {"gate_up": torch.randn(2, 2 * INTER, HIDDEN, generator=g).to(torch.bfloat16),
                             "down": torch.randn(2, HIDDEN, INTER, generator=g).to(torch.bfloat16)})  # fmt: skip
    x = torch.randn(1, HIDDEN, generator=g).to(torch.bfloat16)
    host = host_records(6, seed=3)
    staged_record = host_records(1, seed=4)[0]
    table = torch.full((6,), ABSENT, dtype=torch.int32)
    table[4] = 1
    host_row = torch.zeros(6, 2, dtype=torch.int64)
    for e in (1, 3):
        host_row[e] = torch.tensor([host[e].data_ptr(), host[e].data_ptr() + GATE_UP * 2])
    records = torch.zeros(2, RECORD, dtype=torch.bfloat16)
    records[1] = staged_record
    ids = torch.tensor([5, 3], dtype=torch.int32)  # expert 5 staged but not routed: never read
    index, weights = torch.tensor([[4, 3, 1]]), torch.tensor([[0.5, 0.3, 0.2]]).to(torch.bfloat16)
    out, missed = md.mapped_decode(x, index, table, weights, host_row, pool, act, staged=(ids, records, GATE_UP))
    assert not bool(missed)

    def parts(record: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return record[:GATE_UP].view(2 * INTER, HIDDEN), record[GATE_UP:].view(HIDDEN, INTER)

    used = [(pool.gate_up[1], pool.down[1]), parts(staged_record), parts(host[1])]
    w_gate_up = torch.stack([gu for gu, _ in used]).float()
    w_down = torch.stack([dn for _, dn in used]).float()
    from vismmoe_edge.experts.pool_compute import gathered_experts

    ref = gathered_experts(x.float(), w_gate_up, w_down, weights.float(), act)
    assert torch.allclose(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    unstaged, _ = md.mapped_decode(x, index, table, weights, host_row, pool, act)
    assert not torch.allclose(unstaged.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
