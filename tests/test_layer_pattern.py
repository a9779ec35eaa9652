"""model.layer_pattern: a position scheme per layer (RoPE on three layers of four and NoPE on the fourth, as SmolLM3
and Llama 4; five windowed layers to one global with a RoPE base each, as Gemma 3), in every model and both kernels,
refused in one line where it cannot work, and named per layer by the analysis. That both kernels agree and the KV
cache is exact (a windowed layer's cache keeps its window, a global one every key) under each pattern:
tests/test_encoding_conformance.py (its ``layers=`` cases)."""

from __future__ import annotations

import pytest
import torch

from pe_geometry.analysis.measures.position_attention import position_attention_report
from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM, NoPE, RotaryPE, SDPAttention
from pe_geometry.model.transformer import layer_schemes
from pe_geometry.training.validate import ConfigError, check_config
from tests.conftest import compose_train_config
from tests.loops import named
from tests.test_attention import pe_factory

ROPE_NOPE = [{}, {}, {}, {"pe": "none"}]
LOCAL_GLOBAL = [*[{"window": 4, "pe": {"base": 10000.0}}] * 5, {"window": None, "pe": {"base": 1e6}}]


def build(model_cls, pe: str, pattern, attention=SDPAttention, n_layers: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    extra = {"mask_token_id": 1} if model_cls is EncoderMLM else {}
    return model_cls(vocab_size=50, d_model=32, n_heads=4, n_layers=n_layers, pe=pe_factory(pe), attention=attention,
                     layer_pattern=pattern, **extra)


def logits(model, idx):
    with torch.no_grad():
        return model(idx[:, :6], idx) if isinstance(model, EncoderDecoder) else model(idx)


IDX = torch.randint(50, (2, 20), generator=torch.Generator().manual_seed(3))


def test_the_pattern_is_cycled_over_the_layers():
    schemes = layer_schemes(ROPE_NOPE, 8)
    assert [s.entry for s in schemes] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [s.pe for s in schemes[:4]] == [None, None, None, "none"] and schemes[0].window == "inherit"
    assert layer_schemes(None, 3) is None


def test_rope_on_three_layers_and_nope_on_the_fourth():
    """Each layer's attention holds its encoding: the stack's RoPE (one module, shared) or NoPE; the output equals a
    plain RoPE model whose fourth layer has its encoding swapped for NoPE by hand (same weights)."""
    for model_cls in (DecoderLM, EncoderMLM, EncoderDecoder):
        with named(model_cls.__name__):
            model = build(model_cls, "rope", ROPE_NOPE).eval()
            stack = model.input_stack
            pes = [block.attn.pe for block in stack.blocks]
            assert all(pe is stack.pe for pe in pes[:3]) and isinstance(pes[3], NoPE) and isinstance(stack.pe, RotaryPE)
            by_hand = build(model_cls, "rope", None).eval()
            by_hand.load_state_dict(model.state_dict(), strict=False)
            for stack_by_hand in (m for m in by_hand.modules() if type(m).__name__ == "Stack"):
                stack_by_hand.blocks[3].attn.pe = NoPE(32, 4)
            assert torch.allclose(logits(model, IDX), logits(by_hand, IDX), atol=1e-6)
            assert (logits(model, IDX) - logits(build(model_cls, "rope", None).eval(), IDX)).abs().max() > 1e-5  # NoPE did act
            shared = build(model_cls, "rope", ROPE_NOPE, n_layers=8).input_stack.blocks
            assert shared[3].attn.pe is shared[7].attn.pe and len(shared[0].attn.pe.state_dict()) == 0


def test_local_and_global_layers_each_with_its_window_and_base():
    """Gemma 3's pattern at this size: five layers see 4 positions with RoPE base 1e4, the sixth all with base 1e6;
    equal to a plain model given those windows and bases by hand."""
    model = build(DecoderLM, "rope", LOCAL_GLOBAL, n_layers=6).eval()
    blocks = model.blocks
    assert [b.attn.window for b in blocks] == [4] * 5 + [None]
    assert [b.attn.pe.base for b in blocks] == [10000.0] * 5 + [1e6]
    by_hand = build(DecoderLM, "rope", None, n_layers=6).eval()
    by_hand.load_state_dict(model.state_dict(), strict=False)
    for block in by_hand.blocks[:5]:
        block.attn.window = 4
    by_hand.blocks[5].attn.pe = RotaryPE(32, 4, base=1e6)
    assert torch.allclose(logits(model, IDX), logits(by_hand, IDX), atol=1e-6)
    labels = model.input_stack.layer_labels("rope")
    assert labels[0] == "rope (base 10000), window 4" and labels[5] == "rope (base 1e+06), window all"


def test_an_input_level_encoding_takes_no_per_layer_encoding():
    with pytest.raises(ValueError, match=r"model.layer_pattern\[3\].pe='none': pe=SinusoidalPE adds its term to the input"):
        build(DecoderLM, "sinusoidal", ROPE_NOPE)
    model = build(DecoderLM, "sinusoidal", [{"window": 8}, {}])  # a window per layer is fine with any encoding
    assert [b.attn.window for b in model.blocks] == [8, None, 8, None]


@pytest.mark.parametrize("override, message", [
    ("model.layer_pattern=[{pe: {bse: 3}}]",
     r"model.layer_pattern\[0\].pe.bse is not a setting of pe=rope; valid: \['base', "),
    ("model.layer_pattern=[{pe: {base: -3}}]", r"model.layer_pattern\[0\].pe.base=-3 must be a number > 1"),
    ("model.layer_pattern=[{windw: 3}]", r"model.layer_pattern\[0\] has unknown key\(s\) \['windw'\]"),
    ("model.layer_pattern=[{},{},{},{},{pe: none}]", r"model.layer_pattern has 5 entries and model.n_layers=4: entries 4..4"),
    ("model.layer_pattern=[{pe: {scaling: yarn, training_length: null}}]",
     r"model.layer_pattern\[0\].pe: pe.scaling=yarn needs pe.training_length >= 1"),
])
def test_a_bad_pattern_in_a_config_is_one_line_before_anything_is_built(override, message, tmp_path):
    cfg = compose_train_config(["experiment=quick", "pe=rope", override], tmp_path)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_the_per_layer_figures_say_each_layers_scheme():
    """The attention distance's uniform baseline follows each layer's window; the report names every layer."""
    model = build(DecoderLM, "rope", LOCAL_GLOBAL, n_layers=6).eval()
    report = position_attention_report(model, IDX[:, :16], n_draws=2)
    assert report["layer_schemes"] == ["rope (base 10000), window 4"] * 5 + ["rope (base 1e+06), window all"]
    chance = report["distance_chance"]
    assert chance[0] == chance[4] < 1.5 < chance[5]  # a 4-position window: at most 3 back; all 16: 5 on average
    assert "null_mean" in report  # block 0 rotates: the rotation null
    assert "layer_schemes" not in position_attention_report(build(DecoderLM, "rope", None).eval(), IDX[:, :16], n_draws=2)


def test_the_presets_mirror_the_shipped_checkpoints_position_schemes(tmp_path):
    """experiment=smollm2_like: RoPE base 1e5 over 64-dim heads, 3 query heads a KV head (SmolLM2-135M: base 1e5,
    head dim 64, 9:3); experiment=gemma3_like: five 16-token-window layers with base 1e4, one global with base 1e6,
    one KV head, QK-norm (Gemma 3 270M: five 512-window layers with base 1e4, one global with 1e6, 4:1, QK-norm)."""
    from types import SimpleNamespace

    from pe_geometry.training.run_loader import build_model

    models = {}
    for name in ("smollm2_like", "gemma3_like"):
        cfg = compose_train_config([f"experiment={name}"], output_dir=tmp_path / name)
        check_config(cfg)
        models[name] = build_model(cfg, SimpleNamespace(vocab_size=50, mask_token_id=1))
    smol = models["smollm2_like"].blocks
    assert all(b.attn.pe.base == 1e5 and b.attn.d_head == 64 and b.attn.n_heads == 3 * b.attn.n_kv_heads for b in smol)
    gemma = models["gemma3_like"].blocks
    assert [b.attn.window for b in gemma] == [16] * 5 + [None] and [b.attn.pe.base for b in gemma] == [1e4] * 5 + [1e6]
    assert all(b.attn.n_kv_heads == 1 and b.attn.qk_norm for b in gemma)


def test_a_patterned_or_partial_rope_run_is_an_arm_of_its_own():
    """The report and the benchmarks group runs by arm: a layer pattern or a partial rotation never pools with
    plain RoPE (analysis.runs.arm_labels, benchmarks/arms.py's arm_label)."""
    from omegaconf import OmegaConf

    from pe_geometry.analysis.readers.runs import arm_labels
    from pe_geometry.benchmarks.arms import arm_label

    config = {"model": {"layer_pattern": [{}, {}, {}, {"pe": "none"}]}, "pe": {"rotary_fraction": 0.5, "partial_rotary": "p_rope"}}
    assert arm_labels(config) == ["rotary_fraction 0.5", "p_rope", "layers [=; =; =; none]"]
    assert arm_labels({"model": {"layer_pattern": None}, "pe": {"rotary_fraction": 1.0}}) == []
    local_global = OmegaConf.create({"model": {"layer_pattern": LOCAL_GLOBAL[-2:]},
                                     "pe": {"_target_": "pe_geometry.model.RotaryPE"}})
    assert arm_label("rope", local_global) == "rope (layers [base 10000 w4; base 1e+06 w all])"
