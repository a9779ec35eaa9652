"""The rotation test (analysis/study/rotation_test.py, pe-rotation): rotations by hand, and toys whose answer is known by
construction: a readout that suffers when position writes where words vary most, and one that ignores position."""

from __future__ import annotations

import pytest
import torch

from pe_geometry.analysis.study.rotation_test import (
    aligning_rotation,
    haar_rotation,
    rotated_input,
    rotation_test,
    run_rotation_test,
)
from pe_geometry.cli.rotation import main as pe_rotation
from pe_geometry.training.pipeline import train
from tests.conftest import tiny_train_config


def test_aligning_rotation_is_orthogonal_and_takes_U_onto_V():
    g = torch.Generator().manual_seed(0)
    U, _ = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(6, 2, generator=g, dtype=torch.float64))
    R = aligning_rotation(U, V, g)
    assert torch.allclose(R @ R.T, torch.eye(6, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(R @ U, V, atol=1e-12)
    # a row written in U's coordinates is written in V's after x -> x @ R.T
    c = torch.tensor([[2.0, -3.0]], dtype=torch.float64)
    assert torch.allclose((c @ U.T) @ R.T, c @ V.T, atol=1e-12)
    H = haar_rotation(6, g)
    assert torch.allclose(H.T @ H, torch.eye(6, dtype=torch.float64), atol=1e-12)


def _toy(depends_on_position: bool):
    """Words: 40 rows whose variance lies in dims 0-3 (strong) and 4-15 (weak); positions: 12 rows of a fixed norm.
    The "model" names the word by its nearest row of E from e + p (a readout that suffers where p adds to the
    directions that tell words apart), or from e alone (a model that ignores p)."""
    g = torch.Generator().manual_seed(1)
    d, n_words = 16, 40
    E = torch.randn(n_words, d, generator=g, dtype=torch.float64) * torch.tensor([3.0] * 4 + [0.3] * 12, dtype=torch.float64)
    P = torch.randn(12, d, generator=g, dtype=torch.float64) * 1.5
    pairs = torch.cartesian_prod(torch.arange(n_words), torch.arange(12))

    def loss_of(R):
        Pr = P if R is None else P @ R.T
        x = E[pairs[:, 0]] + (Pr[pairs[:, 1]] if depends_on_position else 0)
        logits = -torch.cdist(x, E) ** 2
        return float(torch.nn.functional.cross_entropy(logits, pairs[:, 0]))

    return loss_of, E, P


def test_a_readout_hurt_by_interference_reads_as_needing_the_separation():
    loss_of, E, P = _toy(depends_on_position=True)
    r = rotation_test(loss_of, P, E, k=4, n_random=20, seed=0)
    assert r["D"] > 0 and r["above_every_random"] and r["p"] == pytest.approx(1 / 21)
    assert r["delta_away"] < r["delta_random_mean"] < r["delta_adversarial"]  # onto E's bottom: hurts least


def test_a_model_that_ignores_position_shows_no_need():
    loss_of, E, P = _toy(depends_on_position=False)
    r = rotation_test(loss_of, P, E, k=4, n_random=10, seed=0)
    assert r["D"] == 0 and r["delta_adversarial"] == 0 and not r["above_every_random"] and r["p"] == 1.0


@pytest.fixture(scope="module")
def learned_run(tmp_path_factory, tiny_corpus, cache_dir):
    root = tmp_path_factory.mktemp("rot")
    train(tiny_train_config(root, tiny_corpus, cache_dir, ["pe=learned", "~callbacks.sample", "trainer.max_steps=4"]))
    return root / "run"


def test_rotated_input_turns_only_the_table_it_names(learned_run):
    from pe_geometry.training.run_loader import load_trained_run

    model = load_trained_run(learned_run).model.eval()
    idx = torch.randint(0, 50, (2, 8))
    R = haar_rotation(model.W_E.shape[1], torch.Generator().manual_seed(3)).float()
    stack = model.input_stack
    with torch.no_grad():
        plain = stack.embedding(idx) + model.W_pos[:8]
        with rotated_input(model, "P", None):
            assert torch.equal(stack.embed(idx), stack.embed(idx))
        with rotated_input(model, "P", R):
            assert torch.allclose(stack.embed(idx), stack.embedding(idx) + model.W_pos[:8] @ R.T, atol=1e-6)
        with rotated_input(model, "E", R):
            assert torch.allclose(stack.embed(idx), stack.embedding.weight[idx] * stack.embedding.scale @ R.T + model.W_pos[:8],
                                  atol=1e-6)
            assert model.head.weight is model.W_E  # the tied head reads E as trained
        assert torch.equal(stack.embed(idx), plain)  # restored on leaving
    with pytest.raises(ValueError, match=r"rotate='Q'; valid: \['P', 'E'\]"), rotated_input(model, "Q", R):
        pass


def test_a_trained_run_and_the_console_script(learned_run, tmp_path, capsys):
    r = run_rotation_test(learned_run, n_random=3, val_batches=2)
    assert r["step"] == 4 and len(r["loss_random"]) == 3 and r["p"] in (0.25, 0.5, 0.75, 1.0)
    again = pe_rotation([str(learned_run), "--n-random", "3", "--val-batches", "2", "--json", str(tmp_path / "r.json")])
    assert again["loss"] == r["loss"] and again["loss_adversarial"] == r["loss_adversarial"]  # deterministic
    out = capsys.readouterr().out
    assert "adversarial" in out and "floor 0.25" in out and (tmp_path / "r.json").is_file()


def test_a_run_without_a_table_is_one_error(tmp_path, tiny_corpus, cache_dir, capsys):
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=rope", "~callbacks.sample", "callbacks=no_geometry"]))
    with pytest.raises(SystemExit, match=r"error: .* adds no table to the input"):
        pe_rotation([str(tmp_path / "run"), "--n-random", "2"])


def test_the_sensitivity_control_reads_a_readout_that_suffers_in_E_top_directions():
    """The toy readout suffers from anything added where words vary most: noise there hurts more than in random
    subspaces (S > 0), and least in E's bottom directions."""
    from pe_geometry.analysis.study.rotation_test import sensitivity_test

    g = torch.Generator().manual_seed(1)
    d, n_words = 16, 40
    E = torch.randn(n_words, d, generator=g, dtype=torch.float64) * torch.tensor([3.0] * 4 + [0.3] * 12, dtype=torch.float64)
    P = torch.randn(12, d, generator=g, dtype=torch.float64)
    pairs = torch.cartesian_prod(torch.arange(n_words), torch.arange(12))

    def loss_of_added(N):
        x = E[pairs[:, 0]] + (P if N is None else P + N.double())[pairs[:, 1]]
        return float(torch.nn.functional.cross_entropy(-torch.cdist(x, E) ** 2, pairs[:, 0]))

    r = sensitivity_test(loss_of_added, E, P, k=4, n_random=10)
    assert r["S"] > 0 and r["rise_bottom"] < r["rise_random_mean"] < r["rise_top"]
