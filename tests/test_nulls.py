"""Spectra-keeping nulls: each draw exact against an explicit rotation, the null's distribution against an
independent brute-force null (full Haar rotations of P, figures recomputed by numpy/scipy), known means, p-values."""

import math

import numpy as np
import pytest
import scipy.linalg
import torch

from pe_geometry.analysis.measures import geometry as geo
from pe_geometry.analysis.measures import nulls

N_WORDS, N_POS, D = 30, 10, 12


def matrices(seed: int = 0, n_words: int = N_WORDS, n_pos: int = N_POS, d: int = D) -> tuple[torch.Tensor, torch.Tensor]:
    """E with an uneven spectrum and a mean row; P low-variance in most directions (like a learned table)."""
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(n_words, d, generator=g, dtype=torch.float64) @ torch.diag(torch.linspace(2.0, 0.2, d, dtype=torch.float64)) + 0.5
    P = torch.randn(n_pos, d, generator=g, dtype=torch.float64) @ torch.diag(torch.logspace(0, -2, d, dtype=torch.float64))
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


def haar(d: int, rng: np.random.Generator) -> np.ndarray:
    """A Haar-random orthogonal d x d matrix (numpy, independent of the code under test): QR of a d x d
    Gaussian, signs fixed (Mezzadri 2007)."""
    Q, R = np.linalg.qr(rng.standard_normal((d, d)))
    return Q * np.sign(np.diagonal(R))


def brute_force_null(E: torch.Tensor, P: torch.Tensor, k: int, n_draws: int, seed: int) -> dict[str, np.ndarray]:
    """The null by definition: P's rows rotated by full Haar matrices (p -> Q p), every figure recomputed."""
    rng = np.random.default_rng(seed)
    draws = [numpy_figures(E.numpy(), P.numpy() @ haar(E.shape[1], rng).T, k) for _ in range(n_draws)]
    return {name: np.array([draw[name] for draw in draws]) for name in draws[0]}


def fast_null(E: torch.Tensor, P: torch.Tensor, k: int, n_draws: int, seed: int) -> dict[str, np.ndarray]:
    """rotation_null's raw draws, by figure name."""
    spectra = nulls._spectra(E, P, fixed_k=k, var_threshold=0.9)
    names = nulls._figure_names(k, "var90")
    return {names[key]: draws.numpy() for key, draws in nulls._null_draws(spectra, n_draws, seed).items()}


def std_se(x: np.ndarray) -> float:
    """Standard error of the sample std (delta method, any distribution): sqrt((m4 - s^4) / (4 n s^2))."""
    s2, m4 = x.var(), ((x - x.mean()) ** 4).mean()
    return math.sqrt(max(m4 - s2**2, 0.0) / (4 * len(x) * s2)) if s2 > 0 else 0.0


# ----------------------------------------------------------------------------- p-values


def test_empirical_p_known_answers():
    null = np.array([1.0, 2.0, 3.0, 4.0])
    assert nulls.empirical_p(4.5, null, "greater") == pytest.approx(1 / 5)
    assert nulls.empirical_p(4.5, null, "less") == pytest.approx(1.0)
    assert nulls.empirical_p(4.5, null) == pytest.approx(2 / 5)
    assert nulls.empirical_p(2.0, null, "less") == pytest.approx(3 / 5)  # ties count against the effect
    assert nulls.empirical_p(2.0, null) == 1.0  # capped
    with pytest.raises(ValueError, match="alternative='both'; valid"):
        nulls.empirical_p(0.0, null, "both")


def test_null_summary_with_a_known_mean_takes_the_spread_about_it():
    null = np.array([1.0, 2.0, 3.0, 6.0])
    free, known = nulls.null_summary("x", 5.0, null), nulls.null_summary("x", 5.0, null, null_mean=2.0)
    assert free["x_null_mean"] == 3.0 and free["x_null_std"] == pytest.approx(np.std(null, ddof=1))
    assert known["x_null_mean"] == 2.0 and known["x_null_std"] == pytest.approx(math.sqrt((1 + 0 + 1 + 16) / 4))
    assert known["x_z"] == pytest.approx(3.0 / known["x_null_std"])
    assert known["x_p"] == free["x_p"]  # p comes from the draws either way


