"""Every family on one axis (analysis.position_attention): block 0's positional score share and each head's mean
attention distance, checked against the attention's own weights and hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.analysis import position_attention as pa
from pe_geometry.analysis.attention_split import first_layer_attention_split
from pe_geometry.model import DecoderLM, EncoderMLM, ExplicitAttention
from pe_geometry.model.positional import alibi_slopes
from tests.conftest import PE_TYPES
from tests.test_attention import build, live

T = 16


def tokens(B: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 50, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("pe", PE_TYPES)
@pytest.mark.parametrize("model_cls", [DecoderLM, EncoderMLM])
def test_content_plus_position_are_the_logits_the_attention_softmaxes(pe, model_cls):
    """softmax(content + position) over the visible keys is the explicit path's kept weights, in every block."""
    assert_score_parts_softmax_to_kept_weights(live(build(model_cls, pe, ExplicitAttention)).eval(), tokens())


def assert_score_parts_softmax_to_kept_weights(model, idx: torch.Tensor) -> None:
    """score_parts' content + position, masked with the layer's visible keys, softmax to the weights the explicit path
    kept, in every block (test_attention_variants runs it under every attention variant too)."""
    for block in model.blocks:
        block.attn.keep_weights = True
    with torch.no_grad():
        model(idx)
        mask = pa._mask(model, idx.shape[1], idx.device)
        for block, x in zip(model.blocks, pa.attention_inputs(model, idx)):
            content, position = block.attn.score_parts(x, causal=model.input_stack.causal)
            weights = (content + position).masked_fill(~mask, float("-inf")).softmax(dim=-1)
            torch.testing.assert_close(weights, block.attn.attn_weights, atol=1e-5, rtol=1e-5)


