"""RoPE's scalings and partial rotations against transformers' own RoPE initialisation (``ROPE_INIT_FUNCTIONS`` in
``transformers.modeling_rope_utils``, the functions every Llama / GPT-NeoX / Gemma model there builds its inv_freq
with), and a partial rotation against GPT-NeoX's attention with copied weights.

What transformers has no function for is checked against the paper's formula written out here: YaRN's ramp in turns
(our default; transformers' ramp is linear in the pair index, our ``yarn_ramp=dims``), static NTK (transformers'
dynamic NTK at the one length where its base is the static one), p-RoPE's NTK exponent.

Frequencies are compared pair by pair: transformers returns the rotating pairs only (GPT-NeoX style) or pads the
others with 0 (``proportional``, p-RoPE), ours always has d_head/2 with 0 for the pairs left alone. Tolerance: 1e-6
absolute and 1e-5 relative (transformers computes in float32; the lowest frequencies at base 5e5 are ~1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.model import ExplicitAttention, RotaryPE, XPosPE
from pe_geometry.model.positional import yarn_thresholds
from tests.loops import grid, named

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

ATOL, RTOL = 1e-6, 1e-5
# (d_head, training length, base): our test size, a mid size, Llama 3.1 8B's head, context and base
SIZES = [(16, 64, 10000.0), (64, 4096, 10000.0), (128, 8192, 500000.0)]
FACTORS = [2.0, 4.0, 8.0]
FRACTIONS = [1.0, 0.5, 0.25]  # f d_head whole and even at every size: transformers truncates, we round


def hf_frequencies(rope_type: str, d_head: int, training_length: int, base: float, fraction: float = 1.0,
                   seq_len: int | None = None, **params) -> tuple[torch.Tensor, float]:
    """transformers' (inv_freq float64, attention factor) for a LlamaConfig of this head, length and rope_parameters
    (``max_position_embeddings`` = the training length where nothing else names it: what dynamic NTK scales from)."""
    from transformers import LlamaConfig

    rope = {"rope_type": rope_type, "rope_theta": base, **params}
    if fraction != 1.0:
        rope["partial_rotary_factor"] = fraction
    # yarn and llama3 read the training length from original_max_position_embeddings, the context they reach being
    # max_position_embeddings (s times it; transformers warns when it is not longer)
    longest = int(training_length * params["factor"]) if "original_max_position_embeddings" in params else training_length
    config = LlamaConfig(hidden_size=2 * d_head, num_attention_heads=2, head_dim=d_head,
                         max_position_embeddings=longest, rope_parameters=rope)
    if rope_type == "default":  # GPT-NeoX's: Llama's default ignores partial_rotary_factor
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding

        inv_freq, factor = GPTNeoXRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, seq_len=seq_len)
    return inv_freq.double(), float(factor)


def ours(d_head: int, **settings) -> RotaryPE:
    return RotaryPE(d_model=2 * d_head, n_heads=2, **settings)


def assert_frequencies(got: torch.Tensor, expected: torch.Tensor) -> float:
    """got (d_head/2,) against expected (its first pairs; the rest must be 0): the max abs error."""
    assert got.shape[0] >= expected.shape[0]
    torch.testing.assert_close(got[: expected.shape[0]], expected, atol=ATOL, rtol=RTOL)
    assert (got[expected.shape[0] :] == 0).all()  # the pairs left alone do not turn
    return float((got[: expected.shape[0]] - expected).abs().max())


# -- no scaling, linear, NTK, dynamic NTK -------------------------------------------------------------------------------
def test_unscaled_partial_rotary_is_gpt_neox_rotary_pct():
    for (d_head, L, base), fraction in grid(SIZES, FRACTIONS):
        with named(d_head, L, base, fraction):
            expected, factor = hf_frequencies("default", d_head, L, base, fraction)
            pe = ours(d_head, base=base, rotary_fraction=fraction)
            assert_frequencies(pe.frequencies(0), expected)
            assert pe.attention_factor == factor == 1.0


def test_linear_scaling_is_transformers_linear():
    for (d_head, L, base), s, fraction in grid(SIZES, FACTORS, FRACTIONS):
        with named(d_head, L, base, s, fraction):
            expected, factor = hf_frequencies("linear", d_head, L, base, fraction, factor=s)
            pe = ours(d_head, base=base, scaling="linear", scaling_factor=s, rotary_fraction=fraction)
            assert_frequencies(pe.frequencies(0), expected)
            assert pe.attention_factor == factor


def test_dynamic_ntk_is_transformers_dynamic_below_and_above_the_training_length():
    for (d_head, L, base), s, fraction in grid(SIZES, FACTORS, FRACTIONS):
        with named(d_head, L, base, s, fraction):
            pe = ours(d_head, base=base, scaling="dynamic_ntk", scaling_factor=s, training_length=L, rotary_fraction=fraction)
            for n in (L // 2, L, L + 1, 3 * L, 16 * L):
                expected, factor = hf_frequencies("dynamic", d_head, L, base, fraction, seq_len=n, factor=s)
                assert_frequencies(pe.frequencies(n), expected)
                assert pe.attention_factor == factor
            assert not torch.allclose(pe.frequencies(16 * L), pe.frequencies(L))


def test_static_ntk_is_transformers_dynamic_ntk_where_its_base_is_the_static_one():
    """Dynamic NTK's base at length n is base (s n / L - (s - 1))^(d/(d-2)): the static base s^(d/(d-2)) at
    n = (2s - 1) L / s (a whole number for these L and s)."""
    for (d_head, L, base), s, fraction in grid(SIZES, FACTORS, FRACTIONS):
        with named(d_head, L, base, s, fraction):
            n = (2 * s - 1) * L / s
            assert n == int(n)
            expected, _ = hf_frequencies("dynamic", d_head, L, base, fraction, seq_len=int(n), factor=s)
            pe = ours(d_head, base=base, scaling="ntk", scaling_factor=s, rotary_fraction=fraction)
            assert_frequencies(pe.frequencies(0), expected)
            rotating = round(fraction * d_head) // 2
            # NTK's defining property: the lowest rotating frequency is interpolated (divided by s)
            plain = ours(d_head, base=base, rotary_fraction=fraction).frequencies(0)
            assert pe.frequencies(0)[rotating - 1].item() == pytest.approx(plain[rotating - 1].item() / s, rel=1e-12)


# -- YaRN: transformers' ramp (dims) and the paper's (turns) ------------------------------------------------------------
def yarn_settings(L: int, base: float) -> list[tuple[float, float]]:
    """(alpha, beta) pairs: Llama's (1, 32) as transformers' defaults, and our rescaled defaults for this length."""
    return [(1.0, 32.0), yarn_thresholds(L, base), (2.0, 16.0)]


def test_yarn_with_the_dims_ramp_is_transformers_yarn():
    """Our alpha / beta are transformers' beta_slow / beta_fast (turns within original_max_position_embeddings)."""
    for (d_head, L, base), s, fraction in grid(SIZES, FACTORS, FRACTIONS):
        with named(d_head, L, base, s, fraction):
            for alpha, beta in yarn_settings(L, base):
                expected, factor = hf_frequencies("yarn", d_head, L, base, fraction, factor=s, beta_slow=alpha, beta_fast=beta,
                                                  original_max_position_embeddings=L)
                pe = ours(d_head, base=base, scaling="yarn", scaling_factor=s, training_length=L, rotary_fraction=fraction,
                          yarn_ramp="dims", yarn_alpha=alpha, yarn_beta=beta)
                assert_frequencies(pe.frequencies(0), expected)
                assert pe.attention_factor == pytest.approx(factor, abs=1e-12)
            explicit, factor = hf_frequencies("yarn", d_head, L, base, fraction, factor=s, attention_factor=1.3,
                                              original_max_position_embeddings=L)
            pe = ours(d_head, base=base, scaling="yarn", scaling_factor=s, training_length=L, rotary_fraction=fraction,
                      yarn_ramp="dims", yarn_alpha=1.0, yarn_beta=32.0, yarn_attention_factor=1.3)
            assert_frequencies(pe.frequencies(0), explicit)
            assert pe.attention_factor == factor == 1.3


