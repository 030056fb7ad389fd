"""Keep-set selection: counts, the vectorised Algorithm 1 against its loop reference, and VisionZip groups."""

from __future__ import annotations

import itertools

import pytest
import torch

from vismmoe_edge.compress import (
    affinity_keep,
    affinity_keep_reference,
    keep_count,
    random_keep,
    saliency_keep,
    zip_keep,
)


def _routes(g: torch.Generator, n: int, layers: int, k: int, experts: int, distinct: bool = True) -> torch.Tensor:
    """[n, layers, k] expert ids; distinct per (token, layer) like real top-k routing, or with repeats."""
    if distinct:
        return torch.rand(n, layers, experts, generator=g).argsort(dim=-1)[..., :k]
    return torch.randint(0, experts, (n, layers, k), generator=g)


def _top(s: torch.Tensor, k: int) -> torch.Tensor:
    return torch.tensor(sorted(range(len(s)), key=lambda i: (-s[i].item(), i))[:k], dtype=torch.long)


def _is_sorted_unique(idx: torch.Tensor, n: int) -> bool:
    return (
        idx.dtype == torch.long
        and bool((idx[1:] > idx[:-1]).all())
        and (idx.numel() == 0 or 0 <= idx[0] <= idx[-1] < n)
    )


# -- counts, random, saliency ------------------------------------------------------------------------------


def test_keep_count() -> None:
    assert keep_count(100, 0.25) == 25
    assert keep_count(10, 0.05) == 1  # at least one
    assert keep_count(7, 1.0) == 7
    assert keep_count(0, 0.5) == 0
    assert keep_count(100, 0.57) == 57  # 0.57 * 100 is 56.99999999999999 in binary
    assert keep_count(1089, 0.111) == 120
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError):
            keep_count(10, bad)


def test_random_keep_is_deterministic_per_generator() -> None:
    a = random_keep(500, 0.3, torch.Generator().manual_seed(5))
    b = random_keep(500, 0.3, torch.Generator().manual_seed(5))
    c = random_keep(500, 0.3, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == 150 and _is_sorted_unique(a, 500)


def test_saliency_keep_top_k_ties_to_lower_index() -> None:
    s = torch.tensor([0.5, 0.9, 0.5, 0.1, 0.9, 0.5])
    assert saliency_keep(s, 0.5).tolist() == [0, 1, 4]  # 0.9, 0.9, then the first 0.5
    assert saliency_keep(s, 0.34).tolist() == [1, 4]


@pytest.mark.parametrize("n", [1, 5, 64])
def test_keep_ratio_one_keeps_everything(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    s = torch.rand(n, generator=g)
    everything = torch.arange(n)
    assert torch.equal(random_keep(n, 1.0, g), everything)
    assert torch.equal(saliency_keep(s, 1.0), everything)
    assert torch.equal(affinity_keep(s, _routes(g, n, 3, 2, 8), 1.0, 0.3), everything)
    kept, groups = zip_keep(s, torch.randn(n, 6, generator=g), 1.0)
    assert torch.equal(kept, everything)
    assert [grp.tolist() for grp in groups] == [[i] for i in range(n)]


# -- affinity_keep (VisMMOE Algorithm 1) -------------------------------------------------------------------

_CASES = list(
    itertools.product(
        [1, 2, 9, 40, 257],  # N
        [1, 3],  # L
        [1, 4],  # k
        [4, 16],  # E
        [(0.5, 0.1), (0.25, 0.25), (0.3, 0.6), (0.05, 0.0), (0.9, 0.5)],  # (keep, salient); 0.6 > 0.3: alpha > beta
    )
)


@pytest.mark.parametrize(("n", "layers", "k", "experts", "ratios"), _CASES)
def test_affinity_keep_matches_reference(n: int, layers: int, k: int, experts: int, ratios: tuple) -> None:
    if k > experts:
        pytest.skip("top-k above the expert count")
    keep, salient = ratios
    g = torch.Generator().manual_seed(hash((n, layers, k, experts, ratios)) % 2**31)
    for trial in range(4):
        # Trials 0-1: saliency on a coarse grid, so ties in s and in p are common.
        s = torch.randint(0, 5, (n,), generator=g).float() / 4 if trial < 2 else torch.rand(n, generator=g)
        routes = _routes(g, n, layers, k, experts, distinct=trial % 2 == 0)
        for weight in (2.0, 0.5, 0.0):
            got = affinity_keep(s, routes, keep, salient, affinity_weight=weight)
            want = affinity_keep_reference(s, routes, keep, salient, affinity_weight=weight)
            assert torch.equal(got, want), (trial, weight)
            assert got.numel() == keep_count(n, keep) and _is_sorted_unique(got, n)


def test_affinity_keep_expert_ids_are_per_layer() -> None:
    # Token 0 is the core. Token 1 uses expert 7 in layer 0 like the core; token 2 uses expert 7 only in layer 1,
    # which is a different expert from the core's layer-0 expert 7.
    s = torch.tensor([1.0, 0.2, 0.3, 0.0])
    routes = torch.tensor([[[7], [1]], [[7], [1]], [[1], [7]], [[2], [3]]])
    # p1 = 0.2 - 2*0 = 0.2, p2 = 0.3 - 2*1 = -1.7: token 1 wins despite lower saliency.
    assert affinity_keep(s, routes, 0.5, 0.25).tolist() == [0, 1]
    assert affinity_keep_reference(s, routes, 0.5, 0.25).tolist() == [0, 1]


def test_affinity_keep_without_prefix_is_saliency() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 4, (100,), generator=g).float()
    empty = torch.zeros(100, 0, 8, dtype=torch.long)
    for keep in (0.1, 0.33, 1.0):
        assert torch.equal(affinity_keep(s, empty, keep, 0.5), saliency_keep(s, keep))
        assert torch.equal(affinity_keep_reference(s, empty, keep, 0.5), saliency_keep(s, keep))


def test_affinity_keep_with_alpha_above_beta_is_saliency() -> None:
    g = torch.Generator().manual_seed(1)
    s = torch.rand(80, generator=g)
    assert torch.equal(affinity_keep(s, _routes(g, 80, 3, 4, 16), 0.2, 0.9), saliency_keep(s, 0.2))


# -- zip_keep (VisionZip) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "keep", "share"),
    [(1, 0.5, 0.25), (5, 0.6, 0.25), (64, 0.25, 0.25), (257, 0.1, 0.4), (30, 0.5, 0.0), (30, 0.5, 1.0)],
)
def test_zip_keep_groups(n: int, keep: float, share: float) -> None:
    g = torch.Generator().manual_seed(n)
    s = torch.randint(0, 6, (n,), generator=g).float()  # with ties
    hidden = torch.randn(n, 12, generator=g)
    kept, groups = zip_keep(s, hidden, keep, contextual_share=share)
    k = keep_count(n, keep)
    k_ctx = int(share * k + 0.5) if k >= 4 else 0
    assert kept.numel() == k == len(groups) and _is_sorted_unique(kept, n)

    members = torch.cat(groups)
    assert members.unique().numel() == members.numel()  # every token in at most one group
    assert set(members.tolist()) == (set(range(n)) if k_ctx else set(kept.tolist()))  # targets absorb the rest
    for j, grp in zip(kept.tolist(), groups, strict=True):
        assert j in grp.tolist() and _is_sorted_unique(grp, n)

    for j in _top(s, k - k_ctx).tolist():  # dominant tokens: the most salient, kept alone
        assert groups[kept.tolist().index(j)].tolist() == [j]


