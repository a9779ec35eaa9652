"""Attention against torch's own module and hand-written heads; the layouts' weights, losses and splits.

``build``, ``live`` and ``pe_factory`` build the tests' models (the other files import them). That the kernels agree,
that a decoder is causal and an encoder is not, for every encoding: tests/test_encoding_conformance.py."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM, ExplicitAttention, NoPE, SDPAttention
from tests.conftest import CONFIG_DIR, causal_only
from tests.loops import named


def pe_factory(name: str, seq_len: int = 64, **overrides):
    """The PE exactly as its config group builds it (``${data.seq_len}`` as a run of ``seq_len`` resolves it):
    new yaml files are tested automatically."""
    node = OmegaConf.load(CONFIG_DIR / "pe" / f"{name}.yaml")
    node.pop("defaults")  # the stored settings node it extends: the class's own defaults, which building fills in
    cfg = OmegaConf.create({"data": {"seq_len": seq_len}, "pe": node})
    cfg.pe.merge_with(overrides)
    return instantiate(cfg.pe)


def live(model: torch.nn.Module, std: float = 0.5) -> torch.nn.Module:
    """The model with noise of ``std`` added to every PE weight (CoPE's table starts at zero, FIRE's bias near it, T5's
    at 0.02; a layer's own ``pe_layer``, FoX's gate, starts nearly data-independent): a bug in where a cached step places
    its tokens then shows in the logits."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".pe." in f".{name}" or ".pe_layer." in name:
                p.add_(torch.randn(p.shape, generator=g) * std)
    return model


def build(model_cls, pe: str, attention, **kw):
    """The model with the PE as its config builds it. An encoding of causal stacks only (pe=forgetting) in a model with a
    bidirectional stack: its one-line refusal is checked, and the test is skipped (there is no such model to test)."""
    torch.manual_seed(0)
    extra = {"mask_token_id": 1} if model_cls is EncoderMLM else {}

    def make():
        return model_cls(vocab_size=50, d_model=32, n_heads=4, n_layers=2, pe=pe_factory(pe), attention=attention, **extra, **kw)

    if model_cls is not DecoderLM and causal_only(pe):
        with pytest.raises(ValueError, match="causal only"):
            make()
        pytest.skip(f"pe={pe} is causal only: {model_cls.__name__} refuses it (checked)")
    return make()


def test_self_attention_matches_torch_multihead_attention_with_copied_weights():
    torch.manual_seed(0)
    d, h, T = 32, 4, 10
    ours = ExplicitAttention(d, h, NoPE(d, h))
    ref = torch.nn.MultiheadAttention(d, h, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([ours.q.weight, ours.kv.weight]))
        ref.in_proj_bias.copy_(torch.cat([ours.q.bias, ours.kv.bias]))
        ref.out_proj.weight.copy_(ours.o.weight)
        ref.out_proj.bias.copy_(ours.o.bias)
    x = torch.randn(2, T, d)
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = not allowed, torch's convention
    expected, expected_weights = ref(x, x, x, attn_mask=mask, average_attn_weights=False)
    ours.keep_weights = True
    torch.testing.assert_close(ours(x, causal=True), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.attn_weights, expected_weights, atol=1e-6, rtol=1e-5)


def test_explicit_attention_keeps_causal_weights():
    model = build(DecoderLM, "alibi", ExplicitAttention).eval()
    layer = model.blocks[0].attn
    layer.keep_weights = True
    with torch.no_grad():
        model(torch.randint(50, (2, 12)))
    w = layer.attn_weights
    assert w.shape == (2, 4, 12, 12)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 12))
    assert w.triu(1).abs().max() == 0


def test_weights_are_reachable_by_plain_names():
    model = build(DecoderLM, "learned", SDPAttention)
    assert model.W_E.shape == (50, 32) and model.W_pos.shape == (512, 32)
    assert model.head.weight is model.W_E  # tied by default
    attn = model.blocks[1].attn  # d_model 32, 4 heads of 8
    assert attn.W_Q.shape == attn.W_K.shape == attn.W_V.shape == (4, 32, 8) and attn.W_O.shape == (4, 8, 32)
    assert attn.b_Q.shape == attn.b_K.shape == attn.b_V.shape == (4, 8) and attn.b_O.shape == (32,)
    assert build(DecoderLM, "rope", SDPAttention).W_pos is None


