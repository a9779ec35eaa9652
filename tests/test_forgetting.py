"""pe=forgetting, the Forgetting Transformer (model/forgetting.py), against the paper's formula written out by hand.

What it promises: O = softmax(QK^T / sqrt(d_head) + D) V with D_ij = sum_{l=j+1}^{i} log f_l under the causal mask, f
read per layer, head and token from the layer's input; a gate at 1 is NoPE, a gate fixed at f is ALiBi with slope
-log f, and with ``rotary=true`` a gate at 1 is RoPE; the cache keeps each layer's gates beside its keys; every layer has
its own gate, which training reaches; a bidirectional stack and randomised positions are refused in one line; the
analysis reads the gate bias as the family's score bias. That both kernels agree and a cached step's bias is the full
pass's (with and without RoPE, under every attention variant, in a layer pattern): tests/test_encoding_conformance.py.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import pytest
import torch

from pe_geometry.analysis.measures import position_attention as pa
from pe_geometry.model import (
    ALiBiPE,
    DecoderLM,
    EncoderDecoder,
    EncoderMLM,
    ExplicitAttention,
    ForgettingPE,
    KVCache,
    NoPE,
    RotaryPE,
    SDPAttention,
)
from pe_geometry.model.forgetting import CAUSAL_ONLY, ForgetGate
from pe_geometry.model.transformer import record_attention
from pe_geometry.training.optimizer import weight_decay_groups
from pe_geometry.training.validate import ConfigError, check_config
from tests import forkserver
from tests.conftest import ROOT, compose_train_config, tiny_train_config
from tests.loops import grid, named

KERNELS = [ExplicitAttention, SDPAttention]
VARIANTS = {"plain": {}, "grouped": {"n_kv_heads": 2},  # grouped: a decoding step folds the bias with the query heads
            "all": {"n_kv_heads": 2, "qk_norm": True, "window": 4, "logn_scaling": True, "training_length": 6}}


def fox(attention=SDPAttention, n_layers: int = 2, **pe) -> DecoderLM:
    """A small FoX decoder whose gates clearly depend on the tokens (w ~ N(0, 0.3^2), b ~ 1 + N(0, 0.5^2): f spread
    over roughly 0.3 .. 0.99), so a gate read at the wrong token shows in the logits."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=n_layers, pe=partial(ForgettingPE, **pe),
                      attention=attention)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.pe_layer.weight.copy_(torch.randn(4, 32, generator=g) * 0.3)
            block.attn.pe_layer.bias.copy_(1.0 + torch.randn(4, generator=g) * 0.5)
    return model.eval()


def fixed_gates(model: DecoderLM, logit: torch.Tensor) -> DecoderLM:
    """Every layer's gate made data-independent: w = 0, b = ``logit`` (H,), so f_h = sigmoid(logit_h) at every token."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.pe_layer.weight.zero_()
            block.attn.pe_layer.bias.copy_(logit)
    return model


def same_weights(fox_model: DecoderLM, other: DecoderLM) -> DecoderLM:
    """``other`` with the FoX model's weights: everything but the gates (which it has not)."""
    missing, unexpected = other.load_state_dict(fox_model.state_dict(), strict=False)
    assert not missing and unexpected and all(".pe_layer." in k for k in unexpected)
    return other.eval()


def tokens(B: int = 2, T: int = 20, seed: int = 1) -> torch.Tensor:
    return torch.randint(50, (B, T), generator=torch.Generator().manual_seed(seed))


