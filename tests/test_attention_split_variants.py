"""The first-layer split under the attention variants stays exact: its terms sum to the logits the attention reads.

qk_norm scales each query's parts by tau_h sqrt(d_head) / |q_i| and each key's by 1 / |k_j| (so the key bias varies
along a row and counts), logn_scaling multiplies each query's parts by its factor, a window narrows the keys a query
sees, grouped-query attention repeats the shared key heads. That the terms sum to the logits the forward recorded, to
the scores recomputed from the weights and softmax to the explicit kernel's weights, and that the chunked split's
shares are the materialised terms', for every input-table encoding under every variant: tests/test_encoding_conformance.py
(``split``). Here: the qk_norm terms are the plain terms rescaled.
"""

from __future__ import annotations

import copy
from functools import partial

import torch

from pe_geometry.analysis.measures.attention_split import TERMS, first_layer_terms
from pe_geometry.model import DecoderLM, EncoderMLM, ExplicitAttention
from tests.loops import named
from tests.test_attention import build, live
from tests.test_position_attention import attention_inputs

T = 16  # tokens per sequence
VARIANTS = {"qk_norm": {"qk_norm": True}}
MODELS = {"decoder": DecoderLM, "encoder": EncoderMLM}


def perturbed(model_name: str, pe: str, variant: str, seed: int = 0) -> torch.nn.Module:
    """A one-block-deep model of the variant whose every bias term is live (``with_live_biases``), noise on the
    position table; in eval mode."""
    return with_live_biases(live(build(MODELS[model_name], pe, partial(ExplicitAttention, **VARIANTS[variant]))).eval(),
                            seed)


def with_live_biases(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A copy whose block-0 bias terms all count: large q/kv biases (b_K included), ln_attn's affine parameters far
    from (1, 0), per-head QK-norm temperatures apart."""
    model, g = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    block = model.blocks[0]
    with torch.no_grad():
        for param in (block.attn.q.bias, block.attn.kv.bias, block.ln_attn.bias):
            param.copy_(torch.randn(param.shape, generator=g))
        block.ln_attn.weight.copy_(1.0 + 0.5 * torch.randn(block.ln_attn.weight.shape, generator=g))
        if block.attn.qk_temperature is not None:
            block.attn.qk_temperature.copy_(torch.linspace(2.0, 12.0, block.attn.n_heads))
    return model


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 50, (3, T), generator=torch.Generator().manual_seed(seed))


def test_qk_norm_terms_are_the_plain_terms_rescaled_per_query_and_per_key():
    """Each qk_norm term is the plain split's term times s_i t_j (s_i = tau_h sqrt(d_head) / |q_i|, t_j = 1 / |k_j|):
    the norms are shared by every part, as the layer norm's 1/sigma, and the plain split is unchanged."""
    for model_name in MODELS:
        with named(model_name):
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
