# ruff: noqa: E501  (the table of bad settings keeps each case and its message on one line)
"""The attention variants (grouped-query, QK-norm, a sliding window, log-length scaling) against independent references.

Each variant is compared with something that does not share its code: torch's own ``enable_gqa``, x-transformers'
``qk_norm`` attention, a band mask and the log-length formula written out by hand; all four at once run in every
precision; bad settings are one line naming the key, and a tiny run trains with the geometry callback recording block
0. Under every variant and with every encoding (tests/test_encoding_conformance.py): the two kernels agree, cached
decoding gives the logits of a full pass, ``score_parts`` adds up to the logits, grouped-query attention is multi-head
attention with the shared heads repeated.
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from pe_geometry.analysis.measures import position_attention as pa
from pe_geometry.analysis.measures.attention_split import TERMS, first_layer_attention_split, first_layer_terms
from pe_geometry.model import (
    ALiBiPE,
    DecoderLM,
    EncoderDecoder,
    ExplicitAttention,
    KVCache,
    LearnedPE,
    NoPE,
    RotaryPE,
    SDPAttention,
    XPosPE,
)
from pe_geometry.training.validate import ConfigError, check_config
from tests.conftest import compose_train_config
from tests.loops import grid, named
from tests.test_attention import build, live
from tests.test_generate import incremental_logits

D, H, DH = 32, 4, 8  # the test models' width, heads and head size (tests/test_attention.py's build)
KERNELS = (ExplicitAttention, SDPAttention)
# window 3 < the 5-token prefill of incremental_logits, so the cache drops keys; training_length 6 < 20 tokens
VARIANTS = {
    "gqa": {"n_kv_heads": 2},
    "mqa": {"n_kv_heads": 1},
    "qk_norm": {"qk_norm": True},
    "window": {"window": 3},
    "logn": {"logn_scaling": True, "training_length": 6},
    "all": {"n_kv_heads": 2, "qk_norm": True, "window": 3, "logn_scaling": True, "training_length": 6},
}


def variant(kernel, name: str):
    return partial(kernel, **VARIANTS[name])


def heads(t: torch.Tensor, n: int) -> torch.Tensor:  # (B, T, n * DH) -> (B, n, T, DH)
    return t.view(t.shape[0], t.shape[1], n, DH).transpose(1, 2)


def projections(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, T, DH) and the shared k, v (B, n_kv_heads, T, DH), from the packed weights by hand."""
    n_kv = attn.kv.weight.shape[0] // (2 * DH)
    kv = F.linear(x, attn.kv.weight, attn.kv.bias)
    return heads(F.linear(x, attn.q.weight, attn.q.bias), H), heads(kv[..., : n_kv * DH], n_kv), heads(kv[..., n_kv * DH :], n_kv)


def output(attn, z: torch.Tensor) -> torch.Tensor:  # (B, H, T, DH) -> (B, T, D)
    return attn.o(z.transpose(1, 2).reshape(z.shape[0], z.shape[2], D))


# -- grouped-query / multi-query attention ------------------------------------------------------------------------------
def test_grouped_query_attention_is_torch_sdpa_with_enable_gqa():
    for kernel, causal, n_kv_heads in grid(KERNELS, (True, False), (1, 2)):
        with named(kernel.__name__, causal, n_kv_heads):
            torch.manual_seed(0)
            attn = kernel(D, H, NoPE(D, H), n_kv_heads=n_kv_heads)
            assert attn.kv.weight.shape == (2 * n_kv_heads * DH, D)  # only the shared heads are projected
            x = torch.randn(2, 9, D)
            with torch.no_grad():
                q, k, v = projections(attn, x)
                expected = output(attn, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True))
                torch.testing.assert_close(attn(x, causal=causal), expected, atol=1e-6, rtol=1e-5)


def test_the_cache_keeps_only_the_shared_heads():
    model = build(EncoderDecoder, "rope", variant(SDPAttention, "mqa")).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.ones(1, 3, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), cache=cache)
    assert cache.get(model.decoder.blocks[0].attn)[0].shape == (1, 1, 4, DH)  # (B, n_kv_heads, tokens, d_head)
    assert cache.get(model.decoder.blocks[0].cross_attn)[1].shape == (1, 1, 3, DH)  # cross-attention too