def test_untied_and_scaled_embeddings():
    from pe_geometry.model import TokenEmbedding

    torch.manual_seed(0)
    scaled_untied = lambda **kw: TokenEmbedding(**kw, scaled=True, tie_weights=False)
    model = DecoderLM(vocab_size=50, d_model=16, n_heads=2, n_layers=1, embedding=scaled_untied)
    assert model.head.weight is not model.W_E
    assert model.embed_scale == pytest.approx(4.0)
    idx = torch.randint(50, (1, 5))
    expected = model.W_E[idx] * 4.0 + model.W_pos[:5]
    torch.testing.assert_close(model.decoder.embed(idx), expected)


def test_mlm_masking_is_15_percent_with_80_10_10_split():
    from pe_geometry.model import mask_tokens

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1000, (200, 500), generator=g)
    inputs, targets = mask_tokens(tokens, mask_token_id=1, vocab_size=1000, generator=g)
    chosen = targets != -100
    assert chosen.float().mean().item() == pytest.approx(0.15, abs=0.005)
    masked = (inputs == 1) & chosen
    kept = (inputs == tokens) & chosen
    assert masked.sum() / chosen.sum() == pytest.approx(0.8, abs=0.01)
    assert kept.sum() / chosen.sum() == pytest.approx(0.1 + 0.1 / 1000, abs=0.01)
    assert torch.equal(inputs[~chosen], tokens[~chosen])
    assert torch.equal(targets[chosen], tokens[chosen])


def test_encoder_decoder_split_and_loss_targets():
    model = build(EncoderDecoder, "sinusoidal", SDPAttention)
    block = torch.arange(17).expand(2, 17)
    src, tgt_in, tgt_out = model.split(block)
    assert src[0].tolist() == list(range(8))
    assert tgt_in[0].tolist() == list(range(8, 16)) and tgt_out[0].tolist() == list(range(9, 17))


def test_per_head_weight_views_rebuild_the_attention_output():
    """Head by head with W_Q/W_K/W_V/W_O and their biases, the explicit attention's output comes back exactly."""
    torch.manual_seed(0)
    model = build(DecoderLM, "sinusoidal", ExplicitAttention).eval()
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        q = torch.einsum("btd,hde->bhte", x, attn.W_Q) + attn.b_Q[:, None]
        k = torch.einsum("btd,hde->bhte", x, attn.W_K) + attn.b_K[:, None]
        v = torch.einsum("btd,hde->bhte", x, attn.W_V) + attn.b_V[:, None]
        scores = (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
        z = scores.softmax(-1) @ v  # (B, H, T, d_head)
        out = torch.einsum("bhte,hed->btd", z, attn.W_O) + attn.b_O
        torch.testing.assert_close(out, attn(x, causal=True))


def test_per_token_losses_average_to_the_training_loss():
    for model_cls in (DecoderLM, EncoderMLM, EncoderDecoder):
        with named(model_cls.__name__):
            model = build(model_cls, "rope", SDPAttention).eval()
            block = torch.randint(2, 50, (3, 21))
            with torch.no_grad():
                per_token = model.loss(block, reduction="none", generator=torch.Generator().manual_seed(0))
                mean = model.loss(block, generator=torch.Generator().manual_seed(0))
            n_targets = 20 - model.source_len(20) if model_cls is EncoderDecoder else 20
            assert per_token.shape == (3, n_targets)
            assert per_token.isnan().any() == (model_cls is EncoderMLM)  # unmasked positions have no target
            torch.testing.assert_close(per_token[~per_token.isnan()].mean(), mean)
            with pytest.raises(ValueError, match="reduction='sum'; valid"):
                model.loss(block, reduction="sum")


def test_encoder_decoder_source_length_is_one_formula():
    model = build(EncoderDecoder, "sinusoidal", SDPAttention, src_fraction=0.25)
    src, tgt_in, tgt_out = model.split(torch.randint(50, (2, 17)))
    assert src.shape[1] == model.source_len(16) == 4 and tgt_in.shape[1] == tgt_out.shape[1] == 12
    assert model.source_len(1) == 1  # the encoder always reads at least one token


def test_hidden_states_are_each_block_input_then_the_output():
    model = build(EncoderMLM, "alibi", ExplicitAttention).eval()
    idx = torch.randint(50, (2, 9))
    with torch.no_grad():
        states = model.hidden_states(idx)
        assert len(states) == model.n_layers + 1
        torch.testing.assert_close(states[0], model.encoder.embed(idx))
        torch.testing.assert_close(states[1], model.blocks[0](states[0]))
        torch.testing.assert_close(model.head(states[-1]), model(idx))