# -- the paper's formula by hand ---------------------------------------------------------------------------------------
def fox_by_hand(attn, x: torch.Tensor, rope_base: float | None = None) -> torch.Tensor:
    """One FoX self-attention layer on x (B, T, D) written out with loops, in float64: per head, q_t, k_t, v_t from the
    projections (RoPE: pair (2i, 2i+1) of q_t and k_t turned by t * base^(-2i/d)), f_t = sigmoid(w . x_t + b), and for
    query i the softmax over j <= i of q_i . k_j / sqrt(d) + sum_{l=j+1}^{i} log f_l; then the output projection."""
    B, T, D = x.shape
    H, d = attn.n_heads, attn.d_head
    X = x.double()
    Wq, bq = attn.q.weight.double(), attn.q.bias.double()
    Wkv, bkv = attn.kv.weight.double(), attn.kv.bias.double()
    w, b = attn.pe_layer.weight.double(), attn.pe_layer.bias.double()

    def rotate(vec: torch.Tensor, t: int) -> torch.Tensor:
        if rope_base is None:
            return vec
        out = vec.clone()
        for i in range(d // 2):
            angle = t * rope_base ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            out[2 * i], out[2 * i + 1] = vec[2 * i] * c - vec[2 * i + 1] * s, vec[2 * i] * s + vec[2 * i + 1] * c
        return out

    heads = torch.zeros(B, T, H * d, dtype=torch.float64)
    for n in range(B):
        for h in range(H):
            rows = slice(h * d, (h + 1) * d)
            v_rows = slice(D + h * d, D + (h + 1) * d)
            q = [rotate(X[n, t] @ Wq[rows].T + bq[rows], t) for t in range(T)]
            k = [rotate(X[n, t] @ Wkv[rows].T + bkv[rows], t) for t in range(T)]
            v = [X[n, t] @ Wkv[v_rows].T + bkv[v_rows] for t in range(T)]
            log_f = [math.log(1.0 / (1.0 + math.exp(-float(w[h] @ X[n, t] + b[h])))) for t in range(T)]
            for i in range(T):
                scores = torch.tensor([float(q[i] @ k[j]) / math.sqrt(d) + sum(log_f[j + 1 : i + 1]) for j in range(i + 1)],
                                      dtype=torch.float64)
                weights = scores.softmax(dim=0)
                heads[n, i, rows] = sum(weights[j] * v[j] for j in range(i + 1))
    return heads @ attn.o.weight.double().T + attn.o.bias.double()


def test_a_layer_is_the_papers_formula_written_out_with_loops():
    for kernel, rotary in grid(KERNELS, (False, True)):
        with named(kernel.__name__, rotary):
            torch.manual_seed(0)
            attn = kernel(16, 2, ForgettingPE(16, 2, rotary=rotary, base=100.0)).eval()
            with torch.no_grad():
                attn.pe_layer.weight.normal_(0.0, 0.5)
                attn.pe_layer.bias.copy_(torch.tensor([0.5, 2.0]))
                x = torch.randn(2, 7, 16)
                torch.testing.assert_close(attn(x, causal=True).double(), fox_by_hand(attn, x, 100.0 if rotary else None),
                                           atol=1e-5, rtol=1e-5)


def test_the_gate_is_the_layers_input_read_by_a_sigmoid():
    gate = ForgetGate(8, 3, bias_init=0.7)
    x = torch.randn(2, 5, 8)
    expected = torch.sigmoid(x @ gate.weight.T + gate.bias).log().transpose(1, 2)  # (B, H, T)
    torch.testing.assert_close(gate(x), expected)
    pe = ForgettingPE(8, 2)
    torch.testing.assert_close(pe.gate_bias(expected, 2, causal=True),  # the last 2 queries: c_i - c_j
                               (expected.cumsum(-1)[..., 3:, None] - expected.cumsum(-1)[..., None, :]))


# -- planted gates: NoPE, ALiBi, RoPE ----------------------------------------------------------------------------------
def test_a_gate_at_one_is_causal_attention_without_position():
    for kernel in KERNELS:
        with named(kernel.__name__):
            model = fixed_gates(fox(kernel), torch.full((4,), 1e4))  # log sigmoid(1e4) = 0: D = 0
            nope = same_weights(model, DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=2, pe=NoPE, attention=kernel))
            with torch.no_grad():
                torch.testing.assert_close(model(tokens()), nope(tokens()), atol=1e-5, rtol=1e-5)