def test_the_first_layer_split_of_grouped_query_attention_sums_to_its_scores():
    """attention_split reads W_K/b_K per query head: its terms add up to the real block-0 scores, the shared heads'."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=40, d_model=D, n_heads=H, n_layers=1, pe=LearnedPE,
                      attention=partial(ExplicitAttention, n_kv_heads=2)).eval()
    attn, idx = model.blocks[0].attn, torch.randint(40, (3, 10))
    with torch.no_grad():
        for param in (attn.q.bias, attn.kv.bias):  # every bias term exercised
            param.copy_(torch.randn_like(param))
        terms, mask = first_layer_terms(model, idx)
        q, k, _ = projections(attn, model.blocks[0].ln_attn(model.input_stack.embed(idx)))
        scores = q @ k.repeat_interleave(2, dim=1).transpose(-2, -1) / math.sqrt(DH)  # query head h reads kv head h // 2
        shares = first_layer_attention_split(model, idx)
    torch.testing.assert_close(sum(terms.values()), scores.double(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sum(shares[name] for name in TERMS), torch.ones(H, dtype=torch.float64))


# -- QK-norm ------------------------------------------------------------------------------------------------------------
def test_qk_norm_is_x_transformers_qk_norm_attention_with_copied_weights():
    """l2-normalised q and k times a temperature of 10, the positional rotation after the norm (xPos's decay then
    survives the norm, which it would not if the norm came after the rotation)."""
    for kernel, pe in grid(KERNELS, ("none", "rope", "xpos")):
        with named(kernel.__name__, pe):
            x_transformers = pytest.importorskip("x_transformers.x_transformers")
            torch.manual_seed(0)
            T = 12
            encoding = {"none": NoPE(D, H), "rope": RotaryPE(D, H), "xpos": XPosPE(D, H, scale_base=8.0, training_length=64)}[pe]
            ours = kernel(D, H, encoding, qk_norm=True)
            ref = x_transformers.Attention(dim=D, heads=H, dim_head=DH, causal=True, qk_norm=True, qk_norm_scale=10)
            rotary = {} if pe == "none" else {"rotary_pos_emb": x_transformers.RotaryEmbedding(
                DH, **({"use_xpos": True, "scale_base": 8} if pe == "xpos" else {})).forward_from_seq_len(T)}
            x = torch.randn(2, T, D)
            with torch.no_grad():
                for bias in (ours.q.bias, ours.kv.bias, ours.o.bias):
                    bias.zero_()  # x-transformers' projections have none
                ref.to_q.weight.copy_(ours.q.weight)
                ref.to_k.weight.copy_(ours.kv.weight[:D])
                ref.to_v.weight.copy_(ours.kv.weight[D:])
                ref.to_out.weight.copy_(ours.o.weight)
                torch.testing.assert_close(ours(x, causal=True), ref(x, **rotary), atol=1e-5, rtol=1e-5)


def test_qk_norm_logits_are_the_learned_temperature_times_the_cosine():
    torch.manual_seed(0)
    attn = ExplicitAttention(D, H, NoPE(D, H), qk_norm=True, qk_norm_scale=3.0)
    attn.keep_weights = True
    x = torch.randn(1, 6, D)
    with torch.no_grad():
        attn.qk_temperature.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        attn(x)
        q, k, _ = projections(attn, x)
        cosine = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)  # (1, H, T, T)
        expected = (torch.tensor([1.0, 2.0, 3.0, 4.0])[:, None, None] * cosine).softmax(dim=-1)
        torch.testing.assert_close(attn.attn_weights, expected)
    attn(x).sum().backward()
    assert attn.qk_temperature.grad is not None and attn.qk_temperature.grad.abs().sum() > 0  # learned
    assert ExplicitAttention(D, H, qk_norm=True, qk_norm_scale=3.0).qk_temperature.tolist() == [3.0] * H


# -- a sliding window ---------------------------------------------------------------------------------------------------
def band(T: int, window: int, causal: bool) -> torch.Tensor:
    """The keys each query sees, one by one."""
    return torch.tensor([[(0 <= i - j < window) if causal else abs(i - j) < window for j in range(T)] for i in range(T)])


def test_a_window_is_the_hand_built_band_mask():
    for kernel, causal, pe in grid(KERNELS, (True, False), ("none", "alibi")):
        with named(kernel.__name__, causal, pe):
            torch.manual_seed(0)
            T, window = 12, 4
            attn = kernel(D, H, ALiBiPE(D, H) if pe == "alibi" else NoPE(D, H), window=window)
            x = torch.randn(2, T, D)
            with torch.no_grad():
                q, k, v = projections(attn, x)
                scores = q @ k.transpose(-2, -1) / math.sqrt(DH)
                if pe == "alibi":
                    scores = scores + attn.pe.score_bias(T, T)
                weights = scores.masked_fill(~band(T, window, causal), float("-inf")).softmax(dim=-1)
                torch.testing.assert_close(attn(x, causal=causal), output(attn, weights @ v), atol=1e-6, rtol=1e-5)
            assert attn.visible_keys_mask(T, causal).equal(band(T, window, causal))


def test_a_one_layer_windowed_decoder_never_reads_past_its_window():
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, d_model=D, n_heads=H, n_layers=1, pe=RotaryPE,
                      attention=partial(SDPAttention, window=4)).eval()
    idx = torch.randint(50, (2, 12))
    changed = idx.clone()
    changed[:, 3] = (changed[:, 3] + 1) % 50
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert torch.equal(before[:, 7:], after[:, 7:])  # position 7 sees 4..7
    assert not torch.allclose(before[:, 3:7], after[:, 3:7])


def test_the_cache_keeps_window_minus_one_keys_and_counts_every_position():
    model = build(DecoderLM, "rope", variant(SDPAttention, "window")).eval()  # window 3
    cache = KVCache()
    with torch.no_grad():
        model(torch.ones(1, 5, dtype=torch.long), cache=cache)
        model(torch.ones(1, 1, dtype=torch.long), cache=cache)
    assert cache.get(model.decoder.blocks[0].attn)[0].shape == (1, H, 2, DH) and cache.length == 6


def test_the_analysis_masks_respect_the_window():
    """position_attention's masks and uniform attention's distance are the band's."""
    T = 10
    model = build(DecoderLM, "alibi", partial(ExplicitAttention, window=3)).eval()
    assert pa._mask(model, T, torch.device("cpu")).equal(band(T, 3, True))
    _, chance = pa.mean_attention_distance(model, torch.randint(50, (2, T)))
    expected = sum(sum(range(min(i + 1, 3))) / min(i + 1, 3) for i in range(T)) / T  # mean |i - j| over i's keys
    assert chance[0, 0].item() == pytest.approx(expected)


