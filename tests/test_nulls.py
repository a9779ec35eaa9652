"""Spectra-keeping nulls: exact against a brute-force rotation, known means, known p-values."""

import numpy as np
import pytest
import scipy.linalg
import scipy.stats
import torch

from pe_geometry.analysis import geometry as geo
from pe_geometry.analysis import nulls

N_WORDS, N_POS, D = 30, 10, 12


def matrices(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """E with an uneven spectrum and a mean row; P low-variance in most directions (like a learned table)."""
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(N_WORDS, D, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(2.0, 0.2, D, dtype=torch.float64)) + 0.5
    P = torch.randn(N_POS, D, generator=g, dtype=torch.float64) @ torch.diag(torch.logspace(0, -2, D, dtype=torch.float64))
    return E, P


def numpy_figures(E: np.ndarray, P: np.ndarray, k: int, var_threshold: float = 0.9) -> dict[str, float]:
    """Independent reference: every figure from scratch with numpy / scipy."""

    def pcs(X):
        Xc = X - X.mean(0)
        _, s, Vt = np.linalg.svd(Xc, full_matrices=False)
        return s, Vt.T, Xc

    def n_dirs(s):
        frac = np.cumsum(s**2) / np.sum(s**2)
        return int(np.sum(frac < var_threshold)) + 1

    sE, VE, Ec = pcs(E)
    sP, VP, Pc = pcs(P)
    cos = (E / np.linalg.norm(E, axis=1, keepdims=True)) @ (P / np.linalg.norm(P, axis=1, keepdims=True)).T
    kE, kP = n_dirs(sE), n_dirs(sP)
    return {
        "abs_cos_mean": np.abs(cos).mean(),
        f"overlap_k{k}": np.sum((VE[:, :k].T @ VP[:, :k]) ** 2) / k,
        f"angle_mean_k{k}_deg": np.rad2deg(scipy.linalg.subspace_angles(VE[:, :k], VP[:, :k])).mean(),
        "overlap_var90": np.sum((VE[:, :kE].T @ VP[:, :kP]) ** 2) / min(kE, kP),
        f"var_share_P_in_E_k{k}": np.sum((Pc @ VE[:, :k]) ** 2) / np.sum(Pc**2),
        f"var_share_E_in_P_k{k}": np.sum((Ec @ VP[:, :k]) ** 2) / np.sum(Ec**2),
    }


def test_empirical_p_known_answers():
    null = np.array([1.0, 2.0, 3.0, 4.0])
    assert nulls.empirical_p(4.5, null, "greater") == pytest.approx(1 / 5)
    assert nulls.empirical_p(4.5, null, "less") == pytest.approx(1.0)
    assert nulls.empirical_p(4.5, null) == pytest.approx(2 / 5)
    assert nulls.empirical_p(2.0, null, "less") == pytest.approx(3 / 5)  # ties count against the effect
    assert nulls.empirical_p(2.0, null) == 1.0  # capped
    with pytest.raises(ValueError, match="alternative='both'; valid"):
        nulls.empirical_p(0.0, null, "both")


def test_observed_figures_match_the_geometry_report_and_numpy():
    E, P = matrices()
    report = nulls.rotation_null(E, P, n_draws=8, fixed_k=4)
    ref = numpy_figures(E.numpy(), P.numpy(), k=4)
    for name, value in ref.items():
        assert report[name] == pytest.approx(value, abs=1e-10), name
    subspace = geo.subspace_report(E, P, fixed_k=4)
    for name in ("overlap_k4", "angle_mean_k4_deg", "overlap_var90"):
        assert report[name] == pytest.approx(subspace[name], abs=1e-10), name
    assert report["abs_cos_mean"] == pytest.approx(geo.pairwise_cosine_table(E, P)["abs_cos_mean"], abs=1e-12)
    assert report["var_share_P_in_E_k4_chance"] == report["var_share_E_in_P_k4_chance"] == pytest.approx(4 / D)


def test_each_null_draw_equals_the_figures_of_a_brute_force_rotated_table():
    """The shortcut (only P's row space is rotated, spectra reused) against rotating the full P by a Haar Q from scipy."""
    E, P = matrices(1)
    spectra = nulls._spectra(E, P, fixed_k=4, var_threshold=0.9)
    Qs = scipy.stats.special_ortho_group.rvs(D, size=3, random_state=0)
    W = torch.from_numpy(Qs) @ spectra.B  # the frame each Q maps P's row space to
    fast = nulls._figures(spectra, W, fixed_k=4, thr="var90")
    for n, Q in enumerate(Qs):
        ref = numpy_figures(E.numpy(), P.numpy() @ Q.T, k=4)  # rows p -> Q p
        for name, value in ref.items():
            assert fast[name][n].item() == pytest.approx(value, abs=1e-10), (n, name)


def random_frames(d: int, r: int, n_draws: int, seed: int) -> torch.Tensor:
    return torch.cat(list(nulls.random_frame_chunks(d, r, n_draws, seed)))


def test_random_frames_are_orthonormal_uniform_and_prefix_stable():
    W = random_frames(D, 5, 400, seed=3)
    torch.testing.assert_close(W.transpose(-2, -1) @ W, torch.eye(5, dtype=torch.float64).expand(400, 5, 5))
    # uniform frames: E[W W^T] = (r / d) I (a sign-unfixed QR would bias the diagonal of R, not this; see the next line)
    torch.testing.assert_close((W @ W.transpose(-2, -1)).mean(0), torch.eye(D, dtype=torch.float64) * 5 / D, atol=0.04, rtol=0)
    assert abs(W[:, 0, 0].mean().item()) < 0.05  # the sign fix: a first column that is not biased towards +e_1
    torch.testing.assert_close(random_frames(D, 5, 70, seed=3), W[:70])  # fewer draws = a prefix
    assert not torch.equal(random_frames(D, 5, 10, seed=4), W[:10])


def test_null_means_are_the_random_subspace_expectations():
    """Under uniform rotation the expected top-k overlap and both variance shares are exactly k/d."""
    E, P = matrices(3)
    report = nulls.rotation_null(E, P, n_draws=1000, fixed_k=3, seed=1)
    for name in ("overlap_k3", "var_share_P_in_E_k3", "var_share_E_in_P_k3"):
        se = report[f"{name}_null_std"] / np.sqrt(1000)
        assert abs(report[f"{name}_null_mean"] - 3 / D) < 4 * se, name
    assert report["var_share_P_in_E_k3_chance"] == pytest.approx(3 / D)


def test_position_rows_inside_the_word_subspace_are_significant():
    """P built from E's top principal directions: overlap 1, the smallest p the draws allow, large z."""
    E, _ = matrices(4)
    Ec = E - E.mean(0)
    V = torch.linalg.svd(Ec, full_matrices=False).Vh[:3]
    P = torch.randn(N_POS, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64) @ V
    n = 200
    report = nulls.rotation_null(E, P, n_draws=n, fixed_k=3)
    assert report["overlap_k3"] == pytest.approx(1.0)
    assert report["var_share_P_in_E_k3"] == pytest.approx(1.0)
    assert report["overlap_k3_p"] == pytest.approx(2 / (n + 1))
    assert report["var_share_P_in_E_k3_z"] > 5
    assert report["angle_mean_k3_deg"] == pytest.approx(0.0, abs=1e-6)
    assert nulls.rotation_null(E, P, n_draws=n, fixed_k=3) == report  # fixed seed: identical


def test_geometry_callback_logs_nulls_probe_and_full_split_at_their_cadence():
    from types import SimpleNamespace

    from pe_geometry.analysis import metric_names as names
    from pe_geometry.analysis.geometry_callback import GeometryCallback
    from pe_geometry.model import DecoderLM, LearnedPE

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=40, d_model=16, n_heads=2, n_layers=1, pe=LearnedPE)
    callback = GeometryCallback(n_tokens=20, fixed_k=2, null_draws=10, position_probe_blocks=10, position_probe_permutations=3)
    callback.token_ids, callback.seq_len = torch.arange(3, 23), 8
    callback.probe, callback.position_blocks = torch.randint(40, (4, 8)), torch.randint(40, (10, 8))
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, loggers=[])
    for step, final in ((0, False), (3, False), (7, True)):
        trainer.global_step = step
        callback._record(trainer, SimpleNamespace(model=model), final=final)
    first, middle, last = (callback.records[s] for s in (0, 3, 7))
    for stat in ("", "_null_mean", "_null_std", "_z", "_p"):
        assert names.input_metric(f"abs_cos_mean{stat}") in middle
        assert names.input_metric(f"var_share_P_in_E_k2{stat}") in middle
    assert names.parse("geometry/angle_mean_k2_deg_z").base == "geometry/angle_mean_k2_deg"
    probe_key = names.hidden_metric(0, "log_position_r2_p")
    assert probe_key in first and probe_key in last and probe_key not in middle  # first, last, every 500 steps
    head = names.attention_share_metric(1, "positional")
    assert head in middle and names.N_POSITIONAL_HEADS_ALL_TERMS in middle
    shares = sum(middle[names.attention_share_metric(1, t)] for t in ("word_word", "word_bias", "bias_bias")) + middle[head]
    assert shares == pytest.approx(1.0)
    # the last step on the cadence: the batch-end record is the final one (on_train_end then skips the step)
    trainer.global_step, trainer.max_steps, callback.every_n_steps, callback.probe_every = 50, 50, 25, 500
    callback.on_train_batch_end(trainer, SimpleNamespace(model=model))
    callback.on_train_end(trainer, SimpleNamespace(model=model))
    assert probe_key in callback.records[50]
    with pytest.raises(ValueError, match="position_probe_blocks=3 must be >= 5"):
        GeometryCallback(position_probe_blocks=3)
