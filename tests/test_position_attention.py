"""Every family on one axis (analysis.position_attention): block 0's positional score share and each head's mean
attention distance, checked against hand computations here. The references the conformance suite
(tests/test_encoding_conformance.py, ``score_parts`` and ``figures``) checks every encoding against live here too: the
figures as they were computed before the analysis read the forward's hook points (``rederived_score_parts``: the
scores recomputed from the weights, ``figures_as_before``) and the score parts softmaxing to the kept weights."""

from __future__ import annotations

import math

import pytest
import torch

from pe_geometry.analysis.measures import position_attention as pa
from pe_geometry.analysis.measures.attention_split import first_layer_attention_split, recorded_attention
from pe_geometry.model import DecoderLM, EncoderMLM, ExplicitAttention
from pe_geometry.model.positional import alibi_slopes
from pe_geometry.model.transformer import record_attention
from tests.test_attention import build

T = 16


def tokens(B: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 50, (B, T), generator=torch.Generator().manual_seed(seed))


def attention_inputs(model, idx: torch.Tensor):
    """What each block's self-attention reads on token blocks idx (B, T): its input, after ln_attn in a pre-LN block."""
    for block, x in zip(model.blocks, model.iter_hidden_states(idx)):
        yield block.ln_attn(x) if block.norm == "pre" else x


def rederived_score_parts(attn, x: torch.Tensor, causal: bool, mix: torch.Tensor | None = None):
    """content, position of a self-attention on its input x, recomputed from the weights and the encoding's hooks:
    how the analysis computed them before it read the forward's recorded points (the reference they must equal)."""
    T = x.shape[1]
    q = attn._queries(x)
    k = attn._per_query_head(attn._keys_values(x)[0], dim=1)
    if mix is not None:
        q, k = q @ mix.to(q.dtype), k @ mix.to(k.dtype)
    scale = 1.0 / math.sqrt(attn.d_head)
    content = (q @ k.transpose(-2, -1)).float() * scale
    q, k = attn.pe.rotate_qk(q, k, 0)
    position = (q @ k.transpose(-2, -1)).float() * scale - content
    for bias in (attn.pe.score_bias(T, T, 0), attn.pe.qk_bias(q, k, 0, causal)):
        if bias is not None:
            position = position + bias.float()
    gates = attn.pe.input_gates(x, attn.pe_layer)  # a data-dependent encoding's (FoX): read from the layer input x
    if gates is not None:
        position = position + attn.pe.gate_bias(gates, T, causal)
    factor = attn._logn_factor(T, 0, causal, x.device)
    if factor is not None:
        content, position = content * factor, position * factor
    return content, position


def assert_score_parts_softmax_to_kept_weights(model, idx: torch.Tensor) -> None:
    """score_parts' content + position from every block's recorded points, masked with the layer's visible keys,
    softmax to the weights the explicit path kept and equal the recorded logits and the parts recomputed from the
    weights, in every block (the conformance suite runs it for every encoding under every attention variant)."""
    for block in model.blocks:
        block.attn.keep_weights = True
    causal = model.input_stack.causal
    with torch.no_grad():
        with record_attention(model) as record:
            model.input_stack(idx)
        for i, (block, x) in enumerate(zip(model.blocks, attention_inputs(model, idx))):
            mask = pa._mask(model, idx.shape[1], idx.device, i)  # (a layer pattern: each layer's own window)
            content, position = pa.score_parts(block.attn, record[i])
            logits = (content + position).masked_fill(~mask, float("-inf"))
            torch.testing.assert_close(logits, record[i]["logits"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits.softmax(dim=-1), block.attn.attn_weights, atol=1e-5, rtol=1e-5)
            for ours, before in zip((content, position), rederived_score_parts(block.attn, x, causal)):
                torch.testing.assert_close(ours, before, atol=1e-5, rtol=1e-5)


def figures_as_before(model, idx: torch.Tensor, mix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block 0's relative positional share (H,), mean distance (n_layers, H)) computed as before the analysis read
    the recorded points: from each block's input and the weights (rederived_score_parts)."""
    causal, mask = model.input_stack.causal, pa._mask(model, idx.shape[1], idx.device)  # block 0's
    positions = torch.arange(idx.shape[1], dtype=torch.float64)
    distance = (positions[:, None] - positions[None, :]).abs()
    inputs = list(attention_inputs(model, idx))
    cov = var = 0.0
    for one in inputs[0].split(1):
        c, v = pa._share_sums(*rederived_score_parts(model.blocks[0].attn, one, causal, mix), mask)
        cov, var = cov + c, var + v
    out = []
    for block, x in zip(model.blocks, inputs):
        total, visible = 0.0, block.attn.visible_keys_mask(idx.shape[1], causal)  # each block's own window
        for one in x.split(1):
            content, position = rederived_score_parts(block.attn, one, causal)
            weights = (content + position).double().masked_fill(~visible, float("-inf")).softmax(dim=-1)
            total = total + (weights * distance).sum(dim=-1).mean(dim=-1).sum(dim=0)
        out.append(total / idx.shape[0])
    return cov / var, torch.stack(out)


def test_alibi_share_is_the_hand_computed_covariance_of_its_bias():
    """ALiBi's position term is -slope (i - j); its share = sum(bias * S_c) / sum(S_c^2) with S_c row-centred over j <= i."""
    model = build(DecoderLM, "alibi", ExplicitAttention).eval()
    idx = tokens()
    with torch.no_grad():
        content, _ = pa.score_parts(model.blocks[0].attn, recorded_attention(model, idx)[0])
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
    mix = pa.haar_orthogonal(4, 8, torch.Generator().manual_seed(1)).float()
    torch.testing.assert_close(mix @ mix.transpose(-2, -1), torch.eye(8).expand(4, 8, 8), atol=1e-6, rtol=0)
    attn = model.blocks[0].attn
    with torch.no_grad():
        recorded = recorded_attention(model, tokens())[0]
        content, position = pa.score_parts(attn, recorded)
        mixed_content, mixed_position = pa.score_parts(attn, recorded, mix=mix)
        x = next(attention_inputs(model, tokens()))
        for ours, before in zip((mixed_content, mixed_position), rederived_score_parts(attn, x, True, mix)):
            torch.testing.assert_close(ours, before, atol=1e-5, rtol=1e-5)
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


def test_a_shuffled_control_draws_the_row_orders_it_drew_before():
    """pe.shuffle: every forward draws its row orders. The recording forward of block 0's split leaves the RNG as it
    found it, so the mean distance after the split reads the orders it read when the split ran no forward."""
    from functools import partial

    from pe_geometry.model import LearnedPE

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=2, pe=partial(LearnedPE, shuffle=True)).eval()
    idx = tokens()
    with torch.no_grad():
        torch.manual_seed(5)
        _, before = figures_as_before(model, idx)
        torch.manual_seed(5)
        first_layer_attention_split(model, idx)
        after, _ = pa.mean_attention_distance(model, idx)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