# -- log-length scaling -------------------------------------------------------------------------------------------------
def test_logn_scaling_multiplies_each_querys_logits_by_the_formula():
    """logits x max(1, log n / log L): n = the query's position + 1 when causal, the sequence length when not."""
    for kernel, causal, pe in grid(KERNELS, (True, False), ("none", "alibi")):
        with named(kernel.__name__, causal, pe):
            torch.manual_seed(0)
            T, L = 12, 4
            attn = kernel(D, H, ALiBiPE(D, H) if pe == "alibi" else NoPE(D, H), logn_scaling=True, training_length=L)
            x = torch.randn(2, T, D)
            n = torch.arange(1, T + 1).double() if causal else torch.full((T,), float(T))
            factor = torch.clamp(n.log() / math.log(L), min=1).float()[:, None]  # (T, 1)
            with torch.no_grad():
                q, k, v = projections(attn, x)
                scores = q @ k.transpose(-2, -1) / math.sqrt(DH)
                if pe == "alibi":
                    scores = scores + attn.pe.score_bias(T, T)
                scores = scores * factor
                if causal:
                    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
                torch.testing.assert_close(attn(x, causal=causal), output(attn, scores.softmax(dim=-1) @ v), atol=1e-6, rtol=1e-5)
                within = attn(x[:, :L], causal=causal)  # within the training length: no change at all
                attn.logn_scaling = False
                assert torch.equal(within, attn(x[:, :L], causal=causal))


def test_cached_logn_scaling_counts_from_the_caches_start():
    """The factor of a cached query is its absolute position's: one step at position 9 = row 9 of a full pass."""
    torch.manual_seed(0)
    attn = ExplicitAttention(D, H, NoPE(D, H), logn_scaling=True, training_length=4)
    x = torch.randn(1, 10, D)
    cache = KVCache()
    with torch.no_grad():
        attn(x[:, :9], causal=True, cache=cache)
        cache.length = 9
        torch.testing.assert_close(attn(x[:, 9:], causal=True, cache=cache), attn(x, causal=True)[:, 9:])


