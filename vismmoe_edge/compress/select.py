"""Which of one image's N visual tokens to keep. Index results are sorted ascending LongTensors into 0..N-1."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

# Counts are floor(ratio * n); the slack keeps e.g. 0.57 * 100 (= 56.99999999999999 in binary) at 57.
_FLOOR_SLACK = 1e-9


def _check_ratio(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _floor_count(n: int, ratio: float) -> int:
    return min(n, math.floor(ratio * n + _FLOOR_SLACK))


def keep_count(n: int, keep_ratio: float) -> int:
    """floor(keep_ratio * n), but at least 1 when n > 0 (so keep_ratio 1.0 keeps all)."""
    _check_ratio("keep_ratio", keep_ratio)
    if n <= 0:
        return 0
    return max(1, _floor_count(n, keep_ratio))


def _top(scores: Tensor, k: int) -> Tensor:
    """Positions of the k largest scores, ties to the lower position (a stable descending sort keeps index order)."""
    return torch.sort(scores, descending=True, stable=True).indices[:k]


def _sorted(idx: Tensor) -> Tensor:
    return torch.sort(idx).values


def random_keep(n: int, keep_ratio: float, generator: torch.Generator) -> Tensor:
    """A uniformly random keep set of keep_count(n, keep_ratio) tokens (on the generator's device)."""
    k = keep_count(n, keep_ratio)
    return _sorted(torch.randperm(n, generator=generator, device=generator.device)[:k])


def saliency_keep(saliency: Tensor, keep_ratio: float) -> Tensor:
    """The keep_count most salient tokens, ties broken by lower index."""
    if saliency.dim() != 1:
        raise ValueError(f"saliency must be [N], got {tuple(saliency.shape)}")
    return _sorted(_top(saliency, keep_count(saliency.shape[0], keep_ratio)))


def affinity_keep(
    saliency: Tensor,
    prefix_experts: Tensor,
    keep_ratio: float,
    salient_ratio: float,
    affinity_weight: float = 2.0,
) -> Tensor:
    """VisMMOE Algorithm 1: a salient core, then the tokens whose pinned-prefix routing stays near the core's.

    saliency [N]; prefix_experts [N, L, k]: expert ids each token was routed to in each of the L pinned-prefix
    MoE layers. core = top floor(salient_ratio*N) by saliency (capped at the keep count). T = the (layer, expert)
    pairs the core uses. For every other token i, Delta_i = fraction of its L*k routing slots whose (layer, expert)
    pair is outside T; the rest of the budget goes to the highest p_i = s_i - affinity_weight * Delta_i (ties by
    lower index). With L == 0 there is no routing to compare, and this is saliency_keep.
    """
    n = saliency.shape[0]
    if saliency.dim() != 1 or prefix_experts.dim() != 3 or prefix_experts.shape[0] != n:
        raise ValueError(
            f"expected saliency [N] and prefix_experts [N, L, k], got {tuple(saliency.shape)}"
            f" and {tuple(prefix_experts.shape)}"
        )
    _check_ratio("salient_ratio", salient_ratio)
    n_keep = keep_count(n, keep_ratio)
    n_layers, top_k = prefix_experts.shape[1], prefix_experts.shape[2]
    if n_layers == 0 or top_k == 0 or n == 0:
        return saliency_keep(saliency, keep_ratio)
    n_core = min(_floor_count(n, salient_ratio), n_keep)

    core = _top(saliency, n_core)
    experts = prefix_experts.to(device=saliency.device, dtype=torch.long)
    n_experts = int(experts.max()) + 1
    # Expert ids are per layer: expert 5 of layer 0 and expert 5 of layer 1 are different experts.
    layer = torch.arange(n_layers, device=experts.device).view(1, n_layers, 1)
    target = torch.zeros(n_layers, n_experts, dtype=torch.bool, device=experts.device)
    target[layer.expand(n_core, n_layers, top_k), experts[core]] = True

    outside = ~target[layer.expand(n, n_layers, top_k), experts]  # [N, L, k]
    delta = outside.sum(dim=(1, 2), dtype=torch.float64) / (n_layers * top_k)
    # float64 so the score matches the reference bit for bit (ties decide ranks here).
    priority = saliency.to(torch.float64) - affinity_weight * delta

    is_core = torch.zeros(n, dtype=torch.bool, device=saliency.device)
    is_core[core] = True
    others = torch.nonzero(~is_core).squeeze(1)  # ascending, so the stable sort still breaks ties by index
    rest = others[_top(priority[others], n_keep - n_core)]
    return _sorted(torch.cat([core, rest]))


def affinity_keep_reference(
    saliency: Tensor,
    prefix_experts: Tensor,
    keep_ratio: float,
    salient_ratio: float,
    affinity_weight: float = 2.0,
) -> Tensor:
    """affinity_keep written straight from the formulas with Python loops and sets. Slow; for tests only."""
    s = [float(x) for x in saliency.tolist()]
    routes = prefix_experts.tolist()  # [N][L][k]
    n = len(s)
    n_keep = keep_count(n, keep_ratio)
    n_layers = len(routes[0]) if n else 0
    top_k = len(routes[0][0]) if n_layers else 0
    if n_layers == 0 or top_k == 0:
        order = sorted(range(n), key=lambda i: (-s[i], i))
        return torch.tensor(sorted(order[:n_keep]), dtype=torch.long)
    n_core = min(_floor_count(n, salient_ratio), n_keep)

    core = sorted(range(n), key=lambda i: (-s[i], i))[:n_core]
    targets: set[tuple[int, int]] = set()
    for i in core:
        for layer in range(n_layers):
            for e in routes[i][layer]:
                targets.add((layer, e))

    priority: dict[int, float] = {}
    for i in range(n):
        if i in core:
            continue
        slots = [(layer, e) for layer in range(n_layers) for e in routes[i][layer]]
        delta = sum(1 for pair in slots if pair not in targets) / len(slots)
        priority[i] = s[i] - affinity_weight * delta
    rest = sorted(priority, key=lambda i: (-priority[i], i))[: n_keep - n_core]
    return torch.tensor(sorted(core + rest), dtype=torch.long)


def zip_keep(
    saliency: Tensor, hidden: Tensor, keep_ratio: float, contextual_share: float = 0.25
) -> tuple[Tensor, list[Tensor]]:
    """VisionZip-style: keep the most salient tokens, and merge the rest into a few evenly spaced targets.

    K = keep_count(N, keep_ratio); K_ctx = round(contextual_share * K) (half up; 0 when K < 4). Dominant = top
    K - K_ctx by saliency. From the other tokens (in index order), K_ctx targets at positions floor(j * R / K_ctx);
    every remaining non-target joins its most cosine-similar target (by `hidden`; ties to the earlier target).
    Returns (kept indices ascending, groups): groups[j] holds the source indices (ascending) averaged into kept
    token j: itself for a dominant token, itself plus its assigned tokens for a target.
    """
    n = saliency.shape[0]
    if saliency.dim() != 1 or hidden.dim() != 2 or hidden.shape[0] != n:
        raise ValueError(f"expected saliency [N] and hidden [N, H], got {tuple(saliency.shape)}, {tuple(hidden.shape)}")
    _check_ratio("contextual_share", contextual_share)
    device = saliency.device
    k = keep_count(n, keep_ratio)
    k_ctx = math.floor(contextual_share * k + 0.5) if k >= 4 else 0
    dominant = _top(saliency, k - k_ctx)

    is_dominant = torch.zeros(n, dtype=torch.bool, device=device)
    is_dominant[dominant] = True
    remaining = torch.nonzero(~is_dominant).squeeze(1)  # ascending
    r = remaining.shape[0]
    targets = remaining[(torch.arange(k_ctx, device=device) * r) // k_ctx] if k_ctx else remaining[:0]

    # owner[i] = kept token whose group source i joins, -1 if dropped.
    owner = torch.full((n,), -1, dtype=torch.long, device=device)
    owner[dominant] = dominant
    owner[targets] = targets
    if k_ctx:
        is_target = torch.zeros(n, dtype=torch.bool, device=device)
        is_target[targets] = True
        sources = remaining[~is_target[remaining]]
        similarity = F.normalize(hidden[sources].float(), dim=-1) @ F.normalize(hidden[targets].float(), dim=-1).T
        owner[sources] = targets[similarity.argmax(dim=1)]

    kept = _sorted(torch.cat([dominant, targets]))
    # Group members in ascending index order: stable-sort the covered tokens by owner.
    covered = torch.nonzero(owner >= 0).squeeze(1)
    by_owner = covered[torch.sort(owner[covered], stable=True).indices]
    sizes = torch.bincount(owner[covered], minlength=n)[kept]
    groups = list(torch.split(by_owner, sizes.tolist()))
    return kept, groups
