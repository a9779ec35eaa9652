"""Speed of the geometry null (analysis.nulls.rotation_null) against the full-frame null it replaced, in one process.

    python experiments/benchmark_geometry.py            # d 128/256/512/768 at 128/256/512/1024 positions, 3 rounds
    python experiments/benchmark_geometry.py --quick    # d 128 and 256 only, one round (a smoke test)

Baseline: the previous ``rotation_null``, copied below unchanged but for its names: every draw
builds a d x r orthonormal frame (QR of a d x r Gaussian, r = rank P) and a float64 table of
n_words x n_positions cosines. Its frame cache is cleared before each timing (a first record).
Both run on the same matrices: E = 1000 word-like rows (Gaussian, variance decaying over the
dimensions, plus a shared mean row), P = the sinusoidal table of ``n_positions`` rows, with
100 draws, 2 threads (``--threads``), old and new interleaved in each round so that a slow
spell of a shared machine hits both; the table shows the median time of each and the median
of the per-round ratios. The baseline is also timed on one thread: on a busy machine its
multi-threaded QRs and small products mostly wait for the second thread (the new null runs
those on one thread by itself), so that column separates the algorithm's gain from the
threads'.

It also checks, at sizes the tests cannot reach, that the two nulls agree: for each figure,
(new - old) of the null mean and of the null std in units of their Monte-Carlo standard
error (std of a mean: s / sqrt(n); of a std: s / sqrt(2 (n - 1)), Gaussian draws). The new
null's mean is exact for every figure but the angle, so there only the old one's error counts.
With 100 draws a |z| near 2 turns up by chance, more often for the std of abs_cos_mean, whose
null is right-skewed (skewness ~2 with a sinusoidal P) so that its std's true error is larger
than the Gaussian formula says; tests/test_nulls.py checks agreement with thousands of draws.

The floor: an exact draw of abs_cos_mean needs its whole table, n_words x n_positions x d
multiply-adds; the "tables alone" column is that work for all draws at the float32 matmul rate
measured in the same round (a product of the tables' shape), i.e. the time no exact null can beat.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import time
from dataclasses import dataclass
from statistics import median

import numpy as np
import torch
from torch import Tensor

from pe_geometry.analysis.measures.geometry import _n_directions
from pe_geometry.analysis.measures.nulls import null_summary, rotation_null
from pe_geometry.model.positional import sinusoidal_table

SIZES = [(128, 128), (256, 256), (512, 512), (768, 1024)]  # (d, n_positions)
N_WORDS = 1000


# ----------------------------------------------------------------------------- the baseline: the full-frame null
_CHUNK = 64


@functools.lru_cache(maxsize=4)
def _frame_chunk(d: int, r: int, seed: int, index: int) -> Tensor:
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))
    frames = []
    for G in torch.randn(_CHUNK, d, r, generator=g, dtype=torch.float64):
        Q, R = torch.linalg.qr(G)
        frames.append(Q * torch.sign(torch.diagonal(R)))
    return torch.stack(frames)


def _random_frame_chunks(d: int, r: int, n_draws: int, seed: int = 0):
    for index in range(math.ceil(n_draws / _CHUNK)):
        yield _frame_chunk(d, r, seed, index)[: n_draws - index * _CHUNK]


def _f64(x: Tensor) -> Tensor:
    return torch.as_tensor(x).detach().to(torch.float64)


def _centred_svd(X: Tensor) -> tuple[Tensor, Tensor]:
    X = _f64(X)
    _, s, Vh = torch.linalg.svd(X - X.mean(dim=0, keepdim=True), full_matrices=False)
    return s, Vh.T


@dataclass(frozen=True)
class _Spectra:
    E_unit: Tensor
    A_unit: Tensor
    V_E: Tensor
    VE_sE: Tensor
    C_P: Tensor
    C_sP: Tensor
    B: Tensor
    k: int
    k_E: int
    k_P: int


def _row_space(P: Tensor) -> Tensor:
    _, s, Vh = torch.linalg.svd(P, full_matrices=False)
    r = int((s > s[0] * max(P.shape) * torch.finfo(torch.float64).eps).sum())
    return Vh[:r].T


def _spectra(E: Tensor, P: Tensor, fixed_k: int, var_threshold: float) -> _Spectra:
    E, P = _f64(E), _f64(P)
    B = _row_space(P)
    (s_E, V_E), (s_P, V_P) = _centred_svd(E), _centred_svd(P)
    k_E, k_P = _n_directions(s_E, E.shape[0], None, var_threshold), _n_directions(s_P, P.shape[0], None, var_threshold)
    k = min(_n_directions(s_E, E.shape[0], fixed_k, var_threshold), _n_directions(s_P, P.shape[0], fixed_k, var_threshold))
    unit = lambda X: X / X.norm(dim=-1, keepdim=True).clamp_min(1e-300)  # noqa: E731
    C_P = B.T @ V_P
    return _Spectra(unit(E), unit(P) @ B, V_E, V_E * s_E, C_P, C_P * s_P, B, k, k_E, k_P)


def _batched_principal_angles_deg(U: Tensor, V: Tensor) -> Tensor:
    M = U.T @ V
    cos = torch.linalg.svdvals(M).clamp(0.0, 1.0)
    sin = torch.linalg.svdvals(V - U @ M).clamp(0.0, 1.0).flip(-1)
    return torch.rad2deg(torch.where(cos**2 >= 0.5, torch.arcsin(sin), torch.arccos(cos)))


def _figures(S: _Spectra, W: Tensor, fixed_k: int, thr: str) -> dict[str, Tensor]:
    U_E, U_E90 = S.V_E[:, : S.k], S.V_E[:, : S.k_E]
    V_P = W @ S.C_P
    V_Pk, V_P90 = V_P[..., : S.k], V_P[..., : S.k_P]
    total_P, total_E = (S.C_sP**2).sum(), (S.VE_sE**2).sum()
    return {
        "abs_cos_mean": (S.E_unit @ (W @ S.A_unit.T)).abs().mean(dim=(-2, -1)),
        f"overlap_k{fixed_k}": ((U_E.T @ V_Pk) ** 2).sum(dim=(-2, -1)) / S.k,
        f"angle_mean_k{fixed_k}_deg": _batched_principal_angles_deg(U_E, V_Pk).mean(dim=-1),
        f"overlap_{thr}": ((U_E90.T @ V_P90) ** 2).sum(dim=(-2, -1)) / min(S.k_E, S.k_P),
        f"var_share_P_in_E_k{fixed_k}": ((U_E.T @ (W @ S.C_sP)) ** 2).sum(dim=(-2, -1)) / total_P,
        f"var_share_E_in_P_k{fixed_k}": ((V_Pk.transpose(-2, -1) @ S.VE_sE) ** 2).sum(dim=(-2, -1)) / total_E,
    }


def full_frame_null(
    E: Tensor, P: Tensor, n_draws: int = 100, seed: int = 0, fixed_k: int = 8, var_threshold: float = 0.9
) -> dict[str, float]:
    """The previous rotation_null (figures only; its chance keys need no draws)."""
    S = _spectra(E, P, fixed_k, var_threshold)
    thr = f"var{round(100 * var_threshold)}"
    observed = {name: v.item() for name, v in _figures(S, S.B.unsqueeze(0), fixed_k, thr).items()}
    chunks = [_figures(S, W, fixed_k, thr) for W in _random_frame_chunks(E.shape[1], S.B.shape[1], n_draws, seed)]
    report: dict[str, float] = {}
    for name, value in observed.items():
        report |= null_summary(name, value, torch.cat([chunk[name] for chunk in chunks]).numpy())
    return report


# ----------------------------------------------------------------------------- the measurements
def matrices(d: int, n_positions: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Word-like E (N_WORDS, d): Gaussian, std decaying 1 -> 0.1 over the dimensions, plus a mean row; P: sinusoidal."""
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(N_WORDS, d, generator=g) * torch.logspace(0, -1, d) + 0.3 * torch.randn(d, generator=g)
    return E, sinusoidal_table(n_positions, d)


