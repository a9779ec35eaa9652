"""Can position be read linearly from hidden states? A ridge probe with power and a null.

A held-out R^2 from a handful of sequences is noise: negative values are overfitting,
not "no information". This probe
  - fits ridge regressions (features z-scored on the fitting rows, unpenalised intercept:
    exactly scikit-learn's ``make_pipeline(StandardScaler(), Ridge(alpha))``) from each
    row of H (B, T, D) to its position t and to log(1 + t);
  - scores them by grouped k-fold cross-validation with whole sequences as groups
    (scikit-learn's ``GroupKFold``, which is deterministic: the split never depends on a
    run seed), choosing alpha inside each outer fold by an inner grouped CV over the
    fitting sequences only (the other folds, each left out in turn: nested, so the reported
    R^2 is not selected on its own test rows);
  - reports the pooled out-of-fold R^2 = 1 - SSE / SST (SST around the overall mean)
    next to a null on the same features: each sequence's position labels are reassigned by
    its own random cyclic shift (fixed seed; ``label_shuffles``). That destroys the
    feature-position link and keeps everything else: the features, each sequence's label
    set, any sequence-level structure, and the labels' smoothness along the sequence (so
    the null sees the spurious fits that autocorrelated text features allow). One
    relabelling shared by all sequences would not destroy the link: the probe could learn
    the relabelled map. The whole procedure, alpha choice included, is rerun on each
    relabelling, so the null also absorbs the selection's optimism.

Every ridge fit needs only per-fold sums (n, sum x, sum x x^T, sum y, sum y^2, sum x y),
so all folds, alphas and permutations come from one pass over the rows plus one (D, D)
eigendecomposition per distinct fitting set: K outer fits and K (K - 1) / 2 inner ones (15 at
K = 5; the inner fit leaving out folds f and g serves outer folds f and g), whatever the number
of permutations. The pass can be made in chunks of sequences on the states' device
(``PositionProbeSums``: the training callback sums 13 layers x 128 blocks x 1024 positions at
d 768 that way, never holding the states), in float64 (why: ``PositionProbeSums``).
Fitting the same nested CV with scikit-learn estimators would take
K^2 x n_alphas x (1 + n_permutations) x 2 fits (45k fits of ~0.05 s at 128 sequences x
128 positions x D 128); this takes ~0.6 s with 100 permutations, ~0.16 s with 20 (one core).
The tests check it against exactly those scikit-learn fits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.model_selection import GroupKFold
from torch import Tensor

from pe_geometry.analysis.measures.nulls import null_summary

ALPHAS = tuple(float(a) for a in np.logspace(-2, 6, 9))  # for z-scored features; N rows ~ 1e4
TARGETS = {"position": lambda t: t, "log_position": np.log1p}


@dataclass
class _FoldSums:
    """Sufficient statistics of a ridge fit, summed over the sequences of each fold (K folds), float64.

    y has C columns (targets x [observed, permutations]). Tensors on the device they were summed on.
    """

    n: Tensor  # (K,)
    sx: Tensor  # (K, D)
    sxx: Tensor  # (K, D, D)
    sy: Tensor  # (K, C)
    syy: Tensor  # (K, C)
    sxy: Tensor  # (K, D, C)

    def total(self, folds: Sequence[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        names = ("n", "sx", "sxx", "sy", "syy", "sxy")
        if len(folds) == 1:  # a view: summing one fold would copy its (D, D) matrix
            return tuple(getattr(self, name)[folds[0]] for name in names)  # type: ignore[return-value]
        # a sum of views: indexing with a tensor would first copy every (D, D) fold matrix
        return tuple(sum(getattr(self, name)[f] for f in folds) for name in names)  # type: ignore[return-value]


@dataclass
class _Fit:
    """A ridge fit on some folds, for every alpha and label column at once: Z^T Z = V diag(lam) V^T, the projected
    cross-products proj = V^T Z^T (y - ybar) (D, C), the feature scale s (D,) and the fitting means mu (D,), ybar (C,)."""

    evecs: Tensor
    evals: Tensor
    proj: Tensor
    scale: Tensor
    mu: Tensor
    ybar: Tensor

    def weights(self, alphas: Tensor) -> Tensor:
        """Raw-feature weights (D, n_alphas * C): column a * C + c is column c's at ``alphas[a]`` (n_alphas,). One flat
        (D, D) x (D, n_alphas * C) product: a batched one would run a smaller product per alpha, and slower."""
        shrink = self.proj[:, None, :] / (self.evals.clamp_min(0.0)[:, None, None] + alphas[None, :, None])
        return (self.evecs / self.scale[:, None]) @ shrink.reshape(len(self.evals), -1)

    def weights_per_column(self, alphas: Tensor) -> Tensor:
        """Raw-feature weights (D, C) with column c's own alpha ``alphas[c]``: one (D, D) x (D, C) product whatever
        the number of alphas (the outer fit needs only the alpha its inner CV chose for each column)."""
        shrink = self.proj / (self.evals.clamp_min(0.0)[:, None] + alphas[None, :])
        return (self.evecs / self.scale[:, None]) @ shrink


def _ridge(sums: _FoldSums, fit: Sequence[int]) -> _Fit:
    """The ridge fit on folds ``fit``, for every alpha and column (weights: ``_Fit.weights``).

    Same model as StandardScaler + Ridge(alpha): z = (x - mu) / s with mu, s (population std, 1 where 0) from the
    fitting rows, w = (Z^T Z + alpha I)^-1 Z^T (y - ybar), and the prediction ybar + z w. One (D, D)
    eigendecomposition serves every alpha and every column: the observed labels and all their relabellings.
    """
    n, sx, sxx, sy, _, sxy = sums.total(fit)
    mu, ybar = sx / n, sy / n  # (D,), (C,)
    cov = sxx / n - torch.outer(mu, mu)
    scale = torch.diagonal(cov).clamp_min(0.0).sqrt()
    scale = torch.where(scale < 1e-12 * scale.max().clamp_min(1e-300), 1.0, scale)  # constant features, as StandardScaler
    gram = n * cov / torch.outer(scale, scale)  # Z^T Z
    cross = (sxy - torch.outer(mu, sy)) / scale[:, None]  # Z^T (y - ybar), (D, C)
    # torch's eigh, not numpy's: on a CPU the products around it run on torch's threads, and two thread pools
    # (torch's OpenMP, numpy's OpenBLAS) spin-waiting on the same 2 cores made a layer 1.6x slower than torch alone
    # (experiments/benchmark_pretrained.py)
    evals, evecs = torch.linalg.eigh(gram)
    return _Fit(evecs, evals, evecs.T @ cross, scale, mu, ybar)


def _sse(sums: _FoldSums, w: Tensor, fit: _Fit, val: Sequence[int]) -> Tensor:
    """Validation SSE on folds ``val`` of weights w (D, A * C), A sets of C columns, fitted as ``fit`` (its means): (A, C).

    sum over validation rows of ((y - ybar) - (x - mu) w)^2 = yy + w^T (xx w - 2 xy), expanded into the validation
    sums, so no row is touched.
    """
    mu, ybar = fit.mu, fit.ybar
    nv, sxv, sxxv, syv, syyv, sxyv = sums.total(val)
    yy = syyv - 2 * ybar * syv + nv * ybar**2  # (C,)
    xc_y = sxyv - torch.outer(mu, syv) - torch.outer(sxv, ybar) + nv * torch.outer(mu, ybar)  # (D, C)
    xx = torch.addr(sxxv, mu, sxv - nv * mu, alpha=-1).addr_(sxv, mu, alpha=-1)  # (x - mu)(x - mu)^T summed, (D, D)
    D, C = xc_y.shape
    resid = (xx @ w).view(D, -1, C).sub_(xc_y[:, None], alpha=2)  # in place: the (D, A, C) temporaries are the cost
    return yy + (w.view(D, -1, C) * resid).sum(0)


def _cv_r2(sums: _FoldSums, alphas: Tensor) -> Tensor:
    """Pooled out-of-fold R^2 per column, alpha chosen per column by the inner CV: (C,).

    Outer fold f is scored with a model fitted on the other folds; its alpha is the one with
    the lowest pooled SSE over the inner folds, which are the other outer folds (each left
    out in turn from the fitting sequences): nested, grouped, and needing only fold sums.
    The inner fit that leaves out f and g is the same for outer fold f and outer fold g, so
    K + K (K - 1) / 2 fits serve all K^2 (15 of 25 at K = 5). The outer fit's weights and SSE
    are computed at each column's chosen alpha only.
    """
    K = len(sums.n)
    n_all, _, _, sy, syy, _ = sums.total(range(K))
    sst = syy - sy**2 / n_all
    sse = torch.zeros_like(sst)
    inner: dict[frozenset[int], tuple[_Fit, Tensor]] = {}  # an inner fit and its weights at every alpha

    def inner_fit(folds: list[int]) -> tuple[_Fit, Tensor]:
        key = frozenset(folds)
        if key not in inner:
            fit = _ridge(sums, folds)
            inner[key] = (fit, fit.weights(alphas))
        return inner[key]

    for f in range(K):
        rest = [g for g in range(K) if g != f]
        best = torch.zeros(len(sst), dtype=torch.long, device=sst.device)
        if len(alphas) > 1:
            pooled = 0
            for g in rest:
                fit, w = inner_fit([h for h in rest if h != g])
                pooled = pooled + _sse(sums, w, fit, [g])  # (n_alphas, C)
            best = pooled.argmin(dim=0)  # lowest pooled inner SSE = highest pooled inner R^2
        outer = _ridge(sums, rest)
        sse += _sse(sums, outer.weights_per_column(alphas[best]), outer, [f])[0]
    return 1.0 - sse / sst.clamp_min(1e-300)


NULLS = ("shift", "permute")


def label_shuffles(B: int, T: int, n_shuffles: int, kind: str = "shift", seed: int = 0) -> np.ndarray:
    """(n_shuffles, B, T) index arrays: new position labels for each sequence, independently per sequence.

    shift:   a random cyclic shift, t -> (t + s) mod T. Neighbouring rows keep neighbouring
             labels, so a feature that drifts smoothly along a sequence (topic, style) is as
             correlated with the null labels as with the real ones: text features are
             autocorrelated, and a null that ignores that is too narrow.
    permute: a random permutation of 0..T-1 (exchangeable rows). Measured on token embeddings
             of real text (no position by construction) its spread is ~2/3 of the shift
             null's, so its p-values are too small there; kept for i.i.d. features.
    Both keep every sequence's label set and change the label map from sequence to sequence,
    so no single linear map can follow it.
    """
    if kind not in NULLS:
        raise ValueError(f"null={kind!r}; valid: {list(NULLS)}")
    rng = np.random.default_rng(seed)
    if kind == "shift":
        return (np.arange(T) + rng.integers(0, T, size=(n_shuffles, B, 1))) % T
    return rng.permuted(np.broadcast_to(np.arange(T), (n_shuffles, B, T)), axis=-1)


class PositionProbeSums:
    """The probe's fold sums for n_layers layers, accumulated chunk by chunk of blocks on the states' device.

    Built from the number of blocks B and their length T (the folds, GroupKFold by block, and the
    relabellings, label_shuffles, are fixed by B, T and the seed); then ``add`` each chunk of hidden
    states (b, T, D) with the index of its first block and its layer, in any order; ``report(layer)``.
    Equal to position_probe on the whole (B, T, D) to rounding, whatever the chunks.

    Memory: K (D^2 + D C + 2 C) float64 per layer (C = 2 (1 + n_permutations) label columns;
    d 768, K 5: 24 MB a layer), plus the (n_permutations, B, T) relabellings, instead of the
    (B, T, D) states. Everything is float64, because the fit reads differences of large sums:
    the centred cross-products x x^T - n mu mu^T (a hidden state's mean is often far larger
    than its spread along some directions), and an SSE that is yy - 2 w.xy + w^T xx w with
    SSE << yy when position is read well (R^2 0.999 leaves 3 digits of float32's 7). The
    features are shifted and scaled by the first chunk's mean and std (per feature) before
    summing, which keeps those differences small; the fit standardises per fold anyway, so
    the shift and scale do not change it (only its rounding).
    """

    def __init__(self, B: int, T: int, n_layers: int = 1, n_splits: int = 5, n_permutations: int = 100,
                 seed: int = 0, null: str = "shift") -> None:
        if n_splits < 2 or B < n_splits:
            raise ValueError(f"need n_splits >= 2 and at least n_splits sequences; got n_splits={n_splits}, B={B}")
        self.B, self.T, self.n_splits, self.n_permutations = B, T, n_splits, n_permutations
        self.fold_of = np.empty(B, dtype=np.int64)
        for f, (_, members) in enumerate(GroupKFold(n_splits=n_splits).split(np.arange(B), groups=np.arange(B))):
            self.fold_of[members] = f
        self.perms = label_shuffles(B, T, n_permutations, null, seed)  # (n_perm, B, T)
        t = np.arange(T, dtype=np.float64)
        self.labels = np.stack([fn(t) for fn in TARGETS.values()], axis=-1)  # (T, n_targets)
        self.sums: list[_FoldSums | None] = [None] * n_layers
        self.conditioning: list[tuple[Tensor, Tensor] | None] = [None] * n_layers
        self.rows = np.zeros(n_layers, dtype=np.int64)
        self._y: tuple[int, int, Tensor] | None = None  # the last chunk's labels, shared by its layers

    def _chunk_labels(self, first_block: int, b: int, device: torch.device) -> Tensor:
        """(b, T, C) label columns of blocks first_block .. + b: target-major, [observed, perm_1 .. perm_n] each, centred."""
        if self._y is None or self._y[:2] != (first_block, b) or self._y[2].device != device:
            labels, perms = self.labels, self.perms[:, first_block : first_block + b]  # (n_perm, b, T)
            y = np.concatenate([labels[None].repeat(b, 0)[:, :, None, :], labels[perms.transpose(1, 2, 0)]], axis=2)
            y = y.transpose(0, 1, 3, 2).reshape(b, self.T, -1)  # (b, T, n_targets * (1 + n_perm))
            y = y - labels.mean(0).repeat(1 + self.n_permutations)  # centre each target (conditioning)
            self._y = (first_block, b, torch.from_numpy(y).to(device))
        return self._y[2]

    def add(self, H: Tensor | np.ndarray, first_block: int, layer: int = 0) -> None:
        """Hidden states H (b, T, D) of blocks first_block .. first_block + b - 1 at ``layer``."""
        x = torch.as_tensor(H).detach().to(torch.float64)
        if x.ndim != 3 or x.shape[1] != self.T:
            raise ValueError(f"H must be (b, T={self.T}, D), got shape {tuple(x.shape)}")
        b, T, D = x.shape
        if self.conditioning[layer] is None:  # conditioning only: z-scoring is refitted per fold
            shift, scale = x.mean(dim=(0, 1)), x.std(dim=(0, 1), correction=0)
            scale = torch.where(scale < 1e-12 * scale.max().clamp_min(1e-300), 1.0, scale)
            self.conditioning[layer] = (shift, scale)
        shift, scale = self.conditioning[layer]
        x = (x - shift) / scale
        y = self._chunk_labels(first_block, b, x.device)
        C = y.shape[-1]
        if self.sums[layer] is None:
            zeros = functools.partial(torch.zeros, dtype=torch.float64, device=x.device)
            K = self.n_splits
            self.sums[layer] = _FoldSums(zeros(K), zeros(K, D), zeros(K, D, D), zeros(K, C), zeros(K, C), zeros(K, D, C))
        sums = self.sums[layer]
        folds = self.fold_of[first_block : first_block + b]
        for f in np.unique(folds):
            members = torch.from_numpy(np.flatnonzero(folds == f)).to(x.device)
            xf, yf = x[members].reshape(-1, D), y[members].reshape(-1, C)
            sums.n[f] += len(xf)
            sums.sx[f] += xf.sum(0)
            sums.sxx[f] += xf.T @ xf
            sums.sy[f] += yf.sum(0)
            sums.syy[f] += (yf * yf).sum(0)
            sums.sxy[f] += xf.T @ yf
        self.rows[layer] += b * T

    def report(self, layer: int = 0, alphas: tuple[float, ...] = ALPHAS) -> dict[str, float]:
        """position_probe's figures for ``layer`` (every block must have been added)."""
        if self.rows[layer] != self.B * self.T:
            raise ValueError(f"{self.rows[layer]} rows added at layer {layer}, the blocks have {self.B * self.T}")
        sums = self.sums[layer]
        r2 = _cv_r2(sums, torch.tensor(alphas, dtype=torch.float64, device=sums.n.device))
        r2 = r2.cpu().numpy().reshape(len(TARGETS), 1 + self.n_permutations)
        report: dict[str, float] = {}
        for i, name in enumerate(TARGETS):
            report |= null_summary(f"{name}_r2", float(r2[i, 0]), r2[i, 1:], alternative="greater")
        return report


def position_probe(
    H: Tensor | np.ndarray,
    n_splits: int = 5,
    n_permutations: int = 100,
    seed: int = 0,
    alphas: tuple[float, ...] = ALPHAS,
    null: str = "shift",
) -> dict[str, float]:
    """Cross-validated R^2 of ridge probes for position and log(1 + position), with a permutation null.

    H (B, T, D): hidden states of B sequences (row t of a sequence is position t); B >= n_splits.
    Returns, for target in (position, log_position):
      {target}_r2             pooled out-of-fold R^2, <= 1: 1 = read off perfectly, ~0 = not
                              linearly readable (slightly below 0 is the price of fitting)
      {target}_r2_null_mean, _null_std, _z, _p   the same probe on labels reassigned within
                              each sequence (label_shuffles: cyclic shifts by default;
                              n_permutations, seeded by ``seed``, not the run seed);
                              p one-sided (greater), (k+1)/(n+1), range [1/(n+1), 1]
    n_splits outer folds of whole sequences (GroupKFold); alpha from ``alphas`` by the inner
    CV over the other n_splits - 1 folds (see _cv_r2); a single alpha = no inner choice.
    Computed on H's device; H as one chunk of PositionProbeSums, which a caller with more
    blocks than memory feeds chunk by chunk instead (the same figures, to rounding).
    """
    if H.ndim != 3:
        raise ValueError(f"H must be (B, T, D), got shape {tuple(H.shape)}")
    sums = PositionProbeSums(H.shape[0], H.shape[1], n_splits=n_splits, n_permutations=n_permutations, seed=seed, null=null)
    sums.add(H, 0)
    return sums.report(alphas=alphas)
