"""The attention's hook points (model/attention.py, ``record_attention``): what they hold is what the forward computed.

The recorded logits are checked here against scores written out by hand from the weights (plain attention, ALiBi's
slopes, the log-length factor); recording changes no output and is gone after the ``with``. For every encoding and
attention variant (tests/test_encoding_conformance.py, ``recorded``, with ``from_points`` below): q and k after the
encoding, the score bias and the query scale add up to the logits, both kernels record them, the explicit kernel
softmaxes them, and a cached step records the last rows of a full pass.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM, ExplicitAttention, SDPAttention
from pe_geometry.model.attention import attention_mask
from pe_geometry.model.positional import alibi_slopes
from pe_geometry.model.transformer import record_attention
from tests.test_attention import build, live

T = 12


def tokens(B: int = 2, length: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 50, (B, length), generator=torch.Generator().manual_seed(seed))


def recorded(model, idx: torch.Tensor, **kw) -> dict:
    with torch.no_grad(), record_attention(model, **kw) as record:
        model.input_stack(idx)
    return record


def from_points(attn, points: dict, causal: bool) -> torch.Tensor:
    """The logits as the recorded q, k, score bias and query scale give them: (q . k / sqrt(d_head) + bias) x scale,
    -inf where the layer's mask hides a key."""
    k = attn._per_query_head(points["k"], dim=1)
    logits = points["q"] @ k.transpose(-2, -1) / math.sqrt(attn.d_head)
    if points["score_bias"] is not None:
        logits = logits + points["score_bias"]
    if points["query_scale"] is not None:
        logits = logits * points["query_scale"]
    return logits.masked_fill(~attn.visible_keys_mask(logits.shape[-1], causal), float("-inf"))


@pytest.mark.parametrize("model_cls", [DecoderLM, EncoderMLM])
def test_recorded_logits_are_the_scores_written_out_by_hand(model_cls):
    """Sinusoidal (its table in the input, no hook in the attention): q k^T / sqrt(d_head) of the block's input,
    masked causally in a decoder; ALiBi: plus -slope_h |i - j|; with logn_scaling, times max(1, log n / log 6)."""
    idx = tokens()
    for pe, kw in (("sinusoidal", {}), ("alibi", {}), ("alibi", {"logn_scaling": True, "training_length": 6})):
        model = build(model_cls, pe, partial(ExplicitAttention, **kw)).eval()
        attn, block, causal = model.blocks[0].attn, model.blocks[0], model.input_stack.causal
        with torch.no_grad():
            x = block.ln_attn(model.input_stack.embed(idx))
            q = (x @ attn.q.weight.T + attn.q.bias).view(2, T, 4, 8).transpose(1, 2)
            k = (x @ attn.kv.weight[:32].T + attn.kv.bias[:32]).view(2, T, 4, 8).transpose(1, 2)
            expected = q @ k.transpose(-2, -1) / math.sqrt(8)
        i = torch.arange(T, dtype=torch.float32)
        if pe == "alibi":
            expected = expected - alibi_slopes(4)[:, None, None] * (i[:, None] - i[None, :]).abs()
        if kw:
            n = i + 1 if causal else torch.full((T,), float(T))
            expected = expected * (n.log() / math.log(6)).clamp(min=1.0)[:, None]
        if causal:
            expected = expected.masked_fill(~attention_mask(T, T, True), float("-inf"))
        torch.testing.assert_close(recorded(model, idx)[0]["logits"], expected, atol=1e-5, rtol=1e-5)


def test_recording_changes_no_output_and_is_gone_after_the_with():
    idx = tokens()
    for model_cls in (DecoderLM, EncoderDecoder):
        for kernel in (ExplicitAttention, SDPAttention):
            model = live(build(model_cls, "rope", kernel)).eval()
            args = (idx[:, :5], idx[:, 5:]) if model_cls is EncoderDecoder else (idx,)
            with torch.no_grad():
                before = model(*args)
                with record_attention(model) as record:
                    during = model(*args)
                after = model(*args)
            assert before.equal(during) and before.equal(after)
            assert set(record) == set(range(len(model.blocks))) and all(r["logits"] is not None for r in record.values())
            assert all(m.recording is None for m in model.modules() if hasattr(m, "recording"))


def test_blocks_and_points_choose_what_is_kept_and_an_enclosing_recording_comes_back():
    model = build(DecoderLM, "alibi", SDPAttention).eval()
    idx = tokens()
    with torch.no_grad(), record_attention(model) as outer:
        with record_attention(model, blocks=[1], points=("logits",)) as inner:
            model(idx)
        assert list(inner) == [1] and list(inner[1]) == ["logits"] and inner[1]["logits"] is not None
        assert outer[1]["logits"] is None  # the inner recording had block 1
        model(idx)
    assert outer[1]["logits"] is not None and outer[0]["score_bias"] is not None
    with pytest.raises(ValueError, match=r"unknown attention point\(s\) \['scores'\]; valid: \['q_pre'"):
        with record_attention(model, points=("scores",)):
            pass