def fp32_matmul_rate(d: int, repeats: int = 3) -> float:
    """FLOP/s of a float32 product shaped like the null's tables: (8 x 1024, d) @ (d, N_WORDS), best of repeats."""
    a, b = torch.randn(8 * 1024, d), torch.randn(d, N_WORDS)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * a.shape[0] * d * N_WORDS / best


def timed(fn, *args, **kwargs) -> tuple[float, dict[str, float]]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def agreement(old: dict[str, float], new: dict[str, float], n: int) -> list[str]:
    """Per figure: (new - old) null mean and null std in units of their Monte-Carlo standard error."""
    lines = []
    for key in old:
        if not key.endswith("_null_mean"):
            continue
        name = key.removesuffix("_null_mean")
        s_old, s_new = old[f"{name}_null_std"], new[f"{name}_null_std"]
        exact_mean = not name.startswith("angle_mean")  # the new null's mean is exact for the others
        se_mean = math.sqrt(s_old**2 / n + (0.0 if exact_mean else s_new**2 / n))
        se_std = math.sqrt((s_old**2 + s_new**2) / (2 * (n - 1)))
        z_mean = (new[key] - old[key]) / se_mean if se_mean > 0 else 0.0
        z_std = (s_new - s_old) / se_std if se_std > 0 else 0.0
        lines.append(f"|   {name} | {old[key]:.5g} | {new[key]:.5g} | {z_mean:+.1f} | {s_old:.3g} | {s_new:.3g} | {z_std:+.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3, help="old/new measurements per size, interleaved; medians shown")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="d 128 and 256 only, one round")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes, rounds = (SIZES[:2], 1) if args.quick else (SIZES, args.rounds)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {N_WORDS} words, {args.draws} draws, median of {rounds} round(s)"
    )
    E, P = matrices(64, 64)
    full_frame_null(E, P, n_draws=8)  # warm-up: first-call costs of the kernels
    rotation_null(E, P, n_draws=8)

    rows, checks = [], []
    for d, n_positions in sizes:
        E, P = matrices(d, n_positions)
        old_s, old1_s, new_s, floor_s = [], [], [], []
        for _ in range(rounds):
            floor_s.append(2 * args.draws * N_WORDS * n_positions * d / fp32_matmul_rate(d))
            _frame_chunk.cache_clear()
            t_old, old = timed(full_frame_null, E, P, n_draws=args.draws)
            _frame_chunk.cache_clear()
            torch.set_num_threads(1)
            t_old1, _ = timed(full_frame_null, E, P, n_draws=args.draws)
            torch.set_num_threads(args.threads)
            t_new, new = timed(rotation_null, E, P, n_draws=args.draws)
            old_s.append(t_old)
            old1_s.append(t_old1)
            new_s.append(t_new)
        ratios = [o / n for o, n in zip(old_s, new_s)]
        ratios1 = [o / n for o, n in zip(old1_s, new_s)]
        rows.append(
            f"| {d} | {n_positions} | {median(old_s):.2f} | {median(old1_s):.2f} | {median(new_s):.3f} | {median(floor_s):.2f} | "
            f"{median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f}) | "
            f"{median(ratios1):.1f}x ({min(ratios1):.1f}-{max(ratios1):.1f}) |"
        )
        checks.append(f"| d {d}, {n_positions} positions | | | | | | |")
        checks += agreement(old, new, args.draws)
        print(f"d {d}: old {median(old_s):.2f} s ({median(old1_s):.2f} s on 1 thread), new {median(new_s):.3f} s", flush=True)

    print(
        f"\n| d | positions | full-frame null, {args.threads} threads (s) | full-frame null, 1 thread (s) | "
        f"rotation_null, {args.threads} threads (s) | tables alone (s) | speed-up | speed-up vs 1 thread |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\nagreement, last round ({args.draws} draws each; z = difference / Monte-Carlo standard error):")
    print("| figure | null mean, old | null mean, new | z | null std, old | null std, new | z |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(checks))


if __name__ == "__main__":
    main()