# ----------------------------------------------------------------------------- observed figures


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
    stats = ("", "_null_mean", "_null_std", "_z", "_p")
    assert list(report) == [f"{name}{stat}" for name in ref for stat in stats] + [
        "var_share_P_in_E_k4_chance",
        "var_share_E_in_P_k4_chance",
    ]


# ----------------------------------------------------------------------------- each draw, exactly


def test_each_draw_equals_the_figures_of_an_explicitly_rotated_table():
    """Every draw is the figure of one explicit rotation: the table's Q_ab = F_a^T H_b, the frames' Q V_Pk."""
    n_words, n_pos, d, k = 40, 20, 12, 3  # rows >= d: E's and P's rows are rotated in plain coordinates
    E, P = matrices(1, n_words, n_pos, d)
    S = nulls._spectra(E, P, fixed_k=k, var_threshold=0.9)
    n_draws, seed = 7, 5  # a 3 x 3 grid, the last row cut short
    table = nulls._abs_cos_draws(S.E_unit, S.P_unit, n_draws, seed, dtype=torch.float64)

    def rotation(stream: int, index: int) -> torch.Tensor:
        return nulls.haar_frames(nulls._gaussian((d, d), seed, stream, index, torch.float32).double())

    for t in range(n_draws):
        a, b = divmod(t, 3)
        Q = rotation(nulls._E_ROTATIONS, a).T @ rotation(nulls._P_ROTATIONS, b)  # p -> Q p
        assert table[t].item() == pytest.approx(geo.pairwise_cosine_table(E, P @ Q.T)["abs_cos_mean"], abs=1e-12), t

    frames = nulls._frame_figure_draws(S, n_draws, seed)
    W = nulls.haar_frames(nulls._gaussian((n_draws, d, k), seed, nulls._P_FRAMES_IN_E, 0))  # Q V_Pk, E's basis
    W_E = nulls.haar_frames(nulls._gaussian((n_draws, d, k), seed, nulls._E_FRAMES_IN_P, 0))  # Q^T U_E, P's basis
    U_E = S.V_E[:, :k]
    for t in range(n_draws):
        V = S.V_E @ W[t]  # the rotated top-k subspace of P, in plain coordinates
        assert frames["overlap_k"][t].item() == pytest.approx(geo.subspace_overlap(U_E, V), abs=1e-12)
        assert frames["angle"][t].item() == pytest.approx(geo.principal_angles_deg(U_E, V).mean().item(), abs=1e-9)
        share = ((S.E_centred @ V) ** 2).sum() / (S.E_centred**2).sum()
        assert frames["E_in_P"][t].item() == pytest.approx(share.item(), abs=1e-12)
        U = S.V_P @ W_E[t]  # E's top-k subspace rotated back by Q^T, in plain coordinates
        share = ((S.P_centred @ U) ** 2).sum() / (S.P_centred**2).sum()
        assert frames["P_in_E"][t].item() == pytest.approx(share.item(), abs=1e-12)


@pytest.mark.parametrize("dims", [(2, 3), (12, 3), (14, 5), (5, 14), (8, 8), (0, 5), (16, 4), (9, 16)])
def test_subspace_overlap_draws_match_explicit_frames(dims):
    """tr(Pi_a Pi_b) without a frame, in each of its forms, against ||U^T W||^2 of explicit random frames."""
    d, (a, b), n = 16, dims, 2000
    fast = nulls.subspace_overlap_draws(d, a, b, n, seed=1).numpy()
    assert fast.min() >= -1e-12 and fast.max() <= min(a, b) + 1e-12
    if b in (0, d) or a in (0, d):
        assert fast == pytest.approx(np.full(n, min(a, b)) if max(a, b) == d else np.zeros(n), abs=1e-12)
        return
    rng = np.random.default_rng(2)
    explicit = np.array([(haar(d, rng)[:a, :b] ** 2).sum() for _ in range(n)])
    assert abs(fast.mean() - a * b / d) < 4 * fast.std() / math.sqrt(n)  # exact mean a b / d
    assert abs(fast.std() - explicit.std()) < 4 * math.hypot(std_se(fast), std_se(explicit))


