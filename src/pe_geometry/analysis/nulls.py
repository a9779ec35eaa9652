"""Spectra-keeping null distributions for the input-level word/position figures.

The analytic chance of a figure (isotropic random vectors or subspaces) ignores the
matrices' own spectra: a position table whose variance sits in 2-3 directions, or a
word matrix with a dominant mean row, moves the figure away from isotropic chance
without any alignment between the two. The fair null keeps E and P exactly as trained
and randomises only their relative orientation: P's rows are rotated by Haar-random
orthogonal matrices Q (p -> Q p, fixed seed), and every figure is recomputed.

Conventions as in the geometry measures: E (n_words, d) word rows, P (n_positions, d)
position rows, U / V (d, k) orthonormal bases. Work is in float64.

Why the rotations are cheap: everything about P that the figures use lives in P's row
space, spanned by an orthonormal B (d, r), r = rank(P) <= min(n_positions, d). Writing
P = A B^T, the rotated table is Q P^T = (Q B) A^T, and Q B for a Haar Q is a uniformly
random orthonormal r-frame W (d, r). So a draw needs only W (a QR of a d x r Gaussian),
and the spectra (SVDs of E and of P) are computed once: rotation leaves them unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis.geometry import _n_directions

# The number of Haar draws used when the caller does not say. The null's mean and std
# settle quickly (the std's relative Monte-Carlo error is ~1/sqrt(2 n): 7 % at 100 draws)
# while an empirical p-value cannot go below 1/(n+1) (2/(n+1) two-sided) and has relative
# error sqrt((1 - p) / (n p)): ~20 % at p = 0.05 with 500 draws, ~10 % with 2000. Measured
# on a learned-PE checkpoint (mean |cos|, true p ~ 0.03): five seeds of 100 draws gave
# p 0.02-0.12 but z 1.65-2.44; 2000 draws gave p 0.030, z 2.17. So a record during
# training logs 100 draws (read its z; its p is coarse) and verdicts use REPORT_DRAWS.
# Cost (1000 words, 128 positions, d 128, one core): ~0.2 s per 100 draws.
DEFAULT_DRAWS = 100
REPORT_DRAWS = 2000
ALTERNATIVES = ("two-sided", "less", "greater")


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


def null_summary(name: str, observed: float, null: Tensor | np.ndarray, alternative: str = "two-sided") -> dict[str, float]:
    """``{name, name_null_mean, name_null_std, name_z, name_p}`` for one figure.

    z = (observed - null mean) / null std (sample std, ddof 1): how many null spreads the
    figure sits from what random orientation gives; +-inf when the null has no spread.
    """
    values = np.asarray(null, dtype=np.float64).reshape(-1)
    mean, std = float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else 0.0
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


_CHUNK = 64  # draws generated (and cached) together: bounds memory at REPORT_DRAWS


@functools.lru_cache(maxsize=4)
def _frame_chunk(d: int, r: int, seed: int, index: int) -> Tensor:
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))
    frames = []
    # One QR per draw: torch's batched CPU QR is up to 100x slower with 2+ threads on a busy machine.
    for G in torch.randn(_CHUNK, d, r, generator=g, dtype=torch.float64):
        Q, R = torch.linalg.qr(G)
        frames.append(Q * torch.sign(torch.diagonal(R)))
    return torch.stack(frames)


def random_frame_chunks(d: int, r: int, n_draws: int, seed: int = 0) -> Iterator[Tensor]:
    """n_draws uniformly random orthonormal r-frames in d dims, in chunks (<= 64, d, r) float64.

    W = Q B for a Haar-random Q in O(d) and any fixed orthonormal B (d, r). Drawn as the
    QR factor of a d x r standard Gaussian with the signs fixed so that diag(R) > 0
    (without the fix the distribution is not uniform: Mezzadri 2007). Chunk i comes from
    its own generator seeded by (seed, i), so fewer draws are a prefix of more draws, and
    the same seed gives the same draws at every record (recent chunks are cached): the
    null of one run is one fixed set of rotations, records differ only by the matrices.
    """
    if not 1 <= r <= d:
        raise ValueError(f"frame size r={r} must be in [1, d={d}]")
    for index in range(math.ceil(n_draws / _CHUNK)):
        yield _frame_chunk(d, r, seed, index)[: n_draws - index * _CHUNK]


# ----------------------------------------------------------------------------- spectra


def _f64(x: Tensor) -> Tensor:
    return torch.as_tensor(x).detach().to(torch.float64)


def _centred_svd(X: Tensor) -> tuple[Tensor, Tensor]:
    """Singular values (descending) and principal directions as columns (d, r) of the centred X."""
    X = _f64(X)
    _, s, Vh = torch.linalg.svd(X - X.mean(dim=0, keepdim=True), full_matrices=False)
    return s, Vh.T


# ----------------------------------------------------------------------------- the null


@dataclass(frozen=True)
class _Spectra:
    """What the figures need from E and P, computed once per record (rotation keeps it)."""

    E_unit: Tensor  # (n_words, d) unit word rows
    A_unit: Tensor  # (n_positions, r) unit position rows in P's row-space basis B
    V_E: Tensor  # (d, r_E) E's principal directions (centred), descending variance
    VE_sE: Tensor  # (d, r_E) V_E scaled by E's singular values: E's variance by direction
    C_P: Tensor  # (r, r_P) P's principal directions (centred) in the basis B
    C_sP: Tensor  # (r, r_P) C_P scaled by P's singular values
    B: Tensor  # (d, r) orthonormal basis of P's row space
    k: int  # fixed k (clipped), as in the geometry report
    k_E: int  # directions holding var_threshold of E's variance
    k_P: int  # same for P


def _row_space(P: Tensor) -> Tensor:
    """Orthonormal basis (d, r) of the row space of P (numerical rank r, numpy's tolerance)."""
    _, s, Vh = torch.linalg.svd(P, full_matrices=False)
    r = int((s > s[0] * max(P.shape) * torch.finfo(torch.float64).eps).sum())
    return Vh[:r].T


def _spectra(E: Tensor, P: Tensor, fixed_k: int, var_threshold: float) -> _Spectra:
    E, P = _f64(E), _f64(P)
    B = _row_space(P)  # P's rows, centred or not, live in span(B)
    (s_E, V_E), (s_P, V_P) = _centred_svd(E), _centred_svd(P)
    k_E, k_P = _n_directions(s_E, E.shape[0], None, var_threshold), _n_directions(s_P, P.shape[0], None, var_threshold)
    k = min(_n_directions(s_E, E.shape[0], fixed_k, var_threshold), _n_directions(s_P, P.shape[0], fixed_k, var_threshold))
    unit = lambda X: X / X.norm(dim=-1, keepdim=True).clamp_min(1e-300)  # noqa: E731
    C_P = B.T @ V_P
    return _Spectra(unit(E), unit(P) @ B, V_E, V_E * s_E, C_P, C_P * s_P, B, k, k_E, k_P)


def _batched_principal_angles_deg(U: Tensor, V: Tensor) -> Tensor:
    """principal_angles_deg for a batch: U (d, k) fixed, V (n, d, k); returns (n, k) ascending.

    Same formula as the single version (cosines from svd(U^T V), sines from svd(V - U U^T V),
    the sine used below 45 degrees where arccos loses accuracy).
    """
    M = U.T @ V  # (n, k, k)
    cos = torch.linalg.svdvals(M).clamp(0.0, 1.0)
    sin = torch.linalg.svdvals(V - U @ M).clamp(0.0, 1.0).flip(-1)
    return torch.rad2deg(torch.where(cos**2 >= 0.5, torch.arcsin(sin), torch.arccos(cos)))


def _cosine_null(S: _Spectra, W: Tensor) -> Tensor:
    """mean |cos| between word rows and rotated position rows, per draw: (n,).

    The one product that grows with the word count (n x n_words x d x n_positions): ~80 %
    of the null's cost. float32 would save only ~15 % on CPU here, so it stays float64.
    """
    return (S.E_unit @ (W @ S.A_unit.T)).abs().mean(dim=(-2, -1))


def _figures(S: _Spectra, W: Tensor, fixed_k: int, thr: str) -> dict[str, Tensor]:
    """Every figure for the rotations whose action on P's row space is W (n, d, r): name -> (n,)."""
    U_E, U_E90 = S.V_E[:, : S.k], S.V_E[:, : S.k_E]
    V_P = W @ S.C_P  # (n, d, r_P): rotated principal directions of P
    V_Pk, V_P90 = V_P[..., : S.k], V_P[..., : S.k_P]
    total_P, total_E = (S.C_sP**2).sum(), (S.VE_sE**2).sum()
    return {
        "abs_cos_mean": _cosine_null(S, W),
        f"overlap_k{fixed_k}": ((U_E.T @ V_Pk) ** 2).sum(dim=(-2, -1)) / S.k,
        f"angle_mean_k{fixed_k}_deg": _batched_principal_angles_deg(U_E, V_Pk).mean(dim=-1),
        f"overlap_{thr}": ((U_E90.T @ V_P90) ** 2).sum(dim=(-2, -1)) / min(S.k_E, S.k_P),
        f"var_share_P_in_E_k{fixed_k}": ((U_E.T @ (W @ S.C_sP)) ** 2).sum(dim=(-2, -1)) / total_P,
        f"var_share_E_in_P_k{fixed_k}": ((V_Pk.transpose(-2, -1) @ S.VE_sE) ** 2).sum(dim=(-2, -1)) / total_E,
    }


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
    rotations of P (seeded, the same at every call with the same seed and shapes).
    Observed values are the identity rotation, computed by the same code.
    """
    if n_draws < 2:
        raise ValueError(f"n_draws={n_draws} must be >= 2")
    S = _spectra(E, P, fixed_k, var_threshold)
    thr = f"var{round(100 * var_threshold)}"
    observed = {name: v.item() for name, v in _figures(S, S.B.unsqueeze(0), fixed_k, thr).items()}
    chunks = [_figures(S, W, fixed_k, thr) for W in random_frame_chunks(E.shape[1], S.B.shape[1], n_draws, seed)]
    report: dict[str, float] = {}
    for name, value in observed.items():
        report |= null_summary(name, value, torch.cat([chunk[name] for chunk in chunks]).numpy(), alternative)
    d = E.shape[1]
    # exact whatever the spectra: for a uniformly random k-dim subspace U, E[U U^T] = (k/d) I
    report[f"var_share_P_in_E_k{fixed_k}_chance"] = S.k / d
    report[f"var_share_E_in_P_k{fixed_k}_chance"] = S.k / d
    return report