def test_yarn_with_the_turns_ramp_is_the_papers_gamma_of_r():
    """Peng et al. (2023), eq. 18-19: r_i = L / lambda_i = L theta_i / (2 pi), gamma(r) = 0 below alpha, 1 above beta,
    (r - alpha) / (beta - alpha) between; theta_i' = (1 - gamma(r_i)) theta_i / s + gamma(r_i) theta_i."""
    for (d_head, L, base), s in grid(SIZES, FACTORS):
        with named(d_head, L, base, s):
            for alpha, beta in yarn_settings(L, base):
                pe = ours(d_head, base=base, scaling="yarn", scaling_factor=s, training_length=L, yarn_alpha=alpha, yarn_beta=beta)
                assert pe.yarn_ramp == "turns"  # the default
                for i in range(d_head // 2):
                    theta = base ** (-2 * i / d_head)
                    r = L * theta / (2 * math.pi)
                    gamma = 0.0 if r < alpha else 1.0 if r > beta else (r - alpha) / (beta - alpha)
                    assert pe.frequencies(0)[i].item() == pytest.approx((1 - gamma) * theta / s + gamma * theta, rel=1e-12)
                assert pe.attention_factor == pytest.approx(0.1 * math.log(s) + 1)


def test_the_two_yarn_ramps_keep_and_interpolate_the_same_pairs_and_differ_in_between():
    d_head, L, base, s = 64, 4096, 10000.0, 4.0
    turns, dims = (ours(d_head, base=base, scaling="yarn", scaling_factor=s, training_length=L, yarn_ramp=ramp,
                        yarn_alpha=1.0, yarn_beta=32.0).frequencies(0) for ramp in ("turns", "dims"))
    plain = ours(d_head, base=base).frequencies(0)
    for theta in (turns, dims):
        assert theta[0] == plain[0] and theta[-1].item() == pytest.approx(plain[-1].item() / s)
    assert (turns - dims).abs().max() / plain.max() > 1e-3  # r_i is exponential in i: the ramps are not the same


# -- Llama 3.1 --------------------------------------------------------------------------------------------------------
def test_llama3_scaling_is_transformers_llama3():
    for (d_head, L, base), s, fraction in grid(SIZES, FACTORS, FRACTIONS):
        with named(d_head, L, base, s, fraction):
            for low, high in [(1.0, 4.0), (0.5, 2.0), (2.0, 16.0)]:
                expected, factor = hf_frequencies("llama3", d_head, L, base, fraction, factor=s, low_freq_factor=low,
                                                  high_freq_factor=high, original_max_position_embeddings=L)
                pe = ours(d_head, base=base, scaling="llama3", scaling_factor=s, training_length=L, low_freq_factor=low,
                          high_freq_factor=high, rotary_fraction=fraction)
                assert_frequencies(pe.frequencies(0), expected)
                assert pe.attention_factor == factor == 1.0


def test_llama3_defaults_are_llama_3_1s():
    """Llama 3.1's rope_scaling: factor 8, low_freq_factor 1, high_freq_factor 4, original length 8192."""
    expected, _ = hf_frequencies("llama3", 128, 8192, 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)
    assert_frequencies(ours(128, base=500000.0, scaling="llama3", scaling_factor=8.0, training_length=8192).frequencies(0),
                       expected)


# -- p-RoPE: transformers' proportional RoPE (Gemma) -----------------------------------------------------------------
def test_p_rope_is_transformers_proportional_rope():
    """p-RoPE (Barbero et al. 2024): full RoPE's theta_i = base^(-2i/d_head), the lowest 1 - f of the pairs at 0."""
    for (d_head, L, base), s, fraction in grid(SIZES, (1.0, *FACTORS), FRACTIONS):
        with named(d_head, L, base, s, fraction):
            expected, factor = hf_frequencies("proportional", d_head, L, base, fraction, factor=s)
            assert expected.shape[0] == d_head // 2  # proportional keeps the pairs it drops, at 0
            pe = ours(d_head, base=base, scaling="linear" if s > 1 else "none", scaling_factor=s, rotary_fraction=fraction,
                      partial_rotary="p_rope")
            assert_frequencies(pe.frequencies(0), expected)
            assert pe.attention_factor == factor
            rotating = round(fraction * d_head) // 2
            for i in range(rotating):  # by hand
                assert pe.frequencies(0)[i].item() == pytest.approx(base ** (-2 * i / d_head) / s, rel=1e-12)


def test_p_rope_yarn_and_llama3_are_the_full_ropes_first_pairs():
    """YaRN and Llama 3.1 act per frequency (and YaRN's index ramp on base^(-2i/d_head)): p-RoPE under them is the full
    head's scaled frequencies, its lowest 1 - f of the pairs at 0."""
    for (d_head, L, base), fraction in grid(SIZES, (0.5, 0.25)):
        with named(d_head, L, base, fraction):
            rotating = round(fraction * d_head) // 2
            s = 4.0
            yarn, _ = hf_frequencies("yarn", d_head, L, base, factor=s, beta_slow=1.0, beta_fast=32.0,
                                     original_max_position_embeddings=L)
            pe = ours(d_head, base=base, scaling="yarn", scaling_factor=s, training_length=L, yarn_ramp="dims", yarn_alpha=1.0,
                      yarn_beta=32.0, rotary_fraction=fraction, partial_rotary="p_rope")
            assert_frequencies(pe.frequencies(0), yarn[:rotating])
            llama3, _ = hf_frequencies("llama3", d_head, L, base, factor=s, low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=L)
            pe = ours(d_head, base=base, scaling="llama3", scaling_factor=s, training_length=L, rotary_fraction=fraction,
                      partial_rotary="p_rope")
            assert_frequencies(pe.frequencies(0), llama3[:rotating])


def test_p_rope_ntk_divides_the_lowest_rotating_frequency_by_s():
    """No reference has it: base' = base s^(d_head / (R - 2)), R the rotating dims, so that the lowest rotating pair
    (i = R/2 - 1, theta = base^(-(R - 2)/d_head)) turns s times slower, NTK's rule for the full head."""
    for scaling in ("ntk", "dynamic_ntk"):
        with named(scaling):
            d_head, L, base, s, fraction = 32, 64, 10000.0, 4.0, 0.25
            R = round(fraction * d_head)
            pe = ours(d_head, base=base, scaling=scaling, scaling_factor=s, training_length=L, rotary_fraction=fraction,
                      partial_rotary="p_rope")
            n = int((2 * s - 1) * L / s)  # where dynamic NTK's base is the static one
            scaled_base = base * s ** (d_head / (R - 2))
            expected = [scaled_base ** (-2 * i / d_head) for i in range(R // 2)] + [0.0] * ((d_head - R) // 2)
            assert pe.frequencies(n).tolist() == pytest.approx(expected, rel=1e-12)
            assert expected[R // 2 - 1] == pytest.approx(base ** (-(R - 2) / d_head) / s, rel=1e-12)


# -- partial rotation in a model: GPT-NeoX's attention with copied weights --------------------------------------------
def neox_to_interleaved(d_head: int, rotary_dims: int) -> torch.Tensor:
    """Row order of one head: our row 2j is GPT-NeoX's row j, our 2j + 1 its j + R/2 (rotate_half pairs dim j with
    j + R/2; we pair 2j with 2j + 1); the rows past R stay."""
    half = rotary_dims // 2
    order = [x for j in range(half) for x in (j, j + half)]
    return torch.tensor(order + list(range(rotary_dims, d_head)))


def test_partial_rotary_attention_is_gpt_neox_attention_with_copied_weights():
    for fraction, scaling in grid(FRACTIONS, ("none", "linear")):
        with named(fraction, scaling):
            from transformers import GPTNeoXConfig
            from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding

            torch.manual_seed(0)
            H, d_head, T, s = 2, 16, 24, 4.0
            D = H * d_head
            rope = {"rope_type": "default" if scaling == "none" else scaling, "rope_theta": 100.0, "partial_rotary_factor": fraction}
            if scaling == "linear":
                rope["factor"] = s
            config = GPTNeoXConfig(hidden_size=D, num_attention_heads=H, max_position_embeddings=T, attention_bias=True,
                                   rope_parameters=rope, attn_implementation="eager")
            ref, rotary = GPTNeoXAttention(config, layer_idx=0).eval(), GPTNeoXRotaryEmbedding(config)
            with torch.no_grad():
                for p in ref.parameters():
                    p.normal_(0, 0.3)
            pe = RotaryPE(D, H, base=100.0, scaling=scaling, scaling_factor=s if scaling == "linear" else 1.0,
                          rotary_fraction=fraction)
            attn = ExplicitAttention(D, H, pe=pe).eval()
            order = neox_to_interleaved(d_head, round(fraction * d_head))
            w = ref.query_key_value.weight.view(H, 3, d_head, D)
            b = ref.query_key_value.bias.view(H, 3, d_head)
            with torch.no_grad():
                attn.q.weight.copy_(w[:, 0][:, order].reshape(D, D))
                attn.q.bias.copy_(b[:, 0][:, order].reshape(D))
                attn.kv.weight.copy_(torch.cat([w[:, 1][:, order].reshape(D, D), w[:, 2].reshape(D, D)]))
                attn.kv.bias.copy_(torch.cat([b[:, 1][:, order].reshape(D), b[:, 2].reshape(D)]))
                attn.o.weight.copy_(ref.dense.weight)
                attn.o.bias.copy_(ref.dense.bias)

                x = torch.randn(2, T, D)
                cos, sin = rotary(x, torch.arange(T)[None])
                causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
                expected, _ = ref(x, attention_mask=causal, position_embeddings=(cos, sin))
                got = attn(x, causal=True)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            unrotated_rows = attn.q.weight.view(H, d_head, D)[:, round(fraction * d_head) :]
            assert fraction == 1.0 or unrotated_rows.abs().sum() > 0  # the pass-through dims carry weight


def test_the_dims_a_partial_rotation_leaves_alone_pass_unchanged():
    x = torch.randn(2, 2, 30, 16)
    for style in ("neox", "p_rope"):
        pe = ours(16, rotary_fraction=0.25, partial_rotary=style, scaling="linear", scaling_factor=2.0)
        out = pe.rotate(x, start_pos=3)
        assert torch.equal(out[..., 4:], x[..., 4:])
        assert not torch.allclose(out[..., 1:4], x[..., 1:4])
    xpos = XPosPE(d_model=32, n_heads=2, rotary_fraction=0.25, scale_base=16.0, training_length=8)
    assert torch.equal(xpos.rotate(x, key=True)[..., 4:], x[..., 4:])  # zeta 1: no decay either
    assert (xpos.zeta[2:] == 1).all() and (xpos.zeta[:2] < 1).all()


def test_partial_xpos_is_x_transformers_xpos_over_its_rotary_dims():
    """x-transformers rotates (and decays) the first rotary_emb_dim dims of each head, interleaved as ours; compared on
    q.k, where its moving centre and our fixed one cancel."""
    for fraction, T in grid((0.5, 0.25), (30, 61)):
        with named(fraction, T):
            x_transformers = pytest.importorskip("x_transformers.x_transformers")
            g = torch.Generator().manual_seed(0)
            d_head = 16
            R = round(fraction * d_head)
            q, k = torch.randn(2, 2, T, d_head, generator=g) * 2, torch.randn(2, 2, T, d_head, generator=g) * 2
            ref = x_transformers.RotaryEmbedding(R, use_xpos=True, scale_base=16)
            freqs, scale = ref.forward_from_seq_len(T)
            q_ref, k_ref = x_transformers.apply_rotary_pos_emb(q, freqs, scale), x_transformers.apply_rotary_pos_emb(k, freqs, scale**-1.0)
            q_ours, k_ours = XPosPE(2 * d_head, 2, scale_base=16.0, training_length=64, rotary_fraction=fraction).rotate_qk(q, k)
            torch.testing.assert_close(q_ours @ k_ours.transpose(-2, -1), q_ref @ k_ref.transpose(-2, -1), atol=1e-4, rtol=1e-4)


# -- the cache follows the frequencies ----------------------------------------------------------------------------------
# (cached = uncached decoding and generation with each scaling and partial rotation: tests/test_encoding_conformance.py)
def test_the_rotation_table_follows_dynamic_ntks_base_with_a_partial_rotation():
    """The angle table is cached by frequencies: a partial rotation's last frequency is 0 at any base, so a key on it
    alone would keep the long text's angles for a short one."""
    settings = {"scaling": "dynamic_ntk", "scaling_factor": 4.0, "training_length": 8, "rotary_fraction": 0.5}
    pe = ours(16, **settings)
    x = torch.randn(1, 2, 40, 16)
    pe.rotate(x)  # past the training length: another base
    torch.testing.assert_close(pe.rotate(x[..., :8, :]), ours(16, **settings).rotate(x[..., :8, :]), atol=0, rtol=0)


# -- settings ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, d_model, n_heads, settings, message", [
    (RotaryPE, 128, 4, {"rotary_fraction": 0.1}, r"pe.rotary_fraction=0.1 rotates round\(0.1 x 32\) = 3 of the 32 dims "
                                                 r"of a head \(model.d_model/model.n_heads = 128/4\)"),
    (XPosPE, 32, 2, {"rotary_fraction": 0.05}, r"pe.rotary_fraction=0.05 rotates .* = 1 of the 16 dims.*model.d_model"),
    (RotaryPE, 32, 2, {"rotary_fraction": 1.5}, r"pe.rotary_fraction=1.5 must be a fraction in \(0, 1\] \(of each head's dims"),
    (RotaryPE, 32, 2, {"partial_rotary": "gptj"}, r"pe.partial_rotary=gptj must be one of \['neox', 'p_rope'\]"),
    (RotaryPE, 32, 2, {"scaling": "llama3"}, r"pe.scaling=llama3 needs pe.training_length"),
    (RotaryPE, 32, 2, {"scaling": "llama3", "training_length": 64, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     r"pe.low_freq_factor=4.0 and pe.high_freq_factor=1.0 must satisfy 0 < low < high"),
    (RotaryPE, 32, 2, {"yarn_ramp": "index"}, r"pe.yarn_ramp=index must be one of \['turns', 'dims'\]"),
    (RotaryPE, 32, 2, {"scaling": "ntk", "rotary_fraction": 0.125}, r"pe.scaling=ntk needs >= 4 rotating dims per head"),
])
def test_settings_that_cannot_work_are_one_line_naming_the_key(cls, d_model, n_heads, settings, message):
    with pytest.raises(ValueError, match=message) as raised:
        cls.check_settings(d_model=d_model, n_heads=n_heads, seq_len=64, **settings)
    assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match=message):
        cls(d_model=d_model, n_heads=n_heads, **settings)


def test_the_schema_knows_the_new_keys(tmp_path):
    from pe_geometry.training.schema import SchemaError, check_schema
    from tests.conftest import compose_train_config

    cfg = compose_train_config(["pe=rope", "pe.rotary_fraction=0.5", "pe.partial_rotary=p_rope", "pe.scaling=llama3"],
                               tmp_path)
    check_schema(cfg)
    assert (cfg.pe.low_freq_factor, cfg.pe.high_freq_factor, cfg.pe.yarn_ramp) == (1.0, 4.0, "turns")
    assert cfg.pe.training_length == cfg.data.seq_len
    with pytest.raises(SchemaError, match=r"pe.rotary_fraction=0 must be a fraction in \(0, 1\]"):
        check_schema(compose_train_config(["pe=xpos", "pe.rotary_fraction=0"], tmp_path))
    with pytest.raises(SchemaError, match=r"pe.partial_rotary=gptj must be one of \['neox', 'p_rope'\]"):
        check_schema(compose_train_config(["pe=rope", "pe.partial_rotary=gptj"], tmp_path))
