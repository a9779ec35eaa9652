"""First-layer attention split: terms sum to the model's real scores; constructed heads with known answers."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pe_geometry.analysis.measures.attention_split import (
    POSITIONAL_TERMS,
    TERMS,
    attention_split,
    first_layer_attention_split,
    first_layer_terms,
    positional_heads,
    split_layernorm,
    term_shares,
)
from pe_geometry.model import DecoderLM, ExplicitAttention, LearnedPE
from tests.loops import named

D, T = 8, 6


def halves(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Word parts in dims 0..3 and position parts in dims 4..7: no term mixes them by accident."""
    g = torch.Generator().manual_seed(seed)
    e, p = torch.zeros(T, D, dtype=torch.float64), torch.zeros(T, D, dtype=torch.float64)
    e[:, :4] = torch.randn(T, 4, generator=g, dtype=torch.float64)
    p[:, 4:] = torch.randn(T, 4, generator=g, dtype=torch.float64)
    return e, p


def test_split_layernorm_sums_to_layer_norm():
    g = torch.Generator().manual_seed(25)
    e, p = torch.randn(2, 7, 16, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(2, 16, generator=g, dtype=torch.float64)
    e_part, p_part, b_part = split_layernorm(e, p, weight, bias, eps=1e-5)
    ref = F.layer_norm(e + p, (16,), weight, bias, eps=1e-5)
    torch.testing.assert_close(e_part + p_part + b_part, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close((e_part / weight).mean(-1), torch.zeros(7, dtype=torch.float64), rtol=0, atol=1e-12)
    naive = F.layer_norm(e, (16,), weight, bias) + F.layer_norm(p, (16,), weight)
    assert (naive - ref).abs().max() > 0.1  # normalising each part alone is not the same


def test_terms_sum_to_linear_layer_scores_and_keep_query_and_key_apart():
    """Brute force with nn.Linear (x @ W.T + b): the terms add up to the scores, and word_pos is query word x key position."""
    n_heads, d_head = 2, D // 2
    g = torch.Generator().manual_seed(29)
    e, p = torch.randn(2, T, D, generator=g, dtype=torch.float64)
    q_lin, k_lin = torch.nn.Linear(D, D).double(), torch.nn.Linear(D, D).double()
    terms = attention_split(e, p, q_lin.weight.T, k_lin.weight.T, q_lin.bias, k_lin.bias, n_heads=n_heads)
    assert set(terms) == set(TERMS)
    with torch.no_grad():
        q = q_lin(e + p).view(T, n_heads, d_head).transpose(0, 1)
        k = k_lin(e + p).view(T, n_heads, d_head).transpose(0, 1)
        q_e, k_p = (e @ q_lin.weight.T)[:, :d_head], (p @ k_lin.weight.T)[:, :d_head]
    torch.testing.assert_close(sum(terms.values()), q @ k.transpose(-2, -1) / math.sqrt(d_head), rtol=0, atol=1e-10)
    torch.testing.assert_close(terms["word_pos"][0], q_e @ k_p.T / math.sqrt(d_head))
    no_position = attention_split(e, torch.zeros(T, D, dtype=torch.float64), q_lin.weight.T, k_lin.weight.T,
                                  q_lin.bias, k_lin.bias, n_heads=n_heads)
    for name in ("pos_pos", "word_pos", "pos_word", "pos_bias"):
        assert no_position[name].abs().max() == 0, name


def test_each_head_gets_its_own_shares():
    """Head 0 reads only position dims, head 1 only word dims: head 0 alone is positional."""
    e, p = halves(30)
    g = torch.Generator().manual_seed(32)
    W_q, W_k = torch.zeros(2, D, D, dtype=torch.float64)
    W_q[4:, :4], W_k[4:, :4] = torch.randn(2, 4, 4, generator=g, dtype=torch.float64)  # head 0: position in, position out
    W_q[:4, 4:], W_k[:4, 4:] = torch.randn(2, 4, 4, generator=g, dtype=torch.float64)  # head 1: words
    shares = term_shares(attention_split(e, p, W_q, W_k, n_heads=2))
    torch.testing.assert_close(shares["pos_pos"], torch.tensor([1.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(shares["word_word"], torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert positional_heads(shares) == [0]


def test_key_position_bias_head_is_fully_positional():
    """q = b_Q only, k reads only the position dims: the score is b_Q . p_j W_K, all position."""
    e, p = halves()
    W_q = torch.zeros(D, D, dtype=torch.float64)
    W_k = torch.zeros(D, D, dtype=torch.float64)
    W_k[4:] = torch.randn(4, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    b_q = torch.ones(D, dtype=torch.float64)
    terms = attention_split(e, p, W_q, W_k, b_q, None, n_heads=2)
    for name in TERMS:
        if name != "pos_bias":
            assert terms[name].abs().max() == 0.0, name
    shares = term_shares(terms)
    torch.testing.assert_close(shares["pos_bias"], torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(shares["positional"], torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(shares["pos_pos"], torch.zeros(2, dtype=torch.float64))  # what a pos_pos-only count sees
    assert positional_heads(shares) == [0, 1]


def test_word_only_head_has_no_positional_share():
    e, p = halves(2)
    g = torch.Generator().manual_seed(3)
    W_q, W_k = torch.zeros(D, D, dtype=torch.float64), torch.zeros(D, D, dtype=torch.float64)
    W_q[:4], W_k[:4] = torch.randn(4, D, generator=g, dtype=torch.float64), torch.randn(4, D, generator=g, dtype=torch.float64)
    shares = term_shares(attention_split(e, p, W_q, W_k, n_heads=2))
    torch.testing.assert_close(shares["word_word"], torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(shares["positional"], torch.zeros(2, dtype=torch.float64))
    assert positional_heads(shares) == []


def test_query_side_bias_terms_cancel_along_keys():
    """e_i W_Q . b_K is constant along a query's row: it changes scores but no softmax, so its share is 0."""
    e, p = halves(4)
    W_q = torch.zeros(D, D, dtype=torch.float64)
    W_q[:4] = torch.randn(4, D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    W_k = torch.zeros(D, D, dtype=torch.float64)
    W_k[4:] = torch.eye(4, D, dtype=torch.float64)  # keys read position: word_pos is the only varying term
    b_k = torch.ones(D, dtype=torch.float64)
    terms = attention_split(e, p, W_q, W_k, None, b_k, n_heads=1)
    shares = term_shares(terms)
    assert terms["word_bias"].abs().max() > 0.1
    assert shares["word_bias"].abs().max() < 1e-12
    torch.testing.assert_close(shares["word_pos"], torch.ones(1, dtype=torch.float64))


def numpy_shares(S_terms: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    """Independent reference: covariance with the total score along visible keys, row by row."""
    S = sum(S_terms.values())
    out = {}
    for name, t in S_terms.items():
        cov, var = np.zeros(S.shape[0]), np.zeros(S.shape[0])
        for h in range(S.shape[0]):
            for i in range(S.shape[1]):
                keys = mask[i]
                s_row, t_row = S[h, i, keys], t[h, i, keys]
                cov[h] += np.sum((t_row - t_row.mean()) * (s_row - s_row.mean()))
                var[h] += np.sum((s_row - s_row.mean()) ** 2)
        out[name] = cov / var
    return out


def test_shares_match_a_numpy_loop_and_sum_to_one():
    g = torch.Generator().manual_seed(6)
    e, p = torch.randn(T, D, generator=g, dtype=torch.float64), torch.randn(T, D, generator=g, dtype=torch.float64)
    W_q, W_k = torch.randn(D, D, generator=g, dtype=torch.float64), torch.randn(D, D, generator=g, dtype=torch.float64)
    b_q, b_k = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    terms = attention_split(e, p, W_q, W_k, b_q, b_k, n_heads=2)
    shares = term_shares(terms, mask)
    ref = numpy_shares({k: v.numpy() for k, v in terms.items()}, mask.numpy())
    for name in TERMS:
        np.testing.assert_allclose(shares[name].numpy(), ref[name], atol=1e-10)
    np.testing.assert_allclose(sum(shares[name] for name in TERMS).numpy(), 1.0, atol=1e-12)
    np.testing.assert_allclose(shares["positional"].numpy(), sum(ref[n] for n in POSITIONAL_TERMS), atol=1e-10)


def test_terms_sum_to_the_real_first_layer_scores():
    """Brute force: the model's own LayerNorm and q/kv projections give the scores the terms must add up to."""
    for norm in ("pre", "post"):
        with named(norm):
            torch.manual_seed(0)
            model = DecoderLM(vocab_size=40, d_model=16, n_heads=2, n_layers=1, norm=norm, pe=LearnedPE, attention=ExplicitAttention).eval()
            with torch.no_grad():  # non-zero biases and LN affine parameters, so every bias term is exercised
                block = model.blocks[0]
                for param in (block.attn.q.bias, block.attn.kv.bias, block.ln_attn.weight, block.ln_attn.bias):
                    param.copy_(torch.randn_like(param) * 0.5 + (1.0 if param is block.ln_attn.weight else 0.0))
                idx = torch.randint(40, (3, 10))
                terms, mask = first_layer_terms(model, idx)
                x = model.input_stack.embed(idx)
                h = block.ln_attn(x) if norm == "pre" else x
                attn = block.attn
                q = attn.q(h).view(3, 10, 2, 8).transpose(1, 2)
                k = attn.kv(h).view(3, 10, 2, 2, 8).unbind(2)[0].transpose(1, 2)
                scores = (q @ k.transpose(-2, -1) / math.sqrt(8)).double()
                shares = first_layer_attention_split(model, idx)
            torch.testing.assert_close(sum(terms.values()), scores, atol=1e-5, rtol=1e-5)
            assert mask is not None and mask.equal(torch.ones(10, 10, dtype=torch.bool).tril())
            assert (terms["pos_bias"].abs().amax(dim=(-2, -1)) > 1e-3).all()  # the bias route exists in a real layer
            torch.testing.assert_close(sum(shares[name] for name in TERMS), torch.ones(2, dtype=torch.float64))


def test_split_shares_equal_the_materialised_terms_shares(monkeypatch):
    """first_layer_attention_split (no (T, T) term materialised, a few heads at a time) gives term_shares of the
    seven terms: to rounding in float64, to 1e-5 in float32 (its default), with biases and LN affine set."""
    for norm in ("pre", "post"):
        with named(norm):
            import pe_geometry.analysis.measures.attention_split as split

            torch.manual_seed(1)
            model = DecoderLM(vocab_size=40, d_model=24, n_heads=3, n_layers=1, norm=norm, pe=LearnedPE).eval()
            with torch.no_grad():
                block = model.blocks[0]
                for param in (block.attn.q.bias, block.attn.kv.bias, block.ln_attn.weight, block.ln_attn.bias):
                    param.copy_(torch.randn_like(param) * 0.5 + (1.0 if param is block.ln_attn.weight else 0.0))
                idx = torch.randint(40, (3, 12))
                reference = term_shares(*first_layer_terms(model, idx))
                monkeypatch.setattr(split, "_CHUNK_ELEMENTS", 2 * 12 * 12)  # two heads a chunk: 3 heads = chunks of 2 and 1
                in_float64 = first_layer_attention_split(model, idx, dtype=torch.float64)
                in_float32 = first_layer_attention_split(model, idx)
            assert in_float64.keys() == reference.keys()
            for name, share in reference.items():
                torch.testing.assert_close(in_float64[name], share, atol=1e-12, rtol=0)
                torch.testing.assert_close(in_float32[name], share, atol=1e-5, rtol=0)
            assert (reference["pos_bias"].abs() > 1e-3).any()  # the bias route is exercised


def test_a_split_that_drifts_from_the_forward_is_refused_and_a_shuffled_control_is_not_checked(monkeypatch):
    """The split's total is checked against the logits the forward recorded: a split reading a different position
    part than the forward (here: twice the table) raises, in both the materialised and the chunked path. Under
    pe.shuffle the forward reads the rows in a random order and the split the table in order: not checked."""
    from functools import partial

    import pe_geometry.analysis.measures.attention_split as split

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=40, d_model=16, n_heads=2, n_layers=1, pe=LearnedPE, attention=ExplicitAttention).eval()
    idx = torch.randint(40, (2, 10))
    real = split._first_layer_inputs

    def drifted(model, idx, recorded):
        args, kwargs = real(model, idx, recorded)
        return (args[0], 2 * args[1], *args[2:]), kwargs

    with torch.no_grad():
        first_layer_attention_split(model, idx)  # the real split passes its check
        monkeypatch.setattr(split, "_first_layer_inputs", drifted)
        for path in (first_layer_terms, first_layer_attention_split):
            with pytest.raises(ValueError, match="block 0's split terms.* do not add up to the logits the forward computed"):
                path(model, idx)
        monkeypatch.undo()
        shuffled = DecoderLM(vocab_size=40, d_model=16, n_heads=2, n_layers=1, pe=partial(LearnedPE, shuffle=True)).eval()
        state = torch.random.get_rng_state()
        shares = first_layer_attention_split(shuffled, idx)
        assert torch.random.get_rng_state().equal(state)  # the recording forward's row orders leave the RNG as it was
    torch.testing.assert_close(sum(shares[name] for name in TERMS), torch.ones(2, dtype=torch.float64))
