"""Spectra-keeping null distributions for the input-level word/position figures.

The analytic chance of a figure (isotropic random vectors or subspaces) ignores the
matrices' own spectra: a position table whose variance sits in 2-3 directions, or a
word matrix with a dominant mean row, moves the figure away from isotropic chance
without any alignment between the two. The fair null keeps E and P exactly as trained
and randomises only their relative orientation: P's rows are rotated by Haar-random
orthogonal matrices Q (p -> Q p, fixed seed), and every figure is recomputed.

Conventions as in the geometry measures: E (n_words, d) word rows, P (n_positions, d)
position rows, U / V (d, k) orthonormal bases, E's and P's principal directions and
variances from their centred rows (rotation leaves both spectra unchanged).

Each figure's null is drawn exactly in distribution, at its own cost: Q enters a figure
only through a few random objects, and only those are drawn. The one error is Monte-Carlo
(the finite number of draws); no figure is approximated.

- abs_cos_mean, mean |cos| over word x position pairs. A rotated row Q p is uniform on the
  sphere, so every pair's E|cos| is the isotropic chance_abs_cos(d): the null mean is exact
  and drawn from nothing. Its spread is a property of all pairs at once (rows sharing
  directions move together), so a draw is the whole table: n_words n_positions d
  multiply-adds, the floor for this figure. A random subset of pairs would not do: near
  isotropy the null's spread is itself the pair-sampling noise of n_words x n_positions
  pairs, so a subset inflates it by as much as it saves. What is saved is the rotations:
  draw (a, b) uses Q_ab = F_a^T H_b, with E's rows rotated by F_a and P's by H_b, all
  independent Haar, so n draws need about 2 sqrt(n) Haar frames (a QR of a d x r Gaussian,
  r = min(rows, d)) instead of n. Each Q_ab is Haar, and any two draws are independent (given
  F_a, F_a^T H_b and F_a^T H_b' are independent Haar matrices, whatever F_a is; any three
  too; only the four corners of a rectangle of the grid are dependent). The Monte-Carlo
  variances of the reported figures involve only pairs of draws (the mean of the draws, the
  mean square about the exact mean, the count behind an empirical p-value), so they are
  exactly those of n independent draws.
- overlap_k{k}, angle_mean_k{k}_deg: only the random k-frame Q V_Pk enters, written in E's
  principal basis (W, d x k): overlap = ||W[:k]||^2 / k; the angles' cosines are the
  singular values of W[:k], their sines those of W[k:]. The spectra do not enter at all.
  O(d k^2) per draw (a QR of a d x k Gaussian); the overlap's exact mean is k / d.
- var_share_E_in_P_k{k}: the same W, its rows weighted by E's variances,
  sum_a var_E[a] ||W[a]||^2 / sum var_E. var_share_P_in_E_k{k}: likewise a random k-frame
  (Q^T U_E) in P's principal basis against P's variances. O(d k^2) per draw; exact mean k / d.
- overlap_var{90}: tr(Pi_A Pi_B), A fixed k_E-dim, B random k_P-dim. With G a d x m Gaussian
  spanning the random subspace, tr = tr((G^T G)^-1 G_A^T G_A) (G_A = G's rows on A's axes): a
  function of two independent Wishart m x m matrices, drawn directly (Bartlett), and complements
  (tr(Pi_a Pi_b) = b - tr(Pi_(d-a) Pi_b), ...) let m be the smallest of k_E, k_P, d - k_E,
  d - k_P: O(m^3) per draw, m <= d / 2, no frame and nothing d-sized built
  (subspace_overlap_draws). Exact mean max(k_E, k_P) / d.

Where the null mean is exact it is reported as X_null_mean and the spread is taken about it
(null_summary's null_mean); angle_mean has no closed form: the draws' mean.

Precision. float64: the spectra, the observed figures (the geometry callback logs them under
the geometry report's names, which they match to 1e-10), and the subspace draws (cheap; the
principal angles take arcsin of small sines, whose accuracy is why principal_angles_deg uses
them). float32: the abs_cos_mean draws, ~all of the null's arithmetic: frames, rotated rows and
tables, with each table's |cos| summed along rows in float32 (1000-odd terms) and the row sums
added in float64 (one float32 sum over a million cosines is off by ~1e-4 of itself: 2e-6, ~0.1
of the null's spread near isotropy). Against float64 on the same rotations, a draw moves by < 2e-9
while the null's spread is 2.3e-5 even for isotropic E and P (1000 and 1024 Gaussian rows, d
768; the spread only grows with structure): test_nulls.py::test_float32_table_draws_match_float64.
bfloat16 products would be ~2x faster on CPUs that have them, but move a draw by ~0.1 of that spread.

Cost (1000 words, 100 draws, 2 threads): see experiments/benchmark_geometry.py, which times
this against the previous full-frame null (every draw a d x r frame, tables in float64).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis.measures.geometry import _n_directions, chance_abs_cos, principal_angles_deg, subspace_overlap

T = TypeVar("T")

# The number of Haar draws used when the caller does not say. The null's mean and std
# settle quickly (the std's relative Monte-Carlo error is ~1/sqrt(2 n): 7 % at 100 draws)
# while an empirical p-value cannot go below 1/(n+1) (2/(n+1) two-sided) and has relative
# error sqrt((1 - p) / (n p)): ~20 % at p = 0.05 with 500 draws, ~10 % with 2000. Measured
# on a learned-PE checkpoint (mean |cos|, true p ~ 0.03): five seeds of 100 draws gave
# p 0.02-0.12 but z 1.65-2.44; 2000 draws gave p 0.030, z 2.17. So a record during
# training logs 100 draws (read its z; its p is coarse) and verdicts use REPORT_DRAWS.
DEFAULT_DRAWS = 100
REPORT_DRAWS = 2000
ALTERNATIVES = ("two-sided", "less", "greater")

# Independent random streams of one seed, one per random object.
_E_ROTATIONS, _P_ROTATIONS, _P_FRAMES_IN_E, _E_FRAMES_IN_P, _OVERLAP_SPANS = range(5)
_CHUNK_ELEMENTS = 1 << 23  # numbers held at once by a chunk of draws (a block of the table, a batch of frames)
_PARALLEL_MACS = 2.5e8  # a product this large runs on the caller's threads (_threads)


# ----------------------------------------------------------------------------- p-values


def empirical_p(observed: float, null: Tensor | np.ndarray, alternative: str = "two-sided") -> float:
    """Monte-Carlo p-value of ``observed`` against n null draws, with the (k+1)/(n+1) correction.

    less: P(null <= observed); greater: P(null >= observed); two-sided: twice the smaller
    tail, capped at 1. The +1 counts the observed value as one draw of the null (Davison &
    Hinkley 1997), so p is never 0 and is a valid p-value for any n: range [1/(n+1), 1].
    """
    if alternative not in ALTERNATIVES:
        raise ValueError(f"alternative={alternative!r}; valid: {list(ALTERNATIVES)}")
    null = np.asarray(null, dtype=np.float64).reshape(-1)
    n = len(null)
    p_less = (np.sum(null <= observed) + 1) / (n + 1)
    p_greater = (np.sum(null >= observed) + 1) / (n + 1)
    if alternative == "less":
        return float(p_less)
    if alternative == "greater":
        return float(p_greater)
    return float(min(1.0, 2.0 * min(p_less, p_greater)))


def holm(p_values: list[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the order given: the i-th smallest of m p's times (m - i + 1),
    made non-decreasing along that order (a test cannot pass where a smaller p failed) and capped at 1."""
    m = len(p_values)
    adjusted, running = [1.0] * m, 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda j: p_values[j])):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def sign_test(k: int, n: int) -> float:
    """Two-sided exact binomial p of k successes in n trials at probability 1/2 (the sign test): twice the smaller
    tail, capped at 1. Exact integer arithmetic, so it stays right for n in the thousands."""
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(0, min(k, n - k) + 1))
    return min(1.0, 2 * tail / 2**n)


