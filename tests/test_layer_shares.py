"""Every block's positional share (analysis.position_attention.layer_positional_shares, the report's
``positional_share_layers``): block 0's figure, block by block, checked against block 0's own function, against the
scores recomputed from each block's weights over a hand-built mask, and against two values derived by hand (a NoPE
layer adds nothing: 0; an ALiBi layer whose queries are zero scores its bias alone: 1). Every encoding's blocks
against ``shares_from_weights``: tests/test_encoding_conformance.py (``figures``)."""

from __future__ import annotations

import pytest
import torch

from pe_geometry.analysis.measures import position_attention as pa
from pe_geometry.model import DecoderLM, EncoderMLM, ExplicitAttention
from tests.loops import named
from tests.test_attention import build, pe_factory
from tests.test_position_attention import attention_inputs, rederived_score_parts, tokens

LOCAL_GLOBAL = [{"window": 4, "pe": {"base": 10000.0}}, {"window": None, "pe": {"base": 1e6}}]


def patterned(pe: str, pattern, model_cls=DecoderLM, n_layers: int = 2):
    torch.manual_seed(0)
    extra = {"mask_token_id": 1} if model_cls is EncoderMLM else {}
    return model_cls(vocab_size=50, d_model=32, n_heads=4, n_layers=n_layers, pe=pe_factory(pe),
                     attention=ExplicitAttention, layer_pattern=pattern, **extra).eval()


def hand_mask(T: int, causal: bool, window: int | None) -> torch.Tensor:
    """Query i sees key j: j <= i when causal, and |i - j| < window with a window."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) if causal else torch.ones(T, T, dtype=torch.bool)
    return visible & ((i - j).abs() < window) if window is not None else visible


def shares_from_weights(model, idx: torch.Tensor, windows: list | None = None) -> torch.Tensor:
    """(n_layers, H): each block's share recomputed from its input and weights (rederived_score_parts), over the
    mask built by hand from its window (or ``windows[i]``), with the covariance estimator written out."""
    causal, T, rows = model.input_stack.causal, idx.shape[1], []
    for i, (block, x) in enumerate(zip(model.blocks, attention_inputs(model, idx))):
        mask = hand_mask(T, causal, block.attn.window if windows is None else windows[i])
        content, position = rederived_score_parts(block.attn, x, causal)
        S = (content + position).double()
        n = mask.sum(dim=-1, keepdim=True)
        S_c = torch.where(mask, S - torch.where(mask, S, 0.0).sum(dim=-1, keepdim=True) / n, 0.0)
        rows.append((position.double() * S_c).sum(dim=(0, 2, 3)) / (S_c * S_c).sum(dim=(0, 2, 3)))
    return torch.stack(rows)


def test_each_layer_of_a_pattern_is_read_over_its_own_window_and_base():
    """A 4-token window then a global layer: each block's share over the keys its own queries see."""
    for model_cls in (DecoderLM, EncoderMLM):
        with named(model_cls.__name__):
            model, idx = patterned("rope", LOCAL_GLOBAL, model_cls), tokens()
            with torch.no_grad():
                shares = pa.layer_positional_shares(model, idx)
                torch.testing.assert_close(shares, shares_from_weights(model, idx), atol=1e-6, rtol=1e-6)
                block0_mask = shares_from_weights(model, idx, windows=[4, 4])  # block 1 read over block 0's window: not it
            assert (shares[1] - block0_mask[1]).abs().max() > 1e-3


def test_a_nope_layer_adds_nothing_and_an_alibi_layer_with_zero_queries_is_all_position():
    """Hand values. model.layer_pattern=[{}, {pe: none}]: layer 1's q.k is its content, position 0 exactly: share 0.
    ALiBi with layer 1's queries zeroed: content 0, so S = b (the bias) and Cov(b, S) / Var(S) = Var(b) / Var(b) = 1."""
    idx = tokens()
    with torch.no_grad():
        rope_nope = patterned("rope", [{}, {"pe": "none"}])
        shares = pa.layer_positional_shares(rope_nope, idx)
        assert torch.equal(shares[1], torch.zeros(4, dtype=torch.float64))
        assert (shares[0].abs() > 1e-3).all()  # block 0 rotates: a share of its own
        alibi = build(DecoderLM, "alibi", ExplicitAttention).eval()
        alibi.blocks[1].attn.q.weight.zero_()
        alibi.blocks[1].attn.q.bias.zero_()
        shares = pa.layer_positional_shares(alibi, idx)
    torch.testing.assert_close(shares[1], torch.ones(4, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (shares[0] - 1).abs().max() > 1e-2  # block 0's content, not zeroed, moves its share off 1


def test_the_report_adds_every_layers_share_and_the_benchmarks_reader_still_reads_it():
    from pe_geometry.benchmarks.extrapolation_scoring import summarise_attention

    idx = tokens()
    rope = pa.position_attention_report(patterned("rope", LOCAL_GLOBAL, n_layers=4), idx, n_draws=2)
    learned = pa.position_attention_report(build(DecoderLM, "learned", ExplicitAttention).eval(), idx, n_draws=2)
    assert [len(row) for row in rope["positional_share_layers"]] == [4] * 4
    assert rope["positional_share_layers"][0] == pytest.approx(rope["positional_share"], abs=1e-12)
    assert learned["positional_share_layers"][1:] == [None]
    assert learned["positional_share_layers"][0] == pytest.approx(learned["positional_share"], abs=1e-12)
    summary = summarise_attention([rope, rope])
    assert summary["positional_share"]["mean"] == pytest.approx(sum(rope["positional_share"]) / 4)
    assert len(summary["distance_ratio"]) == 4