def test_zip_keep_exact_layout() -> None:
    # Dominant: the 3 largest saliencies (9, 8, 7 at 4, 0, 9). Remaining in order: 1 2 3 5 6 7 8 (R = 7);
    # K_ctx = round(0.25 * 4) = 1 target at position 0 -> token 1, which absorbs all the others.
    s = torch.tensor([8.0, 0, 0, 0, 9, 0, 0, 0, 0, 7])
    hidden = torch.randn(10, 4)
    kept, groups = zip_keep(s, hidden, 0.4)
    assert kept.tolist() == [0, 1, 4, 9]
    assert [grp.tolist() for grp in groups] == [[0], [1, 2, 3, 5, 6, 7, 8], [4], [9]]


def test_zip_keep_assigns_to_most_similar_target() -> None:
    n, dim = 40, 8
    g = torch.Generator().manual_seed(2)
    s = torch.rand(n, generator=g)
    hidden = torch.randn(n, dim, generator=g)
    kept, groups = zip_keep(s, hidden, 0.5, contextual_share=0.5)  # K = 20, K_ctx = 10
    targets = sorted(set(kept.tolist()) - set(_top(s, 10).tolist()))
    assert len(targets) == 10
    unit = torch.nn.functional.normalize(hidden, dim=-1)
    for j, grp in zip(kept.tolist(), groups, strict=True):
        for i in grp.tolist():
            if i != j:
                assert j in targets
                sims = unit[i] @ unit[targets].T
                assert (unit[i] @ unit[j]).item() == pytest.approx(sims.max().item(), abs=1e-6)


def test_zip_keep_is_deterministic() -> None:
    g = torch.Generator().manual_seed(4)
    s = torch.randint(0, 3, (100,), generator=g).float()
    hidden = torch.randn(100, 16, generator=g)
    a_kept, a_groups = zip_keep(s, hidden, 0.2)
    b_kept, b_groups = zip_keep(s.clone(), hidden.clone(), 0.2)
    assert torch.equal(a_kept, b_kept)
    assert all(torch.equal(a, b) for a, b in zip(a_groups, b_groups, strict=True))