def test_alibi_share_is_the_hand_computed_covariance_of_its_bias():
    """ALiBi's position term is -slope (i - j); its share = sum(bias * S_c) / sum(S_c^2) with S_c row-centred over j <= i."""
    model = build(DecoderLM, "alibi", ExplicitAttention).eval()
    idx = tokens()
    with torch.no_grad():
        x = next(pa.attention_inputs(model, idx))
        content, _ = model.blocks[0].attn.score_parts(x, causal=True)
        share = pa.relative_position_shares(model, idx)
    i = torch.arange(T, dtype=torch.float64)
    bias = -alibi_slopes(4).double()[:, None, None] * (i[:, None] - i[None, :])  # (H, T, T), used where j <= i
    expected = []
    for h in range(4):
        cov = var = 0.0
        for b in range(idx.shape[0]):
            for q in range(T):
                s = content[b, h, q, : q + 1].double() + bias[h, q, : q + 1]
                s_c = s - s.mean()
                cov += float((bias[h, q, : q + 1] * s_c).sum())
                var += float((s_c * s_c).sum())
        expected.append(cov / var)
    torch.testing.assert_close(share, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    assert (share > 0.5).all()  # an untrained model's content scores are small beside the slopes at distance up to 15


def test_nope_has_no_position_term_and_sinusoidal_uses_the_additive_split():
    idx = tokens()
    with torch.no_grad():
        nope = build(DecoderLM, "none", ExplicitAttention).eval()
        assert torch.equal(pa.positional_share(nope, idx), torch.zeros(4, dtype=torch.float64))
        additive = build(DecoderLM, "sinusoidal", ExplicitAttention).eval()
        torch.testing.assert_close(pa.positional_share(additive, idx), first_layer_attention_split(additive, idx)["positional"])


def test_a_random_orthogonal_mix_keeps_every_content_score_and_moves_the_rotation_term():
    model = build(DecoderLM, "rope", ExplicitAttention).eval()
    x = next(pa.attention_inputs(model, tokens()))
    mix = pa.haar_orthogonal(4, 8, torch.Generator().manual_seed(1)).float()
    torch.testing.assert_close(mix @ mix.transpose(-2, -1), torch.eye(8).expand(4, 8, 8), atol=1e-6, rtol=0)
    with torch.no_grad():
        content, position = model.blocks[0].attn.score_parts(x, causal=True)
        mixed_content, mixed_position = model.blocks[0].attn.score_parts(x, causal=True, mix=mix)
    torch.testing.assert_close(mixed_content, content, atol=1e-5, rtol=1e-5)
    assert (mixed_position - position).abs().max() > 1e-2


def test_the_rotation_null_holds_an_untrained_head_and_moves_a_head_on_the_slowest_pair():
    """An untrained head (random directions) sits inside its null. q and k only in RoPE's slowest-turning pair
    barely rotate over 16 positions: a share near 0, while the null, which spreads the same q.k over every pair,
    moves (a null that forgot to mix would have no spread)."""
    model = build(DecoderLM, "rope", ExplicitAttention).eval()
    idx = tokens()
    with torch.no_grad():
        untrained = pa.relative_position_shares(model, idx)
        draws = pa.rotation_share_draws(model, idx, n_draws=30)
        assert draws.shape == (30, 4)
        assert ((untrained - draws.mean(dim=0)).abs() < 4 * draws.std(dim=0)).all()
        torch.testing.assert_close(pa.rotation_share_draws(model, idx, n_draws=30), draws)  # seeded
        d_head, attn = 8, model.blocks[0].attn
        keep = torch.zeros(d_head)
        keep[d_head - 2 :] = 1.0  # the last pair: the lowest frequency
        for weight, bias in ((attn.q.weight, attn.q.bias), (attn.kv.weight[:32], attn.kv.bias[:32])):
            weight.view(4, d_head, -1).mul_(keep[None, :, None])  # (heads, d_head, d_model): output dims per head
            bias.view(4, d_head).mul_(keep)
        slow = pa.relative_position_shares(model, idx)
        draws = pa.rotation_share_draws(model, idx, n_draws=30)
    assert (slow.abs() < 0.01).all()
    assert (draws.std(dim=0) > 0.03).all()


def test_mean_distance_of_uniform_attention_is_its_chance_and_alibi_is_local():
    """Zero query weights give uniform attention over the visible keys: distance = chance = mean_i i/2 causal,
    (T^2 - 1) / (3 T) bidirectional. ALiBi with zero content: the hand sum of d exp(-slope d), normalised."""
    idx = tokens()
    for model_cls, chance in ((DecoderLM, (T - 1) / 4), (EncoderMLM, (T * T - 1) / (3 * T))):
        model = build(model_cls, "none", ExplicitAttention).eval()
        with torch.no_grad():
            for block in model.blocks:
                block.attn.q.weight.zero_()
                block.attn.q.bias.zero_()
            distance, baseline = pa.mean_attention_distance(model, idx)
        assert distance.shape == (2, 4)
        assert math.isclose(float(baseline[0, 0]), chance, rel_tol=1e-12)
        torch.testing.assert_close(distance, baseline, atol=1e-9, rtol=0)
    alibi = build(DecoderLM, "alibi", ExplicitAttention).eval()
    with torch.no_grad():
        alibi.blocks[0].attn.q.weight.zero_()
        alibi.blocks[0].attn.q.bias.zero_()
        distance, _ = pa.mean_attention_distance(alibi, idx)
    for h, slope in enumerate(alibi_slopes(4).tolist()):  # zero content: weights exp(-slope d) over d = 0 .. i
        by_query = []
        for i in range(T):
            w = [math.exp(-slope * d) for d in range(i + 1)]
            by_query.append(sum(d * x for d, x in enumerate(w)) / sum(w))
        assert math.isclose(float(distance[0, h]), sum(by_query) / T, rel_tol=1e-9)
    assert distance[0, 0] < 0.6 * (T - 1) / 4  # the steepest head looks closer than chance


def test_the_report_holds_both_figures_with_the_null_only_for_a_rotation():
    idx = tokens()
    rope = pa.position_attention_report(build(DecoderLM, "rope", ExplicitAttention).eval(), idx, n_draws=5)
    alibi = pa.position_attention_report(build(EncoderMLM, "alibi", ExplicitAttention).eval(), idx, n_draws=5)
    assert len(rope["positional_share"]) == 4 and len(rope["null_mean"]) == 4 and len(rope["null_std"]) == 4
    assert "null_mean" not in alibi
    assert [len(row) for row in rope["mean_distance"]] == [4, 4]
    assert rope["distance_chance"] == [pytest.approx((T - 1) / 4)] * 2
    assert alibi["distance_chance"] == [pytest.approx((T * T - 1) / (3 * T))] * 2
