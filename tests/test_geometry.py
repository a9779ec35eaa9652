"""Geometry measures: known answers, agreement with scipy / torch, and chance levels."""

import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F

from pe_geometry.analysis.measures import geometry as geo


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_basis(d: int, k: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(d, k, generator=gen(seed), dtype=torch.float64))[0]


# ----------------------------------------------------------------------------- subspaces


def test_orthogonal_subspaces_overlap_0_angles_90():
    eye = torch.eye(10, dtype=torch.float64)
    U, V = eye[:, :3], eye[:, 3:7]
    assert geo.subspace_overlap(U, V) == 0.0
    assert torch.allclose(geo.principal_angles_deg(U, V), torch.full((3,), 90.0, dtype=torch.float64))


def test_identical_and_nested_subspaces_overlap_1_angles_0():
    U = random_basis(12, 4, seed=1)
    assert geo.subspace_overlap(U, U) == pytest.approx(1.0, abs=1e-12)
    assert geo.principal_angles_deg(U, U).abs().max() < 1e-6
    rotated = U @ random_basis(4, 4, seed=2)  # same span, different basis
    assert geo.subspace_overlap(U, rotated) == pytest.approx(1.0, abs=1e-12)
    wider = torch.linalg.qr(torch.cat([U, torch.randn(12, 3, generator=gen(3), dtype=torch.float64)], 1))[0]
    assert geo.subspace_overlap(U, wider) == pytest.approx(1.0, abs=1e-12)  # normalised by the smaller k


@pytest.mark.parametrize("kU,kV", [(5, 3), (3, 5), (4, 4)])
def test_principal_angles_match_scipy(kU, kV):
    U, V = random_basis(20, kU, seed=kU), random_basis(20, kV, seed=10 + kV)
    ours = geo.principal_angles_deg(U, V).numpy()
    ref = np.sort(np.rad2deg(scipy.linalg.subspace_angles(U.numpy(), V.numpy())))
    np.testing.assert_allclose(ours, ref, atol=1e-9)


def test_principal_angles_accurate_for_tiny_angles():
    # arccos alone loses ~1e-8 rad near 0; the sine branch keeps relative accuracy.
    U = random_basis(20, 3, seed=4)
    V = torch.linalg.qr(U + 1e-7 * torch.randn(20, 3, generator=gen(5), dtype=torch.float64))[0]
    ours = geo.principal_angles_deg(U, V).numpy()
    ref = np.sort(np.rad2deg(scipy.linalg.subspace_angles(U.numpy(), V.numpy())))
    assert ref.max() < 1e-4
    np.testing.assert_allclose(ours, ref, rtol=1e-6)


def test_subspace_overlap_chance_matches_random_subspaces():
    d, kU, kV, n = 40, 3, 10, 400
    draws = torch.tensor([geo.subspace_overlap(random_basis(d, kU, 2 * i), random_basis(d, kV, 2 * i + 1)) for i in range(n)])
    se = draws.std().item() / math.sqrt(n)
    assert abs(draws.mean().item() - geo.subspace_overlap_chance(kU, kV, d)) < 5 * se
    assert geo.subspace_overlap_chance(kU, kV, d) == 10 / 40


def test_gaussian_principal_subspaces_overlap_at_chance():
    # Top directions of an iid Gaussian matrix span a uniformly random subspace.
    d, n_seeds = 32, 60
    draws = torch.tensor([
        geo.subspace_overlap(
            geo.top_principal_directions(torch.randn(200, d, generator=gen(2 * s)), k=4),
            geo.top_principal_directions(torch.randn(100, d, generator=gen(2 * s + 1)), k=6),
        )
        for s in range(n_seeds)
    ])
    se = draws.std().item() / math.sqrt(n_seeds)
    assert abs(draws.mean().item() - geo.subspace_overlap_chance(4, 6, d)) < 5 * se