# ----------------------------------------------------------------------------- the null's distribution


@pytest.mark.parametrize(
    "shape",
    [(60, 40, 32), (40, 20, 48)],  # rows >= d for E; P's rows fewer than d: rotated in their own span's coordinates
    ids=["d32", "d48-low-rank-P"],
)
def test_null_matches_a_brute_force_haar_null(shape):
    """Null means and stds of every figure against full Haar rotations of P, within a few Monte-Carlo errors."""
    n_words, n_pos, d = shape
    E, P = matrices(7, n_words, n_pos, d)
    k, n_fast, n_ref = 4, 3000, 800
    fast, ref = fast_null(E, P, k, n_fast, seed=3), brute_force_null(E, P, k, n_ref, seed=4)
    report = nulls.rotation_null(E, P, n_draws=n_fast, seed=3, fixed_k=k)
    for name, r in ref.items():
        f = fast[name]
        se_mean = math.sqrt(f.var() / n_fast + r.var() / n_ref)
        assert abs(f.mean() - r.mean()) < 4 * se_mean, (name, f.mean(), r.mean())
        assert abs(report[f"{name}_null_mean"] - r.mean()) < 4 * math.sqrt(f.var() / n_fast + r.var() / n_ref), name
        assert abs(f.std() - r.std()) < 4 * math.hypot(std_se(f), std_se(r)), (name, f.std(), r.std())
        assert abs(report[f"{name}_null_std"] - r.std()) < 4 * math.hypot(std_se(f), std_se(r)), name


def test_null_means_are_the_exact_expectations():
    """Under uniform rotation the top-k overlap and both variance shares have mean k/d, the var90 overlap
    max(k_E, k_P)/d, mean |cos| the isotropic chance: reported as the null mean, and the draws agree."""
    E, P = matrices(3)
    n = 2000
    report, draws = nulls.rotation_null(E, P, n_draws=n, fixed_k=3, seed=1), fast_null(E, P, 3, n, seed=1)
    S = nulls._spectra(E, P, fixed_k=3, var_threshold=0.9)
    exact = {
        "overlap_k3": 3 / D,
        "var_share_P_in_E_k3": 3 / D,
        "var_share_E_in_P_k3": 3 / D,
        "overlap_var90": max(S.k_E, S.k_P) / D,
        "abs_cos_mean": geo.chance_abs_cos(D),
    }
    for name, mean in exact.items():
        assert report[f"{name}_null_mean"] == pytest.approx(mean, rel=1e-12), name
        assert abs(draws[name].mean() - mean) < 4 * draws[name].std() / math.sqrt(n), name
    assert report["angle_mean_k3_deg_null_mean"] == pytest.approx(draws["angle_mean_k3_deg"].mean())
    assert report["var_share_P_in_E_k3_chance"] == pytest.approx(3 / D)


def test_grid_draws_that_share_a_rotation_are_uncorrelated():
    """Draws (a, b) and (a, b') share E's rotation F_a, yet are independent: across seeds, no correlation."""
    E, P = matrices(2, 20, 15, 8)
    S = nulls._spectra(E, P, fixed_k=2, var_threshold=0.9)
    n_seeds = 600
    T = np.array([nulls._abs_cos_draws(S.E_unit, S.P_unit, 4, seed).numpy() for seed in range(n_seeds)])  # (seeds, 2 x 2 grid)
    for i, j in ((0, 1), (0, 2), (0, 3), (1, 2)):  # same row, same column, disjoint, disjoint
        assert abs(np.corrcoef(T[:, i], T[:, j])[0, 1]) < 4 / math.sqrt(n_seeds), (i, j)
    assert T[:, 0].std() > 0


def test_float32_table_draws_match_float64():
    """The table's draws in float32 (rows summed in float64) move by < 1e-3 of the null's spread, even near isotropy."""
    g = torch.Generator().manual_seed(6)
    E, P = torch.randn(400, 64, generator=g, dtype=torch.float64), torch.randn(300, 64, generator=g, dtype=torch.float64)
    S = nulls._spectra(E, P, fixed_k=4, var_threshold=0.9)
    f32, f64 = (nulls._abs_cos_draws(S.E_unit, S.P_unit, 30, 0, dtype=dtype) for dtype in (torch.float32, torch.float64))
    assert (f32 - f64).abs().max() < 1e-3 * f64.std()


