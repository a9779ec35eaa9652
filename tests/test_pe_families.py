"""The relative PE families (T5 bias, xPos, FIRE, Kerple, CoPE) and RoPE's inference scalings against independent
references: x-transformers with copied weights where it has the family, the paper's formula by hand elsewhere.

Plus the settings that cannot work are refused and those that do not fit the run are warned about. What every family
promises beyond its formula (a cached step places its tokens where a full pass does, every precision agrees, a scaling
loads weights trained without it): tests/test_encoding_conformance.py.
"""

from __future__ import annotations

import logging
import math
from typing import get_args

import pytest
import torch

from pe_geometry.model import CoPE, FirePE, KerplePE, RotaryPE, T5BiasPE, XPosPE
from pe_geometry.model.positional import ROPE_SCALINGS, t5_bucket, yarn_thresholds
from tests.loops import named

x_transformers = pytest.importorskip("x_transformers.x_transformers")

def qk(H: int = 2, T: int = 12, d_head: int = 8, seed: int = 0, B: int = 2, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, T, d_head, generator=g) * scale, torch.randn(B, H, T, d_head, generator=g) * scale


# -- T5 bias: x-transformers' RelativePositionBias --------------------------------------------------------------------
def test_t5_buckets_are_x_transformers_buckets():
    for causal in (True, False):
        with named(causal):
            relative = torch.arange(-400, 401)[None, :]
            ours = t5_bucket(relative, causal, num_buckets=32, max_distance=128)
            ref = x_transformers.RelativePositionBias._relative_position_bucket(relative, causal=causal, num_buckets=32, max_distance=128)
            assert torch.equal(ours, ref)
            assert ours.max() == 31 and len(ours.unique()) == (32 if causal else 31)  # bidirectional: bucket 16 (after, distance 0) unused


def test_t5_bias_is_x_transformers_relative_position_bias_unscaled():
    """Scale as T5: the bias is added to our logits as it is (x-transformers' scale=1, not its sqrt(d_head))."""
    for causal in (True, False):
        with named(causal):
            torch.manual_seed(0)
            ours = T5BiasPE(d_model=32, n_heads=4, num_buckets=16, max_distance=40)
            ours.causal = causal
            ref = x_transformers.RelativePositionBias(scale=1.0, causal=causal, num_buckets=16, max_distance=40, heads=4)
            with torch.no_grad():
                ref.relative_attention_bias.weight.copy_(torch.randn(16, 4))
                ours.relative_attention_bias.weight.copy_(ref.relative_attention_bias.weight)
                torch.testing.assert_close(ours.score_bias(90, 90), ref(90, 90))
                torch.testing.assert_close(ours.score_bias(3, 90, start_pos=87), ref(3, 90))  # cached queries: the last 3 of 90


# -- xPos and RoPE interpolation / NTK: x-transformers' RotaryEmbedding --------------------------------------------------
def reference_rotary(q, k, **options):
    ref = x_transformers.RotaryEmbedding(q.shape[-1], **options)
    freqs, scale = ref.forward_from_seq_len(q.shape[-2])
    k_scale = scale**-1.0 if torch.is_tensor(scale) else scale
    return x_transformers.apply_rotary_pos_emb(q, freqs, scale), x_transformers.apply_rotary_pos_emb(k, freqs, k_scale)


def test_xpos_qk_products_are_x_transformers_xpos():
    """Compared on q.k, where x-transformers' moving centre (max_pos // 2) and our fixed one cancel."""
    for T in (30, 61):
        with named(T):
            q, k = qk(T=T, d_head=8, scale=2.0)
            ours = XPosPE(d_model=16, n_heads=2, scale_base=16.0, training_length=64)  # a short scale base: a visible decay
            q_ref, k_ref = reference_rotary(q, k, use_xpos=True, scale_base=16)
            q_ours, k_ours = ours.rotate_qk(q, k)
            torch.testing.assert_close(q_ours @ k_ours.transpose(-2, -1), q_ref @ k_ref.transpose(-2, -1), atol=1e-4, rtol=1e-4)
            plain_q, plain_k = RotaryPE(d_model=16, n_heads=2).rotate_qk(q, k)
            assert not torch.allclose(q_ours @ k_ours.transpose(-2, -1), plain_q @ plain_k.transpose(-2, -1), atol=1e-2)


