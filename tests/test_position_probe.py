"""Position probe: equal to scikit-learn's grouped CV, ~0 without position, ~1 on the sinusoidal table."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import Ridge
from sklearn.metrics import r2_score
from sklearn.model_selection import GroupKFold, cross_val_predict
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from pe_geometry.analysis.measures.position_probe import PositionProbeSums, label_shuffles, position_probe
from pe_geometry.model import DecoderLM, NoPE
from pe_geometry.model.positional import sinusoidal_table


def weak_signal(B: int = 20, T: int = 12, D: int = 6, seed: int = 0) -> np.ndarray:
    """Noise features, two of them carrying a little position (so alpha matters)."""
    rng = np.random.default_rng(seed)
    H = rng.normal(size=(B, T, D))
    H[:, :, 0] += 0.15 * np.arange(T)
    H[:, :, 1] += 0.5 * np.log1p(np.arange(T))
    H[:, :, 2] *= 30.0  # an unscaled feature: the probe must standardise
    return H


def sklearn_r2(H: np.ndarray, target: np.ndarray, alphas: tuple[float, ...], n_splits: int = 5) -> float:
    """Independent reference: scikit-learn pipelines, nested grouped CV written out with fit/predict."""
    B, T, D = H.shape
    X, y, groups = H.reshape(-1, D), np.tile(target, B), np.repeat(np.arange(B), T)
    outer = GroupKFold(n_splits=n_splits)
    if len(alphas) == 1:
        pred = cross_val_predict(make_pipeline(StandardScaler(), Ridge(alpha=alphas[0])), X, y, groups=groups, cv=outer)
        return r2_score(y, pred)
    fold_of = np.empty(len(y), dtype=int)
    for f, (_, test) in enumerate(outer.split(X, y, groups)):
        fold_of[test] = f
    pred = np.empty_like(y)
    for f in range(n_splits):
        fit = fold_of != f
        inner_sse = []
        for alpha in alphas:  # inner folds: the other outer folds, each left out in turn
            sse = 0.0
            for g in set(range(n_splits)) - {f}:
                model = make_pipeline(StandardScaler(), Ridge(alpha=alpha)).fit(X[fit & (fold_of != g)], y[fit & (fold_of != g)])
                sse += np.sum((y[fold_of == g] - model.predict(X[fold_of == g])) ** 2)
            inner_sse.append(sse)
        best = alphas[int(np.argmin(inner_sse))]
        pred[~fit] = make_pipeline(StandardScaler(), Ridge(alpha=best)).fit(X[fit], y[fit]).predict(X[~fit])
    return r2_score(y, pred)


@pytest.mark.parametrize("alphas", [(3.0,), (0.01, 1.0, 100.0, 1e4)])
def test_matches_scikit_learn_grouped_cross_validation(alphas):
    H = weak_signal()
    report = position_probe(H, n_permutations=2, alphas=alphas)
    t = np.arange(H.shape[1], dtype=np.float64)
    assert report["position_r2"] == pytest.approx(sklearn_r2(H, t, alphas), abs=1e-9)
    assert report["log_position_r2"] == pytest.approx(sklearn_r2(H, np.log1p(t), alphas), abs=1e-9)
    assert 0.05 < report["position_r2"] < 0.9  # a case where the answer is neither trivial end


def test_a_model_without_position_reads_zero_and_is_not_significant():
    """NoPE layer-0 input = token embeddings only: no position by construction."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=64, d_model=32, n_heads=2, n_layers=1, pe=NoPE).eval()
    idx = torch.randint(64, (64, 32))
    with torch.no_grad():
        H = model.input_stack.embed(idx)
    report = position_probe(H, n_permutations=50)
    for target in ("position", "log_position"):
        assert abs(report[f"{target}_r2"]) < 0.01, report
        assert report[f"{target}_r2_p"] > 0.05, report
        assert abs(report[f"{target}_r2_null_mean"]) < 0.01