def null_summary(
    name: str,
    observed: float,
    null: Tensor | np.ndarray,
    alternative: str = "two-sided",
    null_mean: float | None = None,
) -> dict[str, float]:
    """``{name, name_null_mean, name_null_std, name_z, name_p}`` for one figure.

    z = (observed - null mean) / null std: how many null spreads the figure sits from what
    random orientation gives; +-inf when the null has no spread. Without ``null_mean`` the
    mean and std are the draws' (sample std, ddof 1); with it (the null's exact expectation,
    where one is known) the mean is that value and the std the draws' root-mean-square
    deviation from it. p is the draws' empirical p-value either way.
    """
    values = np.asarray(null, dtype=np.float64).reshape(-1)
    if null_mean is None:
        mean, std = float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0
    else:
        mean, std = float(null_mean), float(np.sqrt(np.mean((values - null_mean) ** 2)))
    diff = observed - mean
    z = diff / std if std > 0 else (0.0 if diff == 0 else math.copysign(math.inf, diff))
    return {
        name: float(observed),
        f"{name}_null_mean": mean,
        f"{name}_null_std": std,
        f"{name}_z": z,
        f"{name}_p": empirical_p(observed, values, alternative),
    }


# ----------------------------------------------------------------------------- random frames


def _gaussian(shape: tuple[int, ...], seed: int, stream: int, index: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Standard normals of one random object: (seed, stream, index) seeds its own independent generator."""
    rng = np.random.default_rng([seed, stream, index])
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32 if dtype == torch.float32 else np.float64))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run torch's CPU ops on n threads inside the block, then restore the caller's setting.

    Everything here but the table's large products runs on one thread: factorisations (QR, eigh,
    Cholesky) and small products sync their threads so often that on a busy 2-core machine the
    second thread mostly waits (measured there: a 32 x 32 QR 12 ms on 2 threads, 0.02 ms on 1; a
    768 x 768 float32 QR 0.7 s vs 20 ms; a 768 x 768 eigh 0.45 s vs 0.16 s), and on an idle machine
    it saves them little. Products of >= _PARALLEL_MACS multiply-adds use the caller's threads.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _on_one_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """fn run inside _threads(1)."""

    @functools.wraps(fn)
    def on_one_thread(*args, **kwargs) -> T:
        with _threads(1):
            return fn(*args, **kwargs)

    return on_one_thread


def haar_frames(G: Tensor, threads: int = 1) -> Tensor:
    """Uniformly random orthonormal r-frames from standard Gaussians G (..., d, r): Q B for Haar Q, any fixed B.

    The Q factor of G = QR with the signs fixed so that diag(R) > 0 (without the fix the
    distribution is not uniform: Mezzadri 2007), in G's dtype. Cost O(d r^2) per frame, on ``threads``.
    """
    with _threads(threads):
        Q, R = torch.linalg.qr(G)
        return Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)


# ----------------------------------------------------------------------------- spectra


def _f64(x: Tensor) -> Tensor:
    return torch.as_tensor(x).detach().to(torch.float64)


def _unit(X: Tensor) -> Tensor:
    return X / X.norm(dim=-1, keepdim=True).clamp_min(1e-300)


def _centred_spectrum(Xc: Tensor) -> tuple[Tensor, Tensor]:
    """Variances (squared singular values, descending) and principal directions (d, .) of the centred Xc.

    At least as many rows as columns: eigh of the d x d Gram (about half an SVD's time); else the SVD.
    """
    n, d = Xc.shape
    if n >= d:
        var, V = torch.linalg.eigh(Xc.T @ Xc)
        return var.flip(0).clamp_min(0.0), V.flip(1)
    _, s, Vh = torch.linalg.svd(Xc, full_matrices=False)
    return s**2, Vh.T


@dataclass(frozen=True)
class _Spectra:
    """What the figures need from E and P, computed once per call (rotation keeps it). float64."""

    E_unit: Tensor  # (n_words, d) unit word rows
    P_unit: Tensor  # (n_positions, d) unit position rows
    E_centred: Tensor  # (n_words, d)
    P_centred: Tensor  # (n_positions, d)
    var_E: Tensor  # E's variance along each principal direction, descending
    var_P: Tensor  # same for P
    V_E: Tensor  # (d, .) E's principal directions, descending variance
    V_P: Tensor  # (d, .) P's
    k: int  # fixed k (clipped), as in the geometry report
    k_E: int  # directions holding var_threshold of E's variance
    k_P: int  # same for P


def _spectra(E: Tensor, P: Tensor, fixed_k: int, var_threshold: float) -> _Spectra:
    d = E.shape[1]  # a d x d eigh this large runs on the caller's threads (idle 2 cores: 0.13 -> 0.08 s at d 768)
    with _threads(torch.get_num_threads() if d**3 >= _PARALLEL_MACS else 1):
        return _spectra_on_these_threads(E, P, fixed_k, var_threshold)


def _spectra_on_these_threads(E: Tensor, P: Tensor, fixed_k: int, var_threshold: float) -> _Spectra:
    E, P = _f64(E), _f64(P)
    E_c, P_c = E - E.mean(dim=0, keepdim=True), P - P.mean(dim=0, keepdim=True)
    (var_E, V_E), (var_P, V_P) = _centred_spectrum(E_c), _centred_spectrum(P_c)
    s_E, s_P = var_E.sqrt(), var_P.sqrt()
    k_E, k_P = _n_directions(s_E, E.shape[0], None, var_threshold), _n_directions(s_P, P.shape[0], None, var_threshold)
    k = min(_n_directions(s_E, E.shape[0], fixed_k, var_threshold), _n_directions(s_P, P.shape[0], fixed_k, var_threshold))
    return _Spectra(_unit(E), _unit(P), E_c, P_c, var_E, var_P, V_E, V_P, k, k_E, k_P)


def _figure_names(fixed_k: int, thr: str) -> dict[str, str]:
    return {
        "abs_cos": "abs_cos_mean",
        "overlap_k": f"overlap_k{fixed_k}",
        "angle": f"angle_mean_k{fixed_k}_deg",
        "overlap_var": f"overlap_{thr}",
        "P_in_E": f"var_share_P_in_E_k{fixed_k}",
        "E_in_P": f"var_share_E_in_P_k{fixed_k}",
    }


@_on_one_thread
def _observed(S: _Spectra, names: dict[str, str]) -> dict[str, float]:
    """Every figure as E and P stand (the identity rotation), by the geometry report's formulas."""
    U_E, V_Pk = S.V_E[:, : S.k], S.V_P[:, : S.k]
    return {
        names["abs_cos"]: (S.E_unit @ S.P_unit.T).abs().mean().item(),
        names["overlap_k"]: subspace_overlap(U_E, V_Pk),
        names["angle"]: principal_angles_deg(U_E, V_Pk).mean().item(),
        names["overlap_var"]: subspace_overlap(S.V_E[:, : S.k_E], S.V_P[:, : S.k_P]),
        names["P_in_E"]: ((S.P_centred @ U_E) ** 2).sum().item() / (S.P_centred**2).sum().item(),
        names["E_in_P"]: ((S.E_centred @ V_Pk) ** 2).sum().item() / (S.E_centred**2).sum().item(),
    }


# ----------------------------------------------------------------------------- the draws, figure by figure


def _row_coordinates(X: Tensor) -> Tensor:
    """X's rows in an orthonormal basis B (d, r) of a space holding them (X = coords B^T): (n, r), r = min(n, d)."""
    n, d = X.shape
    if n >= d:
        return X
    return torch.linalg.qr(X.T)[1].T  # X^T = B R


def _abs_cos_draws(
    E_unit: Tensor, P_unit: Tensor, n_draws: int, seed: int, dtype: torch.dtype = torch.float32, threads: int | None = None
) -> Tensor:
    """mean |cos| of word rows against rotated position rows, one per draw: (n_draws,) float64.

    Draw (a, b) rotates E's rows by frame F_a and P's by H_b (Q_ab = F_a^T H_b is Haar; draws
    are pairwise independent: module docstring), on a grid of m_E x m_P ~ sqrt(n) x sqrt(n).
    Rows are rotated in the coordinates of their own span (r = min(rows, d)), so a frame is
    d x r; the table of a draw is one (n_positions x d) @ (d x n_words) product in ``dtype``
    (the frames come from float32 Gaussians either way, so dtypes differ only by rounding). Large
    products run on ``threads`` (default: the caller's setting), the rest on one (_threads).
    """
    threads = threads or torch.get_num_threads()
    with _threads(1):
        return _abs_cos_table_sums(E_unit, P_unit, n_draws, seed, dtype, threads)


def _abs_cos_table_sums(E_unit: Tensor, P_unit: Tensor, n_draws: int, seed: int, dtype: torch.dtype, threads: int) -> Tensor:
    d = E_unit.shape[1]
    x_E, x_P = (_row_coordinates(X).to(dtype) for X in (E_unit, P_unit))
    n_w, n_p = len(x_E), len(x_P)
    m_E = math.ceil(math.sqrt(n_draws))
    m_P = math.ceil(n_draws / m_E)

    def rotate(x: Tensor, stream: int, index: int, out: Tensor | None = None) -> Tensor:  # x's rows by a Haar frame
        r = x.shape[1]  # a large QR gains from the second thread on an idle machine (0.49 -> 0.30 s for 20 at d 768)
        frame = haar_frames(_gaussian((d, r), seed, stream, index, torch.float32).to(dtype), threads if d * r * r >= _PARALLEL_MACS else 1)
        with _threads(threads if x.numel() * d >= _PARALLEL_MACS else 1):
            return torch.matmul(x, frame.T, out=out)  # (rows, d)

    P_rot = torch.empty(m_P * n_p, d, dtype=dtype)  # P's rows under each rotation H_b, stacked
    for b in range(m_P):
        rotate(x_P, _P_ROTATIONS, b, out=P_rot[b * n_p : (b + 1) * n_p])
    per_product = max(1, _CHUNK_ELEMENTS // (n_w * n_p))  # rotations of P in one product
    product_threads = threads if per_product * n_p * d * n_w >= _PARALLEL_MACS else 1
    sums = []
    for a in range(m_E):
        E_rot = rotate(x_E, _E_ROTATIONS, a)
        n_b = min(m_P, n_draws - a * m_P)
        for b0 in range(0, n_b, per_product):
            b1 = min(n_b, b0 + per_product)
            with _threads(product_threads):
                cos = P_rot[b0 * n_p : b1 * n_p] @ E_rot.T  # (rotations * n_positions, n_words)
            # sum |cos| along rows (n_words terms: float32 is exact to ~1e-7), then rows in float64: one
            # float32 sum of a million terms (vector_norm's) is off by ~1e-4 of itself, ~0.1 of the null's spread
            row_sums = torch.linalg.vector_norm(cos, ord=1, dim=1).to(torch.float64)
            sums.append(row_sums.view(b1 - b0, n_p).sum(dim=1))
    return torch.cat(sums) / (n_w * n_p)


@_on_one_thread
def _frame_figure_draws(S: _Spectra, n_draws: int, seed: int) -> dict[str, Tensor]:
    """overlap_k, angle_mean_k and both variance shares, one per draw: (n_draws,) float64 each."""
    d, k = S.E_unit.shape[1], S.k
    chunk = max(1, _CHUNK_ELEMENTS // (d * k))
    out: dict[str, list[Tensor]] = {"overlap_k": [], "angle": [], "E_in_P": [], "P_in_E": []}
    for index, start in enumerate(range(0, n_draws, chunk)):
        n = min(chunk, n_draws - start)
        W = haar_frames(_gaussian((n, d, k), seed, _P_FRAMES_IN_E, index))  # Q V_Pk in E's principal basis
        M = W[:, :k]  # (n, k, k) = U_E^T Q V_Pk
        cos = torch.zeros(n, k, dtype=torch.float64)  # descending: smallest angle first
        sin = torch.zeros(n, k, dtype=torch.float64)  # ascending; U_E's complement has d - k dims: >= 2k - d sines are 0
        cos[:] = torch.linalg.svdvals(M).clamp(0.0, 1.0)
        if d > k:
            sin[:, max(0, 2 * k - d) :] = torch.linalg.svdvals(W[:, k:]).clamp(0.0, 1.0).flip(-1)
        angle = torch.where(cos**2 >= 0.5, torch.arcsin(sin), torch.arccos(cos))  # as principal_angles_deg
        out["overlap_k"].append((M**2).sum(dim=(-2, -1)) / k)
        out["angle"].append(torch.rad2deg(angle).mean(dim=-1))
        out["E_in_P"].append((W[:, : len(S.var_E)] ** 2).sum(dim=-1) @ S.var_E / S.var_E.sum())
        W = haar_frames(_gaussian((n, d, k), seed, _E_FRAMES_IN_P, index))  # Q^T U_E in P's principal basis
        out["P_in_E"].append((W[:, : len(S.var_P)] ** 2).sum(dim=-1) @ S.var_P / S.var_P.sum())
    return {name: torch.cat(parts) for name, parts in out.items()}


def _wishart_factors(rng: np.random.Generator, n: int, m: int, df: int) -> Tensor:
    """n upper-triangular F (m, m) with F^T F ~ Wishart_m(df, I), the law of G^T G for a df x m Gaussian G.

    Bartlett's decomposition (df >= m): F = T^T, T lower triangular with T_ii^2 ~ chi^2(df - i)
    (i = 0..m-1) and T_ij ~ N(0, 1) below the diagonal, all independent: m^2 numbers, not df m.
    """
    if df < m:
        raise ValueError(f"Bartlett's decomposition needs df={df} >= m={m}")
    T = np.tril(rng.standard_normal((n, m, m)), k=-1)
    T[:, np.arange(m), np.arange(m)] = np.sqrt(rng.chisquare(df - np.arange(m), size=(n, m)))
    return torch.from_numpy(T).mT


@_on_one_thread
def subspace_overlap_draws(d: int, dim_fixed: int, dim_random: int, n_draws: int, seed: int = 0) -> Tensor:
    """||U^T V||_F^2 = tr(Pi_U Pi_V) for a fixed dim_fixed-dim U and n uniformly random dim_random-dim V in d dims.

    (n_draws,) float64, in [0, min(dims)], mean dim_fixed dim_random / d. Exact in distribution
    without an orthonormal frame: for a d x m Gaussian G spanning V, Pi_V = G (G^T G)^-1 G^T, so
    with U = the first M axes, tr = tr((A + B)^-1 A), A = G_U^T G_U (G's M rows on U's axes) and
    B = the same for the other d - M rows: independent Wishart_m matrices with M and d - M degrees
    of freedom, drawn as m x m Bartlett factors (_wishart_factors). Complements,
    tr(Pi_a Pi_b) = b - tr(Pi_(d-a) Pi_b) = a - tr(Pi_a Pi_(d-b)), and the symmetry of the pair
    make m the smallest of a, b, d - a, d - b (so m <= d / 2, m <= M, m <= d - M: A + B is well
    conditioned). Cost O(m^3) per draw, whatever d.
    """
    a, b = dim_fixed, dim_random
    if not (0 <= a <= d and 0 <= b <= d):
        raise ValueError(f"subspace dims {a}, {b} must be in [0, d={d}]")
    forms = [(a, b, 0, 1), (d - a, b, b, -1), (a, d - b, a, -1)]  # (dims, offset, sign): offset + sign tr(dims)
    p, q, offset, sign = min(forms, key=lambda form: min(form[0], form[1]))
    m, on_axes = min(p, q), max(p, q)  # a random m-dim span against the first on_axes axes
    if m == 0:
        return torch.full((n_draws,), float(offset), dtype=torch.float64)
    chunk = max(1, _CHUNK_ELEMENTS // (m * m))
    traces = []
    for index, start in enumerate(range(0, n_draws, chunk)):
        rng, n = np.random.default_rng([seed, _OVERLAP_SPANS, index]), min(chunk, n_draws - start)
        F_A, F_B = _wishart_factors(rng, n, m, on_axes), _wishart_factors(rng, n, m, d - on_axes)
        L = torch.linalg.cholesky(F_A.mT @ F_A + F_B.mT @ F_B)
        traces.append((torch.linalg.solve_triangular(L, F_A.mT, upper=False) ** 2).sum(dim=(-2, -1)))
    return offset + sign * torch.cat(traces)


def _null_draws(S: _Spectra, n_draws: int, seed: int) -> dict[str, Tensor]:
    """Every figure under n_draws Haar rotations of P: short key (as _figure_names) -> (n_draws,) float64."""
    d = S.E_unit.shape[1]
    draws = {"abs_cos": _abs_cos_draws(S.E_unit, S.P_unit, n_draws, seed)}  # on the caller's threads
    draws |= _frame_figure_draws(S, n_draws, seed)
    draws["overlap_var"] = subspace_overlap_draws(d, S.k_E, S.k_P, n_draws, seed) / min(S.k_E, S.k_P)
    return draws


@_on_one_thread
def _exact_null_means(S: _Spectra) -> dict[str, float]:
    """The null's expectations known in closed form (short keys as _figure_names)."""
    d = S.E_unit.shape[1]
    nonzero = (S.E_unit.norm(dim=1) > 0).sum().item() * (S.P_unit.norm(dim=1) > 0).sum().item()
    means = {"overlap_k": S.k / d, "overlap_var": max(S.k_E, S.k_P) / d, "P_in_E": S.k / d, "E_in_P": S.k / d}
    if d >= 2:  # a zero row's cosines are 0; every other pair's E|cos| is the isotropic one
        means["abs_cos"] = chance_abs_cos(d) * nonzero / (S.E_unit.shape[0] * S.P_unit.shape[0])
    return means


# ----------------------------------------------------------------------------- the null


def rotation_null(
    E: Tensor,
    P: Tensor,
    n_draws: int = DEFAULT_DRAWS,
    seed: int = 0,
    fixed_k: int = 8,
    var_threshold: float = 0.9,
    alternative: str = "two-sided",
) -> dict[str, float]:
    """Each input-level figure with its spectra-keeping null: mean, std, z and empirical p.

    E (n_words, d), P (n_positions, d) as trained (any scale: every figure is scale-free).
    Figures (names as in the geometry report, plus the variance-weighted overlaps):
      abs_cos_mean                mean |cos| over word x position pairs, [0, 1]
      overlap_k{k}                top-k subspace overlap, [0, 1]
      angle_mean_k{k}_deg         mean principal angle between the top-k subspaces, [0, 90]
      overlap_var{90}             overlap at the dimension counts holding var_threshold, [0, 1]
      var_share_P_in_E_k{k}       share of P's variance inside E's top-k subspace, [0, 1]
      var_share_E_in_P_k{k}       share of E's variance inside P's top-k subspace, [0, 1]
    each as X, X_null_mean, X_null_std, X_z, X_p (see null_summary), over n_draws Haar
    rotations of P (seeded, the same at every call with the same seed and shapes); the null
    mean is exact for every figure but the angle (module docstring). Observed values are
    float64, by the geometry report's formulas.
    """
    if n_draws < 2:
        raise ValueError(f"n_draws={n_draws} must be >= 2")
    S = _spectra(E, P, fixed_k, var_threshold)
    names = _figure_names(fixed_k, f"var{round(100 * var_threshold)}")
    observed = _observed(S, names)
    draws, means = _null_draws(S, n_draws, seed), _exact_null_means(S)
    report: dict[str, float] = {}
    for key, name in names.items():
        report |= null_summary(name, observed[name], draws[key].numpy(), alternative, null_mean=means.get(key))
    d = S.E_unit.shape[1]
    # exact whatever the spectra: for a uniformly random k-dim subspace U, E[U U^T] = (k/d) I
    report[f"var_share_P_in_E_k{fixed_k}_chance"] = S.k / d
    report[f"var_share_E_in_P_k{fixed_k}_chance"] = S.k / d
    return report