# -- all four at once in every precision; each changes the logits --------------------------------------------------------
def test_every_precision_runs_with_every_variant_and_agrees_with_float32():
    for kernel, dtype in grid(KERNELS, (torch.bfloat16, torch.float16, torch.float64)):
        with named(kernel.__name__, dtype):
            model = live(build(DecoderLM, "rope", variant(kernel, "all"))).eval()
            idx = torch.randint(50, (2, 20), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                reference = model(idx)
                low = model.to(dtype)(idx)
                cached = incremental_logits(model, idx, None)
            assert low.dtype == cached.dtype == dtype and torch.isfinite(low).all()
            tolerance = 1e-4 if dtype == torch.float64 else 0.02  # logits up to ~0.7; bf16 is off by ~0.003
            assert (low.double() - reference.double()).abs().max().item() < tolerance
            assert (cached.double() - reference.double()).abs().max().item() < tolerance


def test_each_variant_changes_the_logits():
    """The tests above would pass vacuously if a variant did nothing: with the same weights it changes the output."""
    for name in ("window", "logn", "qk_norm"):
        with named(name):
            plain = build(DecoderLM, "rope", ExplicitAttention).eval()
            changed = build(DecoderLM, "rope", variant(ExplicitAttention, name)).eval()
            changed.load_state_dict(plain.state_dict(), strict=False)  # qk_norm's temperature is its own
            idx = torch.randint(50, (2, 20), generator=torch.Generator().manual_seed(3))
            with torch.no_grad():
                assert (plain(idx) - changed(idx)).abs().max().item() > 1e-5  # well above the kernels' 1e-7 disagreement


# -- the config: keys from the command line, one error line for what cannot work ----------------------------------------
BAD = [
    (["attention.n_kv_heads=3"], "attention.n_kv_heads=3 must divide model.n_heads=4 (each key/value head serves n_heads/n_kv_heads query heads); valid: [1, 2, 4] or null"),
    (["attention.n_kv_heads=8"], "attention.n_kv_heads=8 must divide model.n_heads=4"),
    (["attention.n_kv_heads=0"], "attention.n_kv_heads=0 must be a positive integer (dividing model.n_heads; 1: multi-query), or null for model.n_heads"),
    (["attention=explicit", "attention.window=0"], "attention.window=0 must be a positive integer (positions a query sees), or null for all"),
    (["attention.logn_scaling=true", "attention.training_length=null"], "attention.logn_scaling=true needs attention.training_length >= 2 (the length the model was trained at; log n / log training_length), got null"),
    (["attention.qk_norm=yes"], "attention.qk_norm=yes must be true or false"),
    (["attention.qk_norm_scale=0"], "attention.qk_norm_scale=0 must be a number > 0 (the learned temperature's start)"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_settings_that_cannot_work_are_one_line_naming_the_key(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        check_config(compose_train_config(overrides, tmp_path))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_keys_compose_and_the_training_length_is_the_runs(tmp_path):
    cfg = compose_train_config(["attention=sdpa", "attention.n_kv_heads=2", "attention.window=32", "attention.qk_norm=true",
                                "attention.logn_scaling=true", "data.seq_len=48"], tmp_path)
    check_config(cfg)
    assert cfg.attention.training_length == 48 and cfg.attention.n_kv_heads == 2
    defaults = compose_train_config(["attention=explicit"], tmp_path).attention
    assert (defaults.n_kv_heads, defaults.qk_norm, defaults.window, defaults.logn_scaling) == (None, False, None, False)


def test_a_window_the_training_length_never_reaches_is_warned_about(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        check_config(compose_train_config(["attention.window=512", "data.seq_len=64"], tmp_path))
    assert "attention.window=512 is at least data.seq_len=64" in caplog.text


# -- a tiny run with every variant, the geometry callback included ------------------------------------------------------
ALL_FOUR = ["attention.n_kv_heads=2", "attention.qk_norm=true", "attention.window=4", "attention.logn_scaling=true",
            "attention.training_length=8"]  # data.seq_len 16: logn acts within the run's own blocks


@pytest.mark.parametrize("arm", [["model=decoder", "pe=rope", "attention=sdpa"],
                                 ["model=encoder_decoder", "pe=learned", "attention=explicit"]], ids=lambda a: a[1])
def test_a_tiny_run_trains_with_every_variant_and_records_block_0(arm, tmp_path, tiny_corpus, cache_dir):
    import csv

    from pe_geometry.analysis import metric_names as names
    from pe_geometry.training.pipeline import train
    from tests.conftest import tiny_train_config

    metrics = train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*arm, *ALL_FOUR]))
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    with open(tmp_path / "run" / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    share = names.attention_share_metric(0, "positional")
    recorded = [float(r[share]) for r in rows if r.get(share)]
    assert recorded and all(math.isfinite(v) for v in recorded)