def test_the_sinusoidal_table_reads_one():
    B, T, D = 32, 64, 32
    rng = np.random.default_rng(1)
    H = sinusoidal_table(T, D).double().numpy()[None] + 0.01 * rng.normal(size=(B, T, D))
    report = position_probe(H, n_permutations=50)
    assert report["position_r2"] > 0.99
    assert report["log_position_r2"] > 0.95
    assert report["position_r2_p"] == pytest.approx(1 / 51)  # nothing in the null comes near
    assert report["position_r2_null_mean"] < 0.02


@pytest.mark.parametrize("kind", ["shift", "permute"])
def test_label_shuffles_differ_per_sequence_keep_label_sets_and_reproduce(kind):
    perms = label_shuffles(B=6, T=10, n_shuffles=4, kind=kind, seed=0)
    assert perms.shape == (4, 6, 10)
    assert (np.sort(perms, axis=-1) == np.arange(10)).all()  # each sequence keeps its label set
    for shuffle in perms:  # not one relabelling shared by all sequences (the probe could learn it)
        assert len({tuple(row) for row in shuffle}) >= 4
    np.testing.assert_array_equal(perms, label_shuffles(B=6, T=10, n_shuffles=4, kind=kind, seed=0))
    if kind == "shift":  # neighbours stay neighbours (mod T)
        assert ((np.diff(perms, axis=-1) % 10) == 1).all()
    with pytest.raises(ValueError, match="null='rotate'; valid"):
        label_shuffles(2, 3, 1, kind="rotate")


def test_the_shift_null_is_wider_than_the_permutation_null_on_autocorrelated_features():
    """Features drifting smoothly along each sequence (no position in expectation): exchangeable
    permutations understate the spread of R^2; cyclic shifts keep the drift-label correlation."""
    B, T, D = 40, 32, 4
    rng = np.random.default_rng(3)
    H = np.cumsum(rng.normal(size=(B, T, D)), axis=1)  # random walks: autocorrelated, no trend shared across sequences
    H -= H.mean(axis=1, keepdims=True)
    shift, permute = position_probe(H, n_permutations=60, null="shift"), position_probe(H, n_permutations=60, null="permute")
    assert shift["position_r2_null_std"] > 2 * permute["position_r2_null_std"]
    assert shift["position_r2_p"] > 0.05  # no position by construction: the shift null does not call it


def test_same_data_gives_the_same_report_whatever_the_global_seed():
    """GroupKFold's split is a fixed function of the groups and the null has its own seed."""
    H = weak_signal(seed=2)
    np.random.seed(1), torch.manual_seed(1)
    first = position_probe(H, n_permutations=5)
    np.random.seed(2), torch.manual_seed(2)
    assert position_probe(H, n_permutations=5) == first


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="at least n_splits sequences"):
        position_probe(np.zeros((3, 8, 4)), n_splits=5)
    with pytest.raises(ValueError, match=r"H must be \(B, T, D\)"):
        position_probe(np.zeros((8, 4)))


def test_chunks_of_blocks_in_any_order_give_the_whole_batch_probe():
    """PositionProbeSums fed a layer chunk by chunk (float32 chunks of a float32 batch, out of order) equals
    position_probe on the whole batch; far-off features (mean 1e4 x their spread) lose nothing to the sums."""
    H = torch.from_numpy(weak_signal(B=14, T=10, D=5, seed=3) + 1e4).float()
    whole = position_probe(H, n_permutations=6)
    sums = PositionProbeSums(14, 10, n_layers=2, n_permutations=6)
    for first, size in [(9, 5), (0, 4), (4, 5)]:
        sums.add(H[first : first + size], first, layer=1)
    chunked = sums.report(layer=1)
    assert chunked.keys() == whole.keys()
    for name, value in whole.items():
        assert chunked[name] == pytest.approx(value, rel=1e-9, abs=1e-9), name
    shifted = position_probe(H.double() - 1e4, n_permutations=6)  # the same features without their offset
    assert whole["position_r2"] == pytest.approx(shifted["position_r2"], abs=1e-9)
    assert whole["position_r2"] > 0.05
    with pytest.raises(ValueError, match="rows added at layer 0"):
        sums.report(layer=0)