def test_top_principal_directions_threshold_and_cap():
    scales = torch.tensor([10.0, 5.0, 1.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    X = torch.randn(5000, 6, generator=gen(6), dtype=torch.float64) * scales
    U = geo.top_principal_directions(X, var_threshold=0.95)  # 100/126.03=0.79, 125/126.03=0.992
    assert U.shape == (6, 2)
    assert torch.allclose(U.T @ U, torch.eye(2, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(U.abs(), torch.eye(6, dtype=torch.float64)[:, :2], atol=0.05)  # the two big axes
    few_rows = torch.randn(3, 10, generator=gen(7))
    assert geo.top_principal_directions(few_rows, var_threshold=1.0).shape[1] <= 2  # rank of centred 3 rows
    assert geo.top_principal_directions(few_rows, k=8).shape[1] == 2


def test_effective_rank_known_cases():
    d = 10
    eye = torch.eye(d)
    assert geo.effective_rank(eye, centre=False) == pytest.approx(d)
    assert geo.effective_rank(eye) == pytest.approx(d - 1)  # centring removes one direction
    U, V = random_basis(50, 3, seed=8), random_basis(20, 3, seed=9)
    assert geo.effective_rank(U @ V.T, centre=False) == pytest.approx(3.0)  # flat spectrum, rank 3
    low_rank = torch.randn(50, 3, generator=gen(10)) @ torch.randn(3, 20, generator=gen(11))
    assert 1.0 <= geo.effective_rank(low_rank) <= 3.0 + 1e-6
    one_direction = torch.randn(100, 1, generator=gen(12)).double() @ torch.randn(1, 20, generator=gen(13)).double()
    assert geo.effective_rank(one_direction) == pytest.approx(1.0)
    assert geo.effective_rank(torch.randn(4000, 20, generator=gen(14))) > 19.0


# ----------------------------------------------------------------------------- pairwise + chance


def test_chance_abs_cos_exact_small_d():
    assert geo.chance_abs_cos(2) == pytest.approx(2 / math.pi)  # E|cos(theta)|, theta uniform
    assert geo.chance_abs_cos(3) == pytest.approx(0.5)  # cos uniform on [-1, 1] in 3-D


@pytest.mark.parametrize("d", [8, 384])
def test_chance_abs_cos_matches_monte_carlo(d):
    n = 200_000 if d == 8 else 20_000
    a, b = torch.randn(2, n, d, generator=gen(d), dtype=torch.float64)
    abs_cos = F.cosine_similarity(a, b, dim=-1).abs()
    se = abs_cos.std().item() / math.sqrt(n)
    assert abs(abs_cos.mean().item() - geo.chance_abs_cos(d)) < 5 * se
    if d == 8:  # here the asymptotic sqrt(2/(pi d)) is 3% too low, far outside 5 SE (0.8%)
        assert abs(abs_cos.mean().item() - math.sqrt(2 / (math.pi * d))) > 5 * se


def test_chance_abs_cos_asymptotic():
    for d, claimed in [(128, 0.071), (384, 0.041), (768, 0.029)]:
        assert round(geo.chance_abs_cos(d), 3) == pytest.approx(claimed, abs=1e-3)
    for d in [64, 384, 10_000]:
        ratio = geo.chance_abs_cos(d) / math.sqrt(2 / (math.pi * d))
        assert 1 < ratio < 1 + 1 / d  # ratio = 1 + 1/(4d) + O(1/d^2)


def test_gaussian_table_lands_on_chance():
    # cos(e_i, p_j) are pairwise independent by rotation invariance, so the SE of the
    # mean over N pairs is std/sqrt(N): 0.031/sqrt(512000) = 4.3e-5 at d = 384.
    d = 384
    table = geo.random_baseline_table(1000, 512, d, seed=0)
    assert abs(table["abs_cos_mean"] - geo.chance_abs_cos(d)) < 2.5e-4
    assert abs(table["cos_mean"]) < 2.5e-4
    assert table["cos_std"] == pytest.approx(1 / math.sqrt(d), rel=0.01)
    assert table["angle_mean_deg"] == pytest.approx(90.0, abs=0.02)
    assert geo.random_baseline_table(1000, 512, d, seed=0) == table  # deterministic


def test_pairwise_table_known_angles():
    E = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    P = torch.tensor([[1.0, 1.0]])
    table = geo.pairwise_cosine_table(E, P)
    assert table["angle_mean_deg"] == pytest.approx(45.0)
    assert table["cos_mean"] == pytest.approx(1 / math.sqrt(2))
    assert geo.pairwise_cosine_table(E, -P)["angle_max_deg"] == pytest.approx(135.0)


def test_geometry_report_names_and_chance_companions():
    E, P = torch.randn(300, 64, generator=gen(15)), torch.randn(128, 64, generator=gen(16))
    report = geo.geometry_report(E, P, embed_scale=8.0)
    for name in ["abs_cos_mean", "abs_cos_mean_chance", "abs_cos_mean_random", "overlap_k8", "overlap_k8_chance",
                 "overlap_var90", "overlap_var90_chance", "angle_mean_k8_deg", "angle_mean_k8_deg_chance",
                 "erank_E", "erank_E_chance", "erank_P", "erank_P_chance", "norm_ratio_p_over_e"]:
        assert name in report
    for name in report:
        for suffix in ("_chance", "_random"):
            if name.endswith(suffix):
                assert name.removesuffix(suffix) in report
    assert all(isinstance(v, (int, float)) for v in report.values())
    assert report["norm_e_mean"] == pytest.approx(8.0 * E.norm(dim=1).mean().item(), rel=1e-6)
    assert report["overlap_k8"] == pytest.approx(report["overlap_k8_chance"], abs=0.15)  # both Gaussian


# ----------------------------------------------------------------------------- hidden states


def test_hidden_state_report_separates_position_from_noise():
    B, T, D, vocab = 100, 24, 32, 20
    tokens = torch.randint(vocab, (B, T), generator=gen(20))
    word = torch.zeros(vocab, D)
    word[:, :16] = torch.randn(vocab, 16, generator=gen(21))
    pos = torch.zeros(T, D)
    pos[:, 16:] = 2 * torch.randn(T, 16, generator=gen(22)).cumsum(0) / math.sqrt(T)  # smooth in position
    H = word[tokens] + pos + 0.1 * torch.randn(B, T, D, generator=gen(23))
    report = geo.hidden_state_report(H, tokens)
    # Disjoint coordinates: far below chance, and below the shuffled baseline, which is high here
    # because per-position means of shuffled rows are noise shaped like the (word-heavy) variance of H.
    assert report["overlap_pos_tok_k8"] < 0.2 * report["overlap_pos_tok_k8_chance"]
    assert report["overlap_pos_tok_k8"] < 0.2 * report["overlap_pos_tok_k8_shuffled"]
    assert report["position_var_share"] > 10 * report["position_var_share_chance"]
    noise = geo.hidden_state_report(torch.randn(B, T, D, generator=gen(24)), tokens)
    assert noise["position_var_share"] == pytest.approx(noise["position_var_share_chance"], rel=0.25)


def svd_hidden_report(H: torch.Tensor, tokens: torch.Tensor, k: int = 8, seed: int = 0) -> dict[str, float]:
    """The hidden-state report as it was before it was summed in chunks: (B, T, D) in float64, SVDs for the directions."""
    B, T, D = H.shape
    H = H.double()
    pos_means = H.mean(dim=0)  # (T, D)
    ids, counts = tokens.unique(return_counts=True)
    tok_means = torch.stack([H[tokens == i].mean(dim=0) for i in ids[counts >= 2]])  # tokens seen twice or more
    perm = torch.randperm(B * T, generator=gen(seed))
    shuffled = H.reshape(B * T, D)[perm].reshape(B, T, D).mean(dim=0)
    k = min(k, T - 1, len(tok_means) - 1, D)
    U_tok = geo.top_principal_directions(tok_means, k=k)
    grand = H.mean(dim=(0, 1))
    return {
        "overlap_pos_tok_k8": geo.subspace_overlap(geo.top_principal_directions(pos_means, k=k), U_tok),
        "overlap_pos_tok_k8_shuffled": geo.subspace_overlap(geo.top_principal_directions(shuffled, k=k), U_tok),
        "position_var_share": (B * ((pos_means - grand) ** 2).sum() / ((H - grand) ** 2).sum()).item(),
    }


@pytest.mark.parametrize("B, T, D", [(6, 40, 24), (9, 12, 48)])  # directions from the d x d and from the n x n Gram
def test_hidden_report_summed_in_chunks_equals_the_whole_batch_and_the_svd_report(B, T, D):
    """Chunks of any size in any order give the figures of the whole (B, T, D) batch, which match the SVD-based
    report; states far from the origin (a common mean 100x their spread) do not cost the sums their digits."""
    tokens = torch.randint(15, (B, T), generator=gen(30))
    H = 100.0 + torch.randn(B, T, D, generator=gen(31)) * torch.linspace(0.2, 2.0, D) + torch.randn(T, D, generator=gen(32))
    whole = geo.hidden_state_report(H, tokens)
    reference = svd_hidden_report(H, tokens)
    sums = geo.HiddenStateSums(tokens)
    for first, size in [(3, 2), (0, 1), (5, B - 5), (1, 2)]:
        sums.add(H[first : first + size], first)
    chunked = sums.report()
    for name, value in reference.items():
        assert whole[name] == pytest.approx(value, abs=1e-9), name
        assert chunked[name] == pytest.approx(value, abs=1e-9), name
    with pytest.raises(ValueError, match="rows added"):
        geo.HiddenStateSums(tokens).report()  # a chunk missing is an error, not a figure from fewer rows
