"""The length-extrapolation protocol: the same target tokens at every length, errors over windows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pe_geometry.analysis.readers.extrapolation import NA, fixed_target_losses
from pe_geometry.model import ALiBiPE, DecoderLM, EncoderMLM, LearnedPE

VOCAB, SEQ = 40, 8


def _stream(n: int = 900, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB - 2, size=n)


def _context_blind(model):
    """Zero every attention output: each position then sees only its own token, so a token's loss cannot
    depend on the window it sits in. Any length-dependence left is a misaligned target."""
    with torch.no_grad():
        for block in model.input_stack.blocks:
            block.attn.o.weight.zero_()
            block.attn.o.bias.zero_()
    return model.eval()


def test_a_context_blind_decoder_scores_the_same_tokens_at_every_length():
    torch.manual_seed(0)
    model = _context_blind(DecoderLM(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=2, pe=ALiBiPE))
    result = fixed_target_losses(model, _stream(), SEQ, multipliers=(1, 2, 4), target_len=3)
    losses = [result["lengths"][m]["loss"] for m in ("1", "2", "4")]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6) == pytest.approx(losses[2], abs=1e-6)
    assert result["lengths"]["4"]["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert result["lengths"]["4"]["ratio_se"] == pytest.approx(0.0, abs=1e-6)
    assert result["n_windows"] == 900 // (4 * SEQ + 1)


def test_the_loss_at_one_length_is_the_mean_over_the_last_tokens_of_each_window_with_its_window_error():
    torch.manual_seed(1)
    model = DecoderLM(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=2, pe=ALiBiPE).eval()
    stream = _stream(seed=1)
    result = fixed_target_losses(model, stream, SEQ, multipliers=(1, 2), target_len=3)
    stride = 2 * SEQ + 1
    per_window = []
    for w in range(len(stream) // stride):
        end = (w + 1) * stride
        block = torch.as_tensor(stream[end - 2 * SEQ - 1 : end], dtype=torch.long)[None]
        logits = model(block[:, :-1])[0, -3:]
        per_window.append(torch.nn.functional.cross_entropy(logits, block[0, -3:], reduction="none").mean().item())
    per_window = np.array(per_window)
    entry = result["lengths"]["2"]
    assert entry["loss"] == pytest.approx(per_window.mean(), rel=1e-5)
    assert entry["se"] == pytest.approx(per_window.std(ddof=1) / math.sqrt(len(per_window)), rel=1e-4)
    assert entry["n_targets"] == 3 * len(per_window)


def test_a_learned_table_is_na_past_its_rows_and_scored_within_them():
    torch.manual_seed(2)
    model = DecoderLM(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=1, pe=lambda **kw: LearnedPE(max_len=2 * SEQ, **kw))
    result = fixed_target_losses(model.eval(), _stream(), SEQ, multipliers=(1, 2, 4))
    assert isinstance(result["lengths"]["2"]["loss"], float)
    assert result["lengths"]["4"]["loss"] == NA and "pe.max_len=16" in result["lengths"]["4"]["reason"]


def test_a_context_blind_encoder_masks_and_scores_the_same_tokens_at_every_length():
    torch.manual_seed(3)
    model = _context_blind(EncoderMLM(vocab_size=VOCAB, mask_token_id=VOCAB - 1, d_model=16, n_heads=2, n_layers=2, pe=ALiBiPE))
    result = fixed_target_losses(model, _stream(2000), SEQ, multipliers=(1, 4), target_len=SEQ)
    one, four = result["lengths"]["1"], result["lengths"]["4"]
    assert one["n_targets"] == four["n_targets"] > 0
    assert one["n_targets"] < 0.3 * SEQ * result["n_windows"]  # only the masked ~15 % are scored
    assert four["loss"] == pytest.approx(one["loss"], abs=1e-6)


def test_mask_draws_add_independent_draws_whose_first_is_the_single_draw():
    """K draws score each window K times with masks from seeds mask_seed .. mask_seed + K - 1: the targets are the
    sum of the single draws' targets, the loss their target-weighted mean (checked against K=1 runs with each seed)."""
    torch.manual_seed(4)
    model = EncoderMLM(vocab_size=VOCAB, mask_token_id=VOCAB - 1, d_model=16, n_heads=2, n_layers=2, pe=ALiBiPE).eval()
    stream = _stream(2000, seed=4)
    singles = [fixed_target_losses(model, stream, SEQ, multipliers=(1, 2), mask_seed=1234 + d)["lengths"]["2"] for d in range(3)]
    three = fixed_target_losses(model, stream, SEQ, multipliers=(1, 2), mask_seed=1234, mask_draws=3)
    entry = three["lengths"]["2"]
    assert three["mask_draws"] == 3 and entry["n_targets"] == sum(e["n_targets"] for e in singles)
    weighted = sum(e["loss"] * e["n_targets"] for e in singles) / entry["n_targets"]
    assert entry["loss"] == pytest.approx(weighted, rel=1e-6)
    assert len({e["n_targets"] for e in singles}) > 1  # the draws differ: not one draw counted three times
    with pytest.raises(ValueError, match="mask_draws=0"):
        fixed_target_losses(model, stream, SEQ, mask_draws=0)


def test_bad_protocol_settings_are_refused_with_the_value():
    model = DecoderLM(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=1, pe=ALiBiPE).eval()
    with pytest.raises(ValueError, match="target_len=9"):
        fixed_target_losses(model, _stream(), SEQ, target_len=9)
    with pytest.raises(ValueError, match="need >= 2"):
        fixed_target_losses(model, _stream(100), SEQ, multipliers=(1, 16))
