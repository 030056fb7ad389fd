"""A MoE layer's routed experts in one batched computation over the slot pool.

Every resident expert (pinned or cached) sits in one `[slots, 2I, H]` and one `[slots, H, I]` tensor, so a layer
needs only each routed expert's slot, not a host loop over experts:
- one token (decode): gather its k experts' weights and run two batched GEMMs; the shapes never change, so this
  is what a CUDA graph replays;
- many tokens (prefill): tokens sorted by slot and one grouped GEMM over the slots in use (`torch._grouped_mm`),
  or where the build or dtype has no grouped GEMM, a loop over the slots in use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Act = Callable[[torch.Tensor], torch.Tensor]


def decode_experts(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act
) -> torch.Tensor:
    """x [1, H], slots and weights [1, k] -> [1, H]: one token's k experts as two batched GEMMs."""
    return gathered_experts(x, gate_up.index_select(0, slots[0]), down.index_select(0, slots[0]), weights, act)


def gathered_experts(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor, act: Act
) -> torch.Tensor:
    """x [1, H], the token's k experts gathered ([k, 2I, H], [k, H, I]) and their weights [1, k] -> [1, H]."""
    return weighted_sum(expert_outputs(x, w_gate_up, w_down, act), weights, x.dtype)


def expert_outputs(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, act: Act) -> torch.Tensor:
    """x [1, H] through k gathered experts -> each expert's output [k, H], unweighted (a row each, so that the
    rows of some experts may be computed before the others': experts/arrival.py)."""
    gate, up = torch.matmul(w_gate_up, x[0]).chunk(2, dim=-1)  # [k, I] each
    return torch.matmul(w_down, (act(gate) * up).unsqueeze(-1)).squeeze(-1)


def weighted_sum(y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The experts' outputs y [k, H] mixed by their routing weights [1, k] -> [1, H] in `dtype`."""
    return (y * weights[0, :, None]).sum(0, keepdim=True).to(dtype)


def expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: Act) -> torch.Tensor:
    """One expert on rows x [N, H]: gate_up [2I, H], down [H, I] in nn.Linear's orientation."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(act(gate) * up, down)


def grouped_mm_works(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `torch._grouped_mm` runs here: CUDA builds take bf16 on sm_90+; the CPU build fp32 and bf16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (9, 0)
    return dtype in (torch.float32, torch.bfloat16)


def prefill_experts(
    x: torch.Tensor,
    slots: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Act,
    *,
    grouped: bool,
    run: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [T, H], slots and weights [T, k] -> [T, H], each (token, expert) pair once. `run` (first, count): every
    slot is in first .. first + count - 1 (one pinned layer's experts), so the grouped GEMM takes all of them as
    groups, unrouted ones empty, and nothing waits for the host."""
    if not grouped:
        return per_slot_experts(x, slots, weights, lambda slot, rows: expert_mlp(rows, gate_up[slot], down[slot], act))
    order, token_of, xs = sort_by_slot(x, slots)
    if run is not None:
        first, count = run
        ends = torch.arange(first, first + count, device=slots.device)  # group g: the pairs routed to slot first + g
        offs = torch.searchsorted(slots.reshape(-1)[order], ends, right=True, out_int32=True)
        hidden = grouped_mlp(xs, gate_up[first : first + count], down[first : first + count], offs, act)
        return combine_pairs(x, hidden, weights, order, token_of)
    # One group per slot in use: CUDA's grouped GEMM takes at most 1,024 groups, a pool has thousands of slots,
    # so the slots in use (at most the layer's experts) are gathered first.
    used, group = torch.unique(slots.reshape(-1), return_inverse=True)
    counts = torch.bincount(group, minlength=used.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    first, last = used[[0, -1]].tolist()
    if last - first + 1 == used.shape[0]:  # one run of slots (a resident layer, every expert routed): views
        w_gate_up, w_down = gate_up[first : last + 1], down[first : last + 1]  # (a copy moves ~2.4 GB a layer at 30B)
    else:
        w_gate_up, w_down = gate_up.index_select(0, used), down.index_select(0, used)
    return combine_pairs(x, grouped_mlp(xs, w_gate_up, w_down, offs, act), weights, order, token_of)


def grouped_mlp(
    xs: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, offs: torch.Tensor, act: Act
) -> torch.Tensor:
    """Rows xs [P, H] grouped by expert (group g ends at offs[g], int32) through experts gate_up [G, 2I, H] and
    down [G, H, I]: two grouped GEMMs -> [P, H]."""
    gate, up = torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(act(gate) * up, down.transpose(-2, -1), offs=offs)


def per_slot_experts(
    x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, expert: Callable[[int, torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """x [T, H], slots and weights [T, k] -> [T, H]: `expert(slot, rows)` once per slot in use, on its tokens."""
    order, token_of, xs = sort_by_slot(x, slots)
    used, counts = torch.unique_consecutive(slots.reshape(-1)[order], return_counts=True)
    y = torch.empty(xs.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    start = 0
    for slot, count in zip(used.tolist(), counts.tolist(), strict=True):
        rows = slice(start, start + count)
        y[rows] = expert(slot, xs[rows])
        start += count
    return combine_pairs(x, y, weights, order, token_of)


def sort_by_slot(x: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs grouped by slot: their order in `slots.reshape(-1)`, each one's token, its row."""
    order = torch.argsort(slots.reshape(-1), stable=True)
    token_of = order // slots.shape[1]
    return order, token_of, x[token_of]


def combine_pairs(
    x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, token_of: torch.Tensor
) -> torch.Tensor:
    """Each pair's output y (in slot order) times its routing weight, summed into its token's row (in the
    weights' dtype until the sum, as transformers' experts do: GLM's and DeepSeek's routers give float32)."""
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token_of, y.to(x.dtype))
