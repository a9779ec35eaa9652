"""The position probe's fast path (outer fits at the chosen alpha only, flat products over every alpha, fold totals as sums of
views) against the implementation it replaced, kept here verbatim as the reference: the same R^2 for the observed
labels and every relabelling, to 1e-10."""

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import Tensor

from pe_geometry.analysis.measures import position_probe as probe
from pe_geometry.analysis.measures.position_probe import ALPHAS, PositionProbeSums, _FoldSums


def _old_total(sums: _FoldSums, folds: Sequence[int]):
    index = torch.as_tensor(list(folds), device=sums.n.device)
    return tuple(getattr(sums, name)[index].sum(0) for name in ("n", "sx", "sxx", "sy", "syy", "sxy"))


def _old_ridge(sums: _FoldSums, fit: Sequence[int], alphas: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    n, sx, sxx, sy, _, sxy = _old_total(sums, fit)
    mu, ybar = sx / n, sy / n
    cov = sxx / n - torch.outer(mu, mu)
    scale = torch.diagonal(cov).clamp_min(0.0).sqrt()
    scale = torch.where(scale < 1e-12 * scale.max().clamp_min(1e-300), 1.0, scale)
    gram = n * cov / torch.outer(scale, scale)
    cross = (sxy - torch.outer(mu, sy)) / scale[:, None]
    evals, evecs = torch.linalg.eigh(gram)
    proj = evecs.T @ cross
    w = evecs @ (proj[None] / (evals.clamp_min(0.0)[None, :, None] + alphas[:, None, None]))
    return w / scale[None, :, None], mu, ybar


def _old_sse(sums: _FoldSums, fitted: tuple[Tensor, Tensor, Tensor], val: Sequence[int]) -> Tensor:
    w, mu, ybar = fitted
    nv, sxv, sxxv, syv, syyv, sxyv = _old_total(sums, val)
    yy = syyv - 2 * ybar * syv + nv * ybar**2
    xc_y = sxyv - torch.outer(mu, syv) - torch.outer(sxv, ybar) + nv * torch.outer(mu, ybar)
    xx = sxxv - torch.outer(mu, sxv) - torch.outer(sxv, mu) + nv * torch.outer(mu, mu)
    return yy[None] - 2 * (w * xc_y).sum(1) + (w * (xx @ w)).sum(1)


def old_cv_r2(sums: _FoldSums, alphas: Tensor) -> Tensor:
    """position_probe._cv_r2 before the fast path (every fit at every alpha, torch's eigh)."""
    K = len(sums.n)
    n_all, _, _, sy, syy, _ = _old_total(sums, range(K))
    sst = syy - sy**2 / n_all
    sse = torch.zeros_like(sst)
    columns = torch.arange(len(sst), device=sst.device)
    fits: dict = {}

    def fitted(folds: list[int]):
        key = frozenset(folds)
        if key not in fits:
            fits[key] = _old_ridge(sums, folds, alphas)
        return fits[key]

    for f in range(K):
        fit = [g for g in range(K) if g != f]
        best = torch.zeros(len(sst), dtype=torch.long, device=sst.device)
        if len(alphas) > 1:
            inner = sum(_old_sse(sums, fitted([h for h in fit if h != g]), [g]) for g in fit)
            best = inner.argmin(dim=0)
        sse += _old_sse(sums, fitted(fit), [f])[best, columns]
    return 1.0 - sse / sst.clamp_min(1e-300)


def features(B: int, T: int, D: int, seed: int) -> np.ndarray:
    """Noise with position in a few features at different strengths (so the chosen alpha differs between the
    observed labels and the relabellings), one feature constant (StandardScaler's scale-1 rule) and one offset far
    from its spread (the conditioning PositionProbeSums applies)."""
    rng = np.random.default_rng(seed)
    H = rng.normal(size=(B, T, D))
    t = np.arange(T)
    H[:, :, 0] += 0.2 * t
    H[:, :, 1] += 0.6 * np.log1p(t)
    H[:, :, 2] += 0.02 * t
    H[:, :, 3] = 5.0
    H[:, :, 4] = 1e3 + 0.1 * H[:, :, 4]
    return H


@pytest.mark.parametrize(("B", "T", "D", "n_splits", "alphas", "null"), [
    (20, 12, 8, 5, ALPHAS, "shift"),
    (13, 9, 30, 3, (0.01, 1.0, 100.0), "shift"),  # D > rows of some fits: ridge only (alpha > 0) holds it
    (12, 16, 6, 4, (10.0,), "permute"),  # one alpha: no inner choice
])
def test_the_fast_path_equals_the_old_one(B, T, D, n_splits, alphas, null):
    H = features(B, T, D, seed=B + D)
    sums = PositionProbeSums(B, T, n_splits=n_splits, n_permutations=7, seed=3, null=null)
    for first in range(0, B, 5):  # in chunks, as the training callback adds them
        sums.add(H[first : first + 5], first)
    alphas_t = torch.tensor(alphas, dtype=torch.float64)
    new = probe._cv_r2(sums.sums[0], alphas_t).numpy()
    old = old_cv_r2(sums.sums[0], alphas_t).numpy()
    assert new.shape == (2 * (1 + 7),)
    np.testing.assert_allclose(new, old, rtol=0, atol=1e-10)
    assert np.ptp(new) > 0.05  # observed and relabelled columns differ: a wrong column order would show


def test_the_fast_path_chooses_per_column_alphas_as_the_old_one():
    """A case where columns choose different alphas, so weights_per_column must use each column's own."""
    H = features(24, 10, 12, seed=5)
    sums = PositionProbeSums(24, 10, n_permutations=5, seed=1)
    sums.add(H, 0)
    alphas = torch.tensor((1e-2, 1.0, 1e2, 1e4), dtype=torch.float64)
    chosen = set()
    for f in range(5):  # the inner choice of each column, as _cv_r2 makes it
        rest = [g for g in range(5) if g != f]
        pooled = sum(_old_sse(sums.sums[0], _old_ridge(sums.sums[0], [h for h in rest if h != g], alphas), [g]) for g in rest)
        chosen |= set(pooled.argmin(dim=0).tolist())
    assert len(chosen) > 1
    np.testing.assert_allclose(probe._cv_r2(sums.sums[0], alphas).numpy(), old_cv_r2(sums.sums[0], alphas).numpy(),
                               rtol=0, atol=1e-10)