def test_xpos_centre_is_fixed_so_a_token_keeps_its_factor_as_the_text_grows():
    q, k = qk(T=40)
    ours = XPosPE(d_model=16, n_heads=2, scale_base=16.0, training_length=64)
    short, long = ours.rotate(k[..., :10, :], key=True), ours.rotate(k, key=True)[..., :10, :]
    torch.testing.assert_close(short, long)  # ours: position 5 is scaled alike in a text of 10 or 40 tokens
    ref_short, _ = reference_rotary(k[..., :10, :], k[..., :10, :], use_xpos=True, scale_base=16)
    ref_long, _ = reference_rotary(k, k, use_xpos=True, scale_base=16)
    assert not torch.allclose(ref_short, ref_long[..., :10, :])  # x-transformers' centre moves: its cached keys go stale


def test_rope_linear_scaling_is_x_transformers_interpolation_factor():
    q, k = qk(T=50)
    ours = RotaryPE(d_model=16, n_heads=2, scaling="linear", scaling_factor=4.0)
    q_ref, k_ref = reference_rotary(q, k, interpolation_factor=4.0)
    for a, b in zip(ours.rotate_qk(q, k), (q_ref, k_ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rope_ntk_scaling_is_x_transformers_base_rescale_factor():
    q, k = qk(T=50)
    ours = RotaryPE(d_model=16, n_heads=2, scaling="ntk", scaling_factor=4.0)
    q_ref, k_ref = reference_rotary(q, k, base_rescale_factor=4.0)
    for a, b in zip(ours.rotate_qk(q, k), (q_ref, k_ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours.rotate(q), RotaryPE(d_model=16, n_heads=2).rotate(q), atol=1e-3)


# -- CoPE: x-transformers' CoPE ---------------------------------------------------------------------------------------
def test_cope_is_x_transformers_cope():
    for q_len in (25, 4):  # a full pass, then the last 4 queries of a cached step
        with named(q_len):
            torch.manual_seed(0)
            H, T, d_head, p_max = 2, 25, 8, 6  # p_max below the length: the cap bites
            q, k = qk(H=H, T=T, d_head=d_head, scale=1.5)
            q = q[..., T - q_len :, :]
            ours = CoPE(d_model=H * d_head, n_heads=H, p_max=p_max)
            ref = x_transformers.CoPE(dim=d_head, heads=H, max_pos=p_max)
            with torch.no_grad():
                ref.pos_emb.copy_(torch.randn(p_max, d_head))
                ours.pos_emb.copy_(ref.pos_emb)
                logits = q @ k.transpose(-2, -1) / math.sqrt(d_head)
                visible = torch.ones(q_len, T, dtype=torch.bool).tril(T - q_len)
                expected = ref(q, logits.masked_fill(~visible, -torch.finfo(logits.dtype).max))
                got = ours.qk_bias(q, k, start_pos=T - q_len, causal=True)
            torch.testing.assert_close(got[..., visible], expected[..., visible], atol=1e-5, rtol=1e-5)
            assert got.abs().max() > 0.1


def test_bidirectional_cope_counts_gates_between_query_and_key_with_a_table_per_side():
    """Our extension for an encoder, by hand: p_ij = sum of the gates from min(i, j) to max(i, j)."""
    torch.manual_seed(0)
    H, T, d_head, p_max = 1, 7, 4, 5
    q, k = qk(H=H, T=T, d_head=d_head, B=1, scale=1.5)
    pe = CoPE(d_model=H * d_head, n_heads=H, p_max=p_max)
    pe.causal = False
    with torch.no_grad():
        pe.pos_emb.copy_(torch.randn(p_max, d_head))
        pe.pos_emb_after.copy_(torch.randn(p_max, d_head))
        got = pe.qk_bias(q, k, causal=False)[0, 0]
    gates = torch.sigmoid(q[0, 0] @ k[0, 0].T / math.sqrt(d_head))
    for i in range(T):
        for j in range(T):
            p = min(float(gates[i, min(i, j) : max(i, j) + 1].sum()), p_max - 1)
            table = pe.pos_emb if j <= i else pe.pos_emb_after
            lo, hi, w = math.floor(p), math.ceil(p), p - math.floor(p)
            expected = (1 - w) * float(q[0, 0, i] @ table[lo].detach()) + w * float(q[0, 0, i] @ table[hi].detach())
            assert got[i, j].item() == pytest.approx(expected, abs=1e-5)


# -- FIRE, Kerple, YaRN, dynamic NTK: the papers' formulas by hand -----------------------------------------------------
def test_fire_is_the_papers_formula():
    torch.manual_seed(0)
    pe = FirePE(d_model=16, n_heads=2, mlp_width=4, init_c=0.3, init_threshold=6.0)
    with torch.no_grad():
        pe.threshold_multiplier.fill_(-1.5)  # L = |m * init| = 9
        for p in pe.mlp.parameters():
            p.copy_(torch.randn_like(p))
        bias = pe.score_bias(11, 16, start_pos=5)  # queries 5..15: 5..8 normalised by L, 9.. by their own position
    W1, b1, W2, b2 = (p.tolist() for p in (pe.mlp[0].weight[:, 0], pe.mlp[0].bias, pe.mlp[2].weight, pe.mlp[2].bias))
    c, L = 0.3, 9.0

    def psi(x: float) -> float:
        return math.log(abs(c * x) + 1)

    for qi, i in enumerate(range(5, 16)):
        for j in range(16):
            x = psi(abs(i - j)) / (psi(max(L, i)) + 1e-6)
            hidden = [max(0.0, w * x + b) for w, b in zip(W1, b1)]
            for h in range(2):
                assert bias[h, qi, j].item() == pytest.approx(sum(w * a for w, a in zip(W2[h], hidden)) + b2[h], abs=1e-5)


def test_kerple_is_minus_r1_log_of_one_plus_r2_distance_with_a_floor():
    torch.manual_seed(0)
    pe = KerplePE(d_model=16, n_heads=2)
    with torch.no_grad():
        pe.r1_raw.copy_(torch.tensor([0.3, -50.0]))  # head 1: far below the floor
        pe.r2_raw.copy_(torch.tensor([-1.0, 2.0]))
    r1 = [0.01 + math.log1p(math.exp(0.3)), 0.01 + math.log1p(math.exp(-50.0))]
    r2 = [0.01 + math.log1p(math.exp(-1.0)), 0.01 + math.log1p(math.exp(2.0))]
    assert min(pe.r1.tolist() + pe.r2.tolist()) >= 0.01 - 1e-9  # (0.01 in float32)
    bias = pe.score_bias(3, 9, start_pos=6)
    for h in range(2):
        for qi, i in enumerate(range(6, 9)):
            for j in range(9):
                assert bias[h, qi, j].item() == pytest.approx(-r1[h] * math.log(1 + r2[h] * abs(i - j)), rel=1e-5, abs=1e-7)


def test_yarn_frequencies_and_attention_factor_by_hand():
    d_head, L, s, base = 16, 64, 4.0, 10000.0
    pe = RotaryPE(d_model=32, n_heads=2, scaling="yarn", scaling_factor=s, training_length=L)
    alpha, beta = L / 4096 * 1.0, L / 4096 * 32.0  # the rescaling rule, at base 10000: Llama's r thresholds times L / 4096
    assert (pe.yarn_alpha, pe.yarn_beta) == pytest.approx((alpha, beta))
    kept = interpolated = 0
    for i in range(d_head // 2):
        theta = base ** (-2 * i / d_head)
        r = L * theta / (2 * math.pi)
        gamma = min(1.0, max(0.0, (r - alpha) / (beta - alpha)))
        kept, interpolated = kept + (gamma == 1), interpolated + (gamma == 0)
        assert pe.frequencies(0)[i].item() == pytest.approx((1 - gamma) * theta / s + gamma * theta, rel=1e-12)
    assert kept >= 1 and interpolated >= 1  # the rescaled defaults leave some pairs as trained, as Llama's do at 4k
    mscale = 0.1 * math.log(s) + 1
    x = torch.zeros(40, d_head)
    x[:, 0] = 1.0
    out = pe.rotate(x)
    theta_0 = pe.frequencies(0)[0].item()
    for pos in (0, 7, 39):
        assert out[pos, :2].tolist() == pytest.approx([mscale * math.cos(pos * theta_0), mscale * math.sin(pos * theta_0)], abs=1e-5)
    assert yarn_thresholds(4096, 10000.0) == pytest.approx((1.0, 32.0))  # the reference point maps to itself


def test_dynamic_ntk_rescales_the_base_by_the_length_read():
    d_head, L, s = 8, 10, 2.0
    pe = RotaryPE(d_model=16, n_heads=2, scaling="dynamic_ntk", scaling_factor=s, training_length=L)
    plain = RotaryPE(d_model=16, n_heads=2)
    torch.testing.assert_close(pe.frequencies(L), plain.frequencies(L))
    for n in (11, 40):
        base = 10000.0 * (s * n / L - (s - 1)) ** (d_head / (d_head - 2))
        expected = [base ** (-2 * i / d_head) for i in range(d_head // 2)]
        assert pe.frequencies(n).tolist() == pytest.approx(expected, rel=1e-12)
    q, _ = qk(T=40, d_head=8)
    torch.testing.assert_close(pe.rotate(q[..., :10, :]), plain.rotate(q[..., :10, :]))  # within the training length: RoPE
    assert not torch.allclose(pe.rotate(q)[..., 5, :], pe.rotate(q[..., :10, :])[..., 5, :])  # the base of the whole text
    assert pe.cache_stays_exact(L) and not pe.cache_stays_exact(L + 1)


# -- settings: errors, warnings, schema -------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, settings, message", [
    (T5BiasPE, {"num_buckets": -2}, r"pe.num_buckets=-2 must be an integer >= 4"),
    (T5BiasPE, {"num_buckets": 32, "max_distance": 10}, r"pe.max_distance=10 must be larger"),
    (CoPE, {"p_max": 1}, r"pe.p_max=1 must be an integer >= 2"),
    (RotaryPE, {"scaling": "cubic"}, r"pe.scaling=cubic must be one of \['none', 'linear', 'ntk', 'dynamic_ntk', 'yarn', 'llama3'\]"),
    (RotaryPE, {"scaling": "yarn", "scaling_factor": 0.5}, r"pe.scaling_factor=0.5 must be a number >= 1"),
    (RotaryPE, {"scaling": "yarn", "training_length": None}, r"pe.scaling=yarn needs pe.training_length"),
    (XPosPE, {"gamma": 0.0}, r"pe.gamma=0.0 must be a number > 0"),
    (FirePE, {"init_threshold": 0.5}, r"pe.init_threshold=0.5 must be a number >= 1"),
])
def test_settings_that_cannot_work_are_one_line_naming_the_key(cls, settings, message):
    with pytest.raises(ValueError, match=message):
        cls.check_settings(d_model=32, n_heads=2, seq_len=64, **settings)


def test_settings_that_do_not_fit_the_run_are_warned_about():
    (t5,) = T5BiasPE.settings_warnings(32, 2, seq_len=64)
    assert "pe.num_buckets=32, pe.max_distance=128" in t5 and "5 causal (decoder)" in t5 and "4 bidirectional" in t5
    assert T5BiasPE.settings_warnings(32, 2, seq_len=64, max_distance=64) == []  # 64 tokens reach every bucket
    assert "pe.init_threshold=512 is above data.seq_len=64" in FirePE.settings_warnings(32, 2, 64, init_threshold=512.0)[0]
    assert FirePE.settings_warnings(32, 2, 64, init_threshold=64.0) == []
    assert "pe.p_max=128 is above data.seq_len=64" in CoPE.settings_warnings(32, 2, 64, p_max=128)[0]
    # gates start near 0.5, so a 64-token block counts to ~33: rows 34..63 of a 64-row table start without gradient
    (cope,) = CoPE.settings_warnings(32, 2, 64, p_max=64)
    assert "pe.p_max=64 is above what data.seq_len=64 fills at initialisation" in cope and "rows 34..63" in cope
    assert CoPE.settings_warnings(32, 2, 64, p_max=34) == [] and CoPE.settings_warnings(32, 2, 64) == []
    (xpos,) = XPosPE.settings_warnings(32, 2, 512, precision="16-mixed", scale_base=512.0, training_length=512)
    assert "overflows float16 past position" in xpos
    assert XPosPE.settings_warnings(32, 2, 512, precision="bf16-mixed") == []
    assert XPosPE.settings_warnings(32, 2, 64, precision="16-mixed", training_length=64) == []  # 16x 64 fits


def test_cope_defaults_to_the_papers_p_max_whatever_the_training_length(tmp_path):
    """p_max followed data.seq_len once (64 in the benchmark): a table the training block could not fill, read at 16x.
    The paper and x-transformers use 16; the config takes it from the settings dataclass, its one source."""
    from pe_geometry.settings.positional import CoPESettings
    from tests.conftest import compose_train_config

    cfg = compose_train_config(["pe=cope", "data.seq_len=64", "model.d_model=32", "model.n_heads=2"], tmp_path)
    assert cfg.pe.p_max == 16 == CoPESettings().p_max


def test_a_run_logs_each_warning_once_at_the_start(caplog, tmp_path):
    from pe_geometry.training.validate import check_positional_encoding
    from tests.conftest import compose_train_config

    cfg = compose_train_config(["pe=t5_bias", "data.seq_len=64", "model.d_model=32", "model.n_heads=2"], tmp_path)
    with caplog.at_level(logging.WARNING, logger="pe_geometry.training.validate"):
        check_positional_encoding(cfg)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["pe=t5_bias"]


def test_schema_types_the_new_settings_and_knows_every_scaling():
    from pe_geometry.settings import settings_of
    from pe_geometry.settings.base import fields_of
    from pe_geometry.training.schema import SchemaError, check_schema
    from tests.conftest import compose_train_config

    assert get_args(fields_of(settings_of("pe_geometry.model.RotaryPE"))["scaling"].annotation) == ROPE_SCALINGS
    with pytest.raises(SchemaError, match=r"pe.scaling=cubic must be one of \['none', 'linear'"):
        check_schema(compose_train_config(["pe=rope", "pe.scaling=cubic"]))
    with pytest.raises(SchemaError, match=r"pe.p_max=x must be an integer >= 2"):
        check_schema(compose_train_config(["pe=cope", "pe.p_max=x"]))
    with pytest.raises(SchemaError, match=r"pe.scaling is not a setting of pe=t5_bias"):
        check_schema(compose_train_config(["pe=t5_bias", "+pe.scaling=yarn"]), {"pe": "t5_bias"})
    cfg = compose_train_config(["pe=fire", "data.seq_len=48"])
    assert cfg.pe.init_threshold == 48  # the threshold starts at the training length
