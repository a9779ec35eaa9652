"""The first-layer split under the attention variants stays exact: its terms sum to the logits the attention reads.

qk_norm scales each query's parts by tau_h sqrt(d_head) / |q_i| and each key's by 1 / |k_j| (so the key bias varies
along a row and counts), logn_scaling multiplies each query's parts by its factor, a window narrows the keys a query
sees, grouped-query attention repeats the shared key heads. References: the logits the forward recorded (its hook
points, model/attention.py), the scores recomputed from the weights and the weights the explicit kernel softmaxes.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import pe_geometry.analysis.attention_split as split
from pe_geometry.analysis.attention_split import TERMS, first_layer_attention_split, first_layer_terms, term_shares
from pe_geometry.model import DecoderLM, EncoderMLM, ExplicitAttention
from pe_geometry.model.transformer import record_attention
from tests.test_attention import build, live
from tests.test_position_attention import attention_inputs, rederived_score_parts

T = 16  # > the training length 6 below (logn factors above 1) and > the window 4 (a band, not the causal mask)
VARIANTS = {
    "qk_norm": {"qk_norm": True},
    "gqa": {"n_kv_heads": 2},
    "window": {"window": 4},
    "logn": {"logn_scaling": True, "training_length": 6},
    "all": {"n_kv_heads": 2, "qk_norm": True, "window": 4, "logn_scaling": True, "training_length": 6},
}
INPUT_TABLE_PES = ("sinusoidal", "learned")
MODELS = {"decoder": DecoderLM, "encoder": EncoderMLM}


def perturbed(model_name: str, pe: str, variant: str, seed: int = 0) -> torch.nn.Module:
    """A one-block-deep model of the variant whose every bias term is live: large q/kv biases (b_K included),
    ln_attn's affine parameters, per-head temperatures apart, noise on the position table; in eval mode."""
    model = live(build(MODELS[model_name], pe, partial(ExplicitAttention, **VARIANTS[variant]))).eval()
    block, g = model.blocks[0], torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in (block.attn.q.bias, block.attn.kv.bias, block.ln_attn.bias):
            param.copy_(torch.randn(param.shape, generator=g))
        block.ln_attn.weight.copy_(1.0 + 0.5 * torch.randn(block.ln_attn.weight.shape, generator=g))
        if block.attn.qk_temperature is not None:
            block.attn.qk_temperature.copy_(torch.linspace(2.0, 12.0, block.attn.n_heads))
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 50, (3, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("pe", INPUT_TABLE_PES)
def test_terms_sum_to_the_logits_the_attention_softmaxes(pe, model_name, variant):
    """sum(terms) == the logits the forward recorded and the scores recomputed from the weights (logn factor and
    qk_norm included), and with the returned mask it softmaxes to the weights the explicit kernel kept (the window's
    band, not the causal mask)."""
    model, idx = perturbed(model_name, pe, variant), tokens()
    attn, causal = model.blocks[0].attn, model.input_stack.causal
    attn.keep_weights = True
    with torch.no_grad():
        terms, mask = first_layer_terms(model, idx)
        x = next(attention_inputs(model, idx))
        content, position = rederived_score_parts(attn, x, causal)
        with record_attention(model, [0]) as record:
            model(idx)
    total = sum(terms.values())
    assert total.dtype == torch.float64 and total.shape == (3, attn.n_heads, T, T)
    torch.testing.assert_close(total, (content + position).double(), atol=2e-5, rtol=1e-5)
    visible = attn.visible_keys_mask(T, causal)
    assert (mask is None and bool(visible.all())) or mask.equal(visible)
    recorded = record[0]["logits"].double()
    torch.testing.assert_close(total.masked_fill(~visible, float("-inf")), recorded, atol=2e-5, rtol=1e-5)
    logits = total if mask is None else total.masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(logits.softmax(dim=-1), attn.attn_weights.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("pe", INPUT_TABLE_PES)
def test_split_shares_equal_the_materialised_terms_shares(pe, model_name, variant, monkeypatch):
    """first_layer_attention_split (no (T, T) term built, a few heads at a time; under qk_norm with the key bias
    counted) is term_shares of the seven terms: to 1e-10 in float64, 2e-6 in float32; the shares sum to 1."""
    model, idx = perturbed(model_name, pe, variant), tokens()
    n_heads = model.blocks[0].attn.n_heads
    with torch.no_grad():
        reference = term_shares(*first_layer_terms(model, idx))
        monkeypatch.setattr(split, "_CHUNK_ELEMENTS", 3 * T * T)  # three heads a chunk: 4 heads = chunks of 3 and 1
        in_float64 = first_layer_attention_split(model, idx, dtype=torch.float64)
        in_float32 = first_layer_attention_split(model, idx)
    assert in_float64.keys() == reference.keys()
    for name, share in reference.items():
        torch.testing.assert_close(in_float64[name], share, atol=1e-10, rtol=0)
        torch.testing.assert_close(in_float32[name], share, atol=2e-6, rtol=0)
    one = torch.ones(n_heads, dtype=torch.float64)
    for shares in (reference, in_float64, in_float32):
        torch.testing.assert_close(sum(shares[name] for name in TERMS), one, atol=1e-10, rtol=0)
    if VARIANTS[variant].get("qk_norm"):  # t_j b_K varies along a row: the key-bias terms move the softmax
        assert (reference["bias_bias"].abs() > 1e-3).any()
    else:  # b_Q . b_K is constant along every row
        torch.testing.assert_close(reference["bias_bias"], torch.zeros(n_heads, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_qk_norm_terms_are_the_plain_terms_rescaled_per_query_and_per_key(model_name):
    """Each qk_norm term is the plain split's term times s_i t_j (s_i = tau_h sqrt(d_head) / |q_i|, t_j = 1 / |k_j|):
    the norms are shared by every part, as the layer norm's 1/sigma, and the plain split is unchanged."""
    normed, idx = perturbed(model_name, "learned", "qk_norm"), tokens()
    plain = build(MODELS[model_name], "learned", ExplicitAttention).eval()
    plain.load_state_dict(normed.state_dict(), strict=False)  # qk_norm's temperature is its own
    attn = normed.blocks[0].attn
    with torch.no_grad():
        plain_terms, _ = first_layer_terms(plain, idx)
        normed_terms, _ = first_layer_terms(normed, idx)
        x = next(attention_inputs(normed, idx)).double()
        q = (x @ attn.q.weight.double().T + attn.q.bias.double()).view(3, T, 4, -1).transpose(1, 2)
        k = (x @ attn.kv.weight[: attn.q.weight.shape[0]].double().T + attn.b_K.double().reshape(-1)).view(3, T, 4, -1)
        k = k.transpose(1, 2)
    s = attn.qk_temperature.double()[:, None, None] * attn.d_head**0.5 / q.norm(dim=-1, keepdim=True)
    t = 1.0 / k.norm(dim=-1)[..., None, :]
    for name in TERMS:
        torch.testing.assert_close(normed_terms[name], plain_terms[name] * s * t, atol=1e-6, rtol=1e-6)  # x: the float32 LN