# ----------------------------------------------------------------------------- the work per draw


def test_frames_are_orthonormal_and_uniform():
    W = nulls.haar_frames(nulls._gaussian((400, D, 5), 3, 0, 0))
    torch.testing.assert_close(W.transpose(-2, -1) @ W, torch.eye(5, dtype=torch.float64).expand(400, 5, 5))
    # uniform frames: E[W W^T] = (r / d) I (a sign-unfixed QR would bias the diagonal of R, not this; see the next line)
    torch.testing.assert_close((W @ W.transpose(-2, -1)).mean(0), torch.eye(D, dtype=torch.float64) * 5 / D, atol=0.04, rtol=0)
    assert abs(W[:, 0, 0].mean().item()) < 0.05  # the sign fix: a first column that is not biased towards +e_1


def test_no_draw_builds_a_large_frame(monkeypatch):
    """Scale, not time: n draws build about 2 sqrt(n) frames of d x rank (the table's rotations); every
    other frame is d x k, and the var90 overlap builds none (it draws two m x m Wishart factors per draw)."""
    shapes = []
    real = nulls.haar_frames
    monkeypatch.setattr(nulls, "haar_frames", lambda G, threads=1: shapes.append(tuple(G.shape)) or real(G, threads))
    n_words, n_pos, d, k, n = 50, 40, 32, 4, 100
    E, P = matrices(0, n_words, n_pos, d)
    nulls.rotation_null(E, P, n_draws=n, fixed_k=k)
    large = [s for s in shapes if s[-1] > k]
    assert len(large) == 2 * math.ceil(math.sqrt(n)) and all(s in ((d, d), (d, n_pos)) for s in large)
    assert sum(s[0] for s in shapes if len(s) == 3) == 2 * n and all(s[-2:] == (d, k) for s in shapes if len(s) == 3)


# ----------------------------------------------------------------------------- verdicts on constructed cases


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
    with pytest.raises(ValueError, match=r"callbacks.geometry.position_probe_blocks=3 must be an integer >= 5"):
        GeometryCallback(position_probe_blocks=3)


@pytest.mark.parametrize(("k", "n"), [(0, 10), (3, 10), (5, 10), (7, 10), (40, 270), (229, 270), (135, 270), (0, 1)])
def test_the_sign_test_is_scipys_exact_binomial_test(k, n):
    stats = pytest.importorskip("scipy.stats")
    assert nulls.sign_test(k, n) == pytest.approx(stats.binomtest(k, n, 0.5).pvalue, rel=1e-9, abs=1e-300)


def test_the_sign_test_by_hand():
    assert nulls.sign_test(0, 10) == 2 / 1024 and nulls.sign_test(5, 10) == 1.0 and nulls.sign_test(0, 0) == 1.0


def test_rotation_summary_counts_heads_against_their_null():
    pytest.importorskip("transformers")
    from pe_geometry.analysis.readers.pretrained import rotation_summary

    def head(share, median, p, z):
        return {"share": share, "share_null_median": median, "share_null_mean": median, "share_p": p, "share_z": z}

    layers = [{"positional_share_null": [head(0.1, 0.5, 0.01, -3.0), head(0.2, 0.5, 0.2, -1.0)]},
              {"positional_share_null": [head(0.9, 0.5, 0.01, 3.0), head(0.4, 0.5, 0.5, -0.5)]},
              {"positional_share": None}]
    s = rotation_summary(layers)
    assert (s["n_heads"], s["below_null_median"], s["above_p05"], s["below_p05"]) == (4, 3, 1, 1)
    assert s["sign_test_p"] == nulls.sign_test(3, 4) == 0.625
    assert (s["above_holm"], s["below_holm"]) == (1, 1)  # Holm: 0.01 x 4 = 0.04 < 0.05, then 0.04 again
    assert s["share_mean"] == pytest.approx(0.4) and s["null_mean"] == pytest.approx(0.5)
    assert rotation_summary([{"positional_share": None}]) is None
