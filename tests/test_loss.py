"""The fused head + cross-entropy (model/loss.py, ``model.loss_chunk``) against F.cross_entropy on the full logits."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from pe_geometry.model import DecoderLM, EncoderDecoder, EncoderMLM, TokenEmbedding
from pe_geometry.model.loss import IGNORE_INDEX, head_cross_entropy
from pe_geometry.settings.base import SettingsError
from pe_geometry.settings.model import DecoderSettings
from pe_geometry.training.task import answer_loss


def reference(hidden, weight, targets):
    logits = hidden @ weight.T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 4, 1000])  # one row at a time, chunks that do not divide the rows, one chunk
def test_loss_and_gradients_match_cross_entropy_on_the_full_logits(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(50, (3, 7))
    targets[0, :3] = IGNORE_INDEX
    targets[2, 6] = IGNORE_INDEX
    fused = head_cross_entropy(hidden, weight, targets, chunk)
    expected = reference(hidden, weight, targets)
    # an upstream gradient that is not 1 (gradient accumulation divides the loss): backward must scale by it
    got_grads = torch.autograd.grad(2.5 * fused, (hidden, weight))
    want_grads = torch.autograd.grad(2.5 * expected, (hidden, weight))
    assert fused.item() == pytest.approx(expected.item(), rel=1e-6)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grads[0][0, :3].abs().max() == 0  # an ignored row gets no gradient


def test_a_hand_checked_case():
    """Logits row 0: (ln 2, 0, 0), softmax (1/2, 1/4, 1/4), target 0: loss ln 2; row 1: (0, 0, 0): ln 3; row 2 ignored.
    Mean ln(6)/2; d loss / d hidden_i = (softmax_i - onehot_i) @ W / 2: row 0 (1/2 - 1) ln 2 / 2, row 1 (1/3) ln 2 / 2."""
    hidden = torch.tensor([[1.0], [0.0], [5.0]], requires_grad=True)
    weight = torch.tensor([[math.log(2)], [0.0], [0.0]], requires_grad=True)
    loss = head_cross_entropy(hidden, weight, torch.tensor([0, 2, IGNORE_INDEX]), chunk=2)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(6) / 2, rel=1e-6)
    assert hidden.grad[:, 0].tolist() == pytest.approx([-math.log(2) / 4, math.log(2) / 6, 0.0], abs=1e-7)
    # d loss / d W[j] = sum_i (softmax_ij - onehot_ij) h_i / 2: only row 0 has h != 0, so (1/2 - 1, 1/4, 1/4) / 2
    assert weight.grad[:, 0].tolist() == pytest.approx([-0.25, 0.125, 0.125], abs=1e-7)


def test_every_target_ignored_gives_nan_and_zero_gradients_as_cross_entropy_does():
    hidden = torch.randn(4, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    targets = torch.full((4,), IGNORE_INDEX)
    fused, expected = head_cross_entropy(hidden, weight, targets), reference(hidden, weight, targets)
    assert math.isnan(fused.item()) and math.isnan(expected.item())
    assert torch.autograd.grad(fused, hidden)[0].abs().max() == 0


def test_without_gradients_the_loss_is_the_same():
    torch.manual_seed(1)
    hidden, weight, targets = torch.randn(20, 8), torch.randn(30, 8), torch.randint(30, (20,))
    with torch.no_grad():
        assert head_cross_entropy(hidden, weight, targets, 3).item() == pytest.approx(reference(hidden, weight, targets).item(), rel=1e-6)


def test_under_bf16_autocast_it_stays_close_to_the_plain_path():
    """bf16-mixed (trainer=gpu): the head's matmuls in bf16 as nn.Linear's are, the loss in float32; the two paths
    round differently, so they agree to bf16's precision, not float32's."""
    torch.manual_seed(2)
    hidden = torch.randn(64, 32, requires_grad=True)
    weight = (0.3 * torch.randn(100, 32)).requires_grad_()
    targets = torch.randint(100, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = head_cross_entropy(hidden, weight, targets, 16)
        expected = F.cross_entropy(F.linear(hidden, weight), targets)
    assert fused.dtype == torch.float32
    assert fused.item() == pytest.approx(expected.item(), rel=1e-2)
    got, want = torch.autograd.grad(fused, hidden)[0], torch.autograd.grad(expected, hidden)[0]
    assert got.dtype == torch.float32 and (got - want).abs().max() < 2e-2 * want.abs().max()


def test_chunk_must_be_positive():
    with pytest.raises(ValueError, match="chunk=0"):
        head_cross_entropy(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([1, 2]), chunk=0)
    with pytest.raises(SettingsError, match="model.loss_chunk=0"):
        DecoderSettings(loss_chunk=0)


LAYOUTS = [
    (DecoderLM, {}),
    (EncoderMLM, {"mask_token_id": 3}),  # 85 % of its targets ignored: the fused head runs on the masked rows only
    (EncoderDecoder, {}),
]


def twin_models(cls, extra, tie_weights: bool, chunk: int = 5):
    """The same model (same weights) with the plain loss and with the fused one."""
    parts = dict(vocab_size=300, d_model=32, n_heads=4, n_layers=2, embedding=partial(TokenEmbedding, tie_weights=tie_weights))
    torch.manual_seed(0)
    plain = cls(**parts, **extra, loss_chunk=None)
    fused = cls(**parts, **extra, loss_chunk=chunk)
    fused.load_state_dict(plain.state_dict())
    return plain, fused


@pytest.mark.parametrize("tie_weights", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("cls,extra", LAYOUTS, ids=[c.__name__ for c, _ in LAYOUTS])
def test_a_models_fused_loss_and_gradients_are_its_plain_ones(cls, extra, tie_weights):
    plain, fused = twin_models(cls, extra, tie_weights)
    assert (fused.head.weight is fused.W_E) == tie_weights
    block = torch.randint(300, (3, 17))
    losses = []
    for model in (plain, fused):
        loss = model.loss(block, generator=torch.Generator().manual_seed(1))  # the same MLM masks in both
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    # reduction="none" (per-target losses, for analysis) is the plain path's either way
    torch.testing.assert_close(fused.loss(block, reduction="none", generator=torch.Generator().manual_seed(1)),
                               plain.loss(block, reduction="none", generator=torch.Generator().manual_seed(1)), equal_nan=True)


def test_the_answer_loss_of_a_task_run_is_the_same_fused():
    plain, fused = twin_models(DecoderLM, {}, tie_weights=True)
    block = torch.randint(300, (4, 17))
    answer_mask = torch.zeros(4, 17, dtype=torch.bool)
    answer_mask[:, 12:] = True
    expected, logits = answer_loss(plain, block, answer_mask)
    got, none = answer_loss(fused, block, answer_mask, with_logits=False)
    assert none is None and logits.shape == (4, 16, 300)
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    expected.backward()
    got.backward()
    torch.testing.assert_close(fused.W_E.grad, plain.W_E.grad, rtol=1e-5, atol=1e-7)


def test_fifty_training_steps_give_the_same_losses():
    """The loss curve, not one step: AdamW divides by the gradient's running RMS, so a gradient that differed in
    more than rounding would show within a few steps."""
    plain, fused = twin_models(DecoderLM, {}, tie_weights=True, chunk=24)
    curves = []
    for model in (plain, fused):
        torch.manual_seed(3)  # the same batches for both
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        curve = []
        for _ in range(50):
            loss = model.loss((torch.randint(20, (4, 1)) + torch.arange(17)) % 20)  # next token: this one + 1 (mod 20)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
    assert curves[0][-1] < curves[0][0] - 1  # it learned (a curve that stayed flat would compare nothing)
    assert curves[1] == pytest.approx(curves[0], abs=1e-5)