def test_a_gate_fixed_at_f_is_alibi_with_slope_minus_log_f():
    for kernel in KERNELS:
        with named(kernel.__name__):
            f = torch.tensor([0.5, 0.8, 0.95, 0.99])
            model = fixed_gates(fox(kernel), torch.log(f / (1 - f)))
            alibi = same_weights(model, DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=2, pe=ALiBiPE, attention=kernel))
            alibi.decoder.pe.slopes = -torch.log(f)
            idx = tokens(T=16)
            with torch.no_grad():
                torch.testing.assert_close(model(idx), alibi(idx), atol=1e-5, rtol=1e-5)
                with record_attention(model, points=("score_bias",)) as record:
                    model(idx)
            i = torch.arange(16.0)
            planted = (i[:, None] - i[None, :]) * torch.log(f)[:, None, None]  # (H, T, T): (i - j) log f
            causal = torch.ones(16, 16, dtype=torch.bool).tril()
            recorded = record[0]["score_bias"]  # (B, H, T, T)
            torch.testing.assert_close(recorded[..., causal], planted[:, causal].expand_as(recorded[..., causal]), atol=1e-5, rtol=1e-5)


def test_with_rotary_a_gate_at_one_is_rope():
    for kernel in KERNELS:
        with named(kernel.__name__):
            model = fixed_gates(fox(kernel, rotary=True, base=500.0), torch.full((4,), 1e4))
            rope = same_weights(model, DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=2,
                                                 pe=partial(RotaryPE, base=500.0), attention=kernel))
            with torch.no_grad():
                torch.testing.assert_close(model(tokens()), rope(tokens()), atol=1e-5, rtol=1e-5)


# -- both kernels, the KV cache ----------------------------------------------------------------------------------------
def test_the_cache_keeps_each_layers_log_gates_beside_its_keys():
    """The cache keeps each layer's log gates as it keeps the keys: as many, of every query head (a window keeps the
    same last keys of both; grouped heads fold the bias with the query heads). That every cached step's bias is then
    the full pass's rows, with and without RoPE, under every attention variant and both kernels, and the windowed
    generation: tests/test_encoding_conformance.py (``cached``, ``windowed``)."""
    idx = tokens()
    for variant, settings in VARIANTS.items():
        model, cache = fox(partial(SDPAttention, **settings)), KVCache()
        with torch.no_grad():
            model(idx, cache=cache)
        for block in model.blocks:
            keys, _ = cache.get(block.attn)
            gates = cache._buffers[(block.attn, "gates")]
            assert gates[0].shape[:2] == (2, 4) and gates[-1] - gates[-2] == keys.shape[2], variant


# -- where the gates live ----------------------------------------------------------------------------------------------
def test_every_layer_has_its_own_gate_started_near_one_and_training_reaches_it():
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=3, pe=ForgettingPE)
    gates = [block.attn.pe_layer for block in model.blocks]
    assert len({id(g) for g in gates}) == 3 and all(isinstance(g, ForgetGate) for g in gates)
    assert all(f"decoder.blocks.{i}.attn.pe_layer.weight" in model.state_dict() for i in range(3))
    for gate in gates:  # the model's init (which zeroes Linear biases) leaves the gate as built: f = sigmoid(5) = 0.993
        assert torch.equal(gate.bias, torch.full((4,), 5.0)) and gate.weight.std().item() == pytest.approx(0.02, rel=0.2)
    assert model.decoder.pe.causal and not list(model.decoder.pe.parameters())  # the shared encoding holds no gate
    model.loss(tokens(B=4, T=17)).backward()
    assert all(g.weight.grad.abs().sum() > 0 and g.bias.grad.abs().sum() > 0 for g in gates)
    decay, no_decay = (group["params"] for group in weight_decay_groups(model, 0.1, no_decay_embeddings=False))
    assert all(any(p is g.weight for p in decay) and any(p is g.bias for p in no_decay) for g in gates)
    paper = DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=1, pe=partial(ForgettingPE, gate_bias_init=0.0))
    assert torch.equal(paper.blocks[0].attn.pe_layer.bias, torch.zeros(4))  # the paper's code: f = 0.5 at init


