"""Positional encodings against their papers' formulas, computed independently."""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.model.positional import ALiBiPE, LearnedPE, RotaryPE, SinusoidalPE, alibi_slopes, sinusoidal_table
from tests.loops import named


def reference_sinusoid(n_positions: int, d_model: int) -> torch.Tensor:
    """Vaswani et al. (2017), element by element with Python floats."""
    table = torch.empty(n_positions, d_model, dtype=torch.float64)
    for pos in range(n_positions):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            table[pos, 2 * i] = math.sin(angle)
            table[pos, 2 * i + 1] = math.cos(angle)
    return table


def test_sinusoidal_table_matches_formula_bounded_and_distinct():
    table = sinusoidal_table(200, 32).double()
    torch.testing.assert_close(table, reference_sinusoid(200, 32), atol=1e-6, rtol=0)
    assert table.abs().max() <= 1.0
    distances = torch.cdist(table, table) + torch.eye(200, dtype=torch.float64) * 1e9
    assert distances.min() > 1e-3  # every position gets its own vector


def test_sinusoidal_wavelengths_are_geometric_from_2pi_to_10000_2pi():
    d = 64
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    wavelengths = 2 * math.pi / inv_freq
    assert wavelengths[0] == pytest.approx(2 * math.pi)
    ratios = wavelengths[1:] / wavelengths[:-1]
    torch.testing.assert_close(ratios, torch.full_like(ratios, 10000 ** (2 / d)))
    assert wavelengths[-1] < 10000 * 2 * math.pi  # the series approaches 10000*2pi from below


def rotation_for_offset(k: int, d_model: int) -> torch.Tensor:
    """Block-diagonal R(k): each (sin, cos) pair rotated by k * w_i."""
    R = torch.zeros(d_model, d_model, dtype=torch.float64)
    for i in range(d_model // 2):
        w = 1 / 10000 ** (2 * i / d_model)
        c, s = math.cos(k * w), math.sin(k * w)
        # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] @ [sin a, cos a]
        R[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)
    return R


def test_relative_position_is_a_fixed_rotation():
    for k in (1, 5, 37):
        with named(k):
            d = 16
            table = reference_sinusoid(100 + k, d)
            R = rotation_for_offset(k, d)
            shifted = table[:100] @ R.T  # the same R for every pos
            torch.testing.assert_close(shifted, table[k : 100 + k], atol=1e-9, rtol=0)
            assert torch.allclose(R @ R.T, torch.eye(d, dtype=torch.float64))  # a rotation


def test_sin_only_table_has_no_fixed_linear_offset_map():
    """With sin alone, no single matrix maps PE[pos] to PE[pos + k] for all pos (the pair is what makes the shift linear)."""
    d, k = 16, 3
    inv_freq = 10000.0 ** (-torch.arange(d, dtype=torch.float64) / d)
    sin_only = torch.sin(torch.arange(200, dtype=torch.float64)[:, None] * inv_freq)
    X, Y = sin_only[:-k], sin_only[k:]
    M = torch.linalg.lstsq(X, Y).solution  # best linear map
    residual = (X @ M - Y).norm() / Y.norm()
    assert residual > 1e-2
    full = reference_sinusoid(200, d)  # ...while the sin/cos table has an exact one
    M_full = torch.linalg.lstsq(full[:-k], full[k:]).solution
    assert (full[:-k] @ M_full - full[k:]).norm() / full[k:].norm() < 1e-8


def test_sinusoidal_rejects_odd_d_model_and_grows_past_max_len():
    with pytest.raises(ValueError, match="even model.d_model"):
        SinusoidalPE(d_model=33, n_heads=3)
    pe = SinusoidalPE(d_model=8, n_heads=2, max_len=4)
    torch.testing.assert_close(pe.input_term(10).double(), reference_sinusoid(10, 8), atol=1e-6, rtol=0)


def test_learned_pe_refuses_sequences_longer_than_its_table():
    pe = LearnedPE(d_model=8, n_heads=2, max_len=16)
    assert pe.input_term(16).shape == (16, 8)
    with pytest.raises(ValueError, match=r"17 tokens .*pe.max_len=16"):
        pe.input_term(17)


def test_rope_scores_depend_only_on_relative_offset():
    torch.manual_seed(0)
    rope = RotaryPE(d_model=32, n_heads=2)
    T, d_head = 40, 16
    q_vec, k_vec = torch.randn(d_head), torch.randn(d_head)
    q = rope.rotate(q_vec.expand(T, d_head))  # the same query content at every position
    k = rope.rotate(k_vec.expand(T, d_head))
    scores = q @ k.T  # (T, T), scores[m, n] = <R_m q, R_n k>
    for offset in (-7, 0, 3, 11):
        diagonal = torch.diagonal(scores, offset=offset)
        torch.testing.assert_close(diagonal, diagonal[0].expand_as(diagonal), atol=1e-4, rtol=0)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 5)[0])
    torch.testing.assert_close(q.norm(dim=-1), q_vec.norm().expand(T))  # rotation keeps the norm


def test_rope_rotates_pairs_by_position_times_theta():
    rope = RotaryPE(d_model=4, n_heads=1, base=10000.0)
    x = torch.tensor([[1.0, 0.0, 1.0, 0.0]]).expand(3, 4)
    out = rope.rotate(x)
    for pos in range(3):
        for i, theta in enumerate((1.0, 10000 ** (-2 / 4))):
            expected = torch.tensor([math.cos(pos * theta), math.sin(pos * theta)])
            torch.testing.assert_close(out[pos, 2 * i : 2 * i + 2], expected)


def test_rope_rejects_odd_head_dimension():
    with pytest.raises(ValueError, match="even head dimension"):
        RotaryPE(d_model=12, n_heads=4)


def test_alibi_slopes_match_the_paper():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 6 heads: the 4-head series (2^-2, 2^-4, 2^-6, 2^-8) plus every other slope of the 8-head one.
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))


def test_alibi_bias_is_minus_slope_times_distance():
    pe = ALiBiPE(d_model=16, n_heads=4)
    bias = pe.score_bias(5, 5)
    slopes = [2.0 ** (-2 * (h + 1)) for h in range(4)]
    for h in range(4):
        for i in range(5):
            for j in range(5):
                assert bias[h, i, j].item() == pytest.approx(-slopes[h] * abs(i - j))


def test_each_encoding_checks_its_own_settings():
    """validate.py asks the encoding's settings; a new encoding brings its own rules (the base accepts any sizes)."""
    from pe_geometry.model.positional import ALiBiPE, LearnedPE, NoPE, RotaryPE, SinusoidalPE

    with pytest.raises(ValueError, match=r"RoPE needs an even head dimension.*12/4 = 3"):
        RotaryPE.check_settings(d_model=12, n_heads=4, seq_len=16)
    with pytest.raises(ValueError, match=r"even model.d_model.*33"):
        SinusoidalPE.check_settings(d_model=33, n_heads=3, seq_len=16)
    with pytest.raises(ValueError, match=r"data.seq_len=600 is longer than the learned position table \(pe.max_len=512\)"):
        LearnedPE.check_settings(d_model=32, n_heads=4, seq_len=600, max_len=512)
    LearnedPE.check_settings(d_model=32, n_heads=4, seq_len=512, max_len=512)
    for pe in (ALiBiPE, NoPE):
        pe.check_settings(d_model=33, n_heads=3, seq_len=10_000)  # any sizes
        with pytest.raises(TypeError, match="unrelated_key"):  # but only their own keys (the config's: one line)
            pe.check_settings(d_model=33, n_heads=3, seq_len=10_000, unrelated_key=1)