# -- what it refuses ---------------------------------------------------------------------------------------------------
def test_a_bidirectional_stack_is_refused_in_one_line(tmp_path):
    for model_cls, extra in ((EncoderMLM, {"mask_token_id": 1}), (EncoderDecoder, {})):
        with pytest.raises(ValueError) as err:
            model_cls(vocab_size=50, d_model=32, n_heads=4, pe=ForgettingPE, **extra)
        assert str(err.value) == CAUSAL_ONLY
    with pytest.raises(ValueError, match="causal only"):
        ForgettingPE(32, 4).gate_bias(torch.zeros(1, 4, 3), 3, causal=False)
    for model in ("encoder", "encoder_decoder"):
        with pytest.raises(ConfigError) as err:
            check_config(compose_train_config([f"model={model}", "pe=forgetting"], tmp_path))
        assert str(err.value) == f"pe=forgetting: {CAUSAL_ONLY}" and "\n" not in str(err.value)
    check_config(compose_train_config(["model=decoder", "pe=forgetting", "pe.rotary=true"], tmp_path))


def test_randomised_positions_are_refused_in_one_line(tmp_path):
    for rotary in ("false", "true"):
        with named(rotary):
            cfg = compose_train_config(["pe=forgetting", f"pe.rotary={rotary}", "pe.randomize_positions=64"], tmp_path)
            with pytest.raises(ConfigError, match=r"^pe=forgetting: pe.randomize_positions=64 draws position ids, and ForgettingPE "
                                                  r"has none \(its decay is counted in tokens by the forget gates, not read from "
                                                  r"position ids\); the families that take it: pe=sinusoidal, "):
                check_config(cfg)


def test_rotary_needs_an_even_head_dimension(tmp_path):
    cfg = compose_train_config(["pe=forgetting", "pe.rotary=true", "model.d_model=12", "model.n_heads=4"], tmp_path)
    with pytest.raises(ConfigError, match=r"^pe=forgetting: RoPE needs an even head dimension"):
        check_config(cfg)
    check_config(compose_train_config(["pe=forgetting", "model.d_model=12", "model.n_heads=4"], tmp_path))  # alone: any


@pytest.mark.slow  # runs train.py in a subprocess
def test_the_cli_refuses_an_encoder_with_one_line_and_exit_code_2(tmp_path):
    result = forkserver.run([sys.executable, str(ROOT / "train.py"), "model=encoder", "pe=forgetting",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"error: pe=forgetting: {CAUSAL_ONLY}" in result.stderr and "Traceback" not in result.stderr


# -- the analysis ------------------------------------------------------------------------------------------------------
def test_the_analysis_reads_the_gate_bias_as_the_familys_score_bias():
    """The positional share and attention distance of every family read FoX's gate bias as its score bias: 0 with the
    gate at 1 (NoPE), ALiBi's figures with a gate fixed at f; with rotary=true the rotation null is drawn."""
    for rotary in (False, True):
        with named(rotary):
            idx = tokens(B=3, T=16)
            with torch.no_grad():
                report = pa.position_attention_report(fox(rotary=rotary), idx, n_draws=3)
                assert all(math.isfinite(v) for v in report["positional_share"]) and ("null_mean" in report) == rotary
                at_one = fixed_gates(fox(), torch.full((4,), 1e4))
                assert pa.positional_share(at_one, idx).abs().max().item() == 0.0
                f = torch.tensor([0.5, 0.8, 0.95, 0.99])
                planted = fixed_gates(fox(), torch.log(f / (1 - f)))
                alibi = same_weights(planted, DecoderLM(vocab_size=50, d_model=32, n_heads=4, n_layers=2, pe=ALiBiPE))
                alibi.decoder.pe.slopes = -torch.log(f)
                torch.testing.assert_close(pa.positional_share(planted, idx), pa.positional_share(alibi, idx), atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(pa.mean_attention_distance(planted, idx)[0], pa.mean_attention_distance(alibi, idx)[0],
                                           atol=1e-5, rtol=1e-5)


def test_a_tiny_run_with_rotary_trains_with_every_default_callback(tmp_path, tiny_corpus, cache_dir):
    from pe_geometry.training.pipeline import train

    cheap = ["callbacks.geometry.null_draws=2", "callbacks.geometry.position_probe_permutations=2",
             "callbacks.geometry.position_probe_blocks=5", "callbacks.geometry.attention_null_draws=2",
             "callbacks.geometry.n_tokens=50", "callbacks.sample.max_new_tokens=4"]
    metrics = train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=forgetting", "pe.rotary=true", *cheap]))
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
