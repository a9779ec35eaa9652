"""The output head and its cross-entropy in one step, a chunk of rows at a time: ``head_cross_entropy``.

``F.cross_entropy(hidden @ W.T, targets)`` holds the (N, vocab) logits, writes their log-softmax (another N x vocab),
and its backward writes a zero-filled (N, vocab) gradient, then the log-softmax's gradient (a third): at the
benchmark's d 256 / vocab 8192 shape that memory traffic was 18 % of a training step. ``head_cross_entropy`` computes
the same loss and the same gradients (to float rounding) while only one chunk of ``chunk`` rows x vocab logits exists
at a time: per chunk, the logits, their log-softmax (the loss), and at once the gradient
``softmax - onehot`` (written over the log-softmax) times the head and times the hidden rows (as Liger-Kernel's
fused linear cross-entropy does it). Backward then only scales the two stored gradients by the loss's own gradient.
The matrix multiplies are the ones the plain path does (3 x N x d x vocab x 2 FLOPs); what goes is the vocab-sized
memory traffic besides them. Rows whose target is ``IGNORE_INDEX`` are dropped before the head (an encoder's
unmasked 85 %).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

IGNORE_INDEX = -100  # targets with this id do not count in the loss


class HeadCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``; the gradients are computed in the forward pass
    (when asked for) and kept, so nothing vocab-sized outlives a chunk. Not twice differentiable."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        """hidden (N, D), weight (vocab, D), targets (N,) -> the mean loss over the targets that are not IGNORE_INDEX."""
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        keep = targets != IGNORE_INDEX
        n = targets.numel() if targets.is_meta else int(keep.sum())  # (the FLOP count's meta copy has no values)
        every_row = n == targets.numel()
        rows = hidden if every_row else hidden[keep]  # (n, D): the head runs on scored rows only
        scored = targets if every_row else targets[keep]
        # Under autocast (bf16-mixed) the head's matmuls run in the autocast dtype, as nn.Linear's would; the
        # log-softmax and both gradients accumulate in float32, as F.cross_entropy's do under autocast.
        kind = hidden.device.type
        autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)  # (meta has no autocast)
        dtype = torch.get_autocast_dtype(kind) if autocast else hidden.dtype
        w = weight.to(dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_rows = torch.empty(rows.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
            for start in range(0, n, chunk):
                h, t = rows[start : start + chunk].to(dtype), scored[start : start + chunk]
                log_probs = torch.log_softmax((h @ w.T).float(), dim=1)  # (c, vocab)
                total -= log_probs.gather(1, t[:, None]).sum()
                if not (want_hidden or want_weight):
                    continue
                dlogits = log_probs.exp_()  # softmax, in place of the log-softmax: d loss_i / d logits_i + onehot
                dlogits[torch.arange(len(t), device=t.device), t] -= 1
                dlogits = dlogits.to(dtype)
                if want_hidden:
                    grad_rows[start : start + chunk] = dlogits @ w  # (c, D)
                if want_weight:  # summed over the chunks in float32 (not addmm_: the FLOP counter skips in-place ops)
                    grad_weight += (dlogits.T @ h).float()
        # n = 0 (every target ignored): loss 0/0 = nan and zero gradients, as F.cross_entropy gives
        scale = 1.0 / n if n else 0.0
        if want_hidden:
            grad_rows.mul_(scale)
            if not every_row:
                grad_rows = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device).index_put_((keep,), grad_rows)
            grad_rows = grad_rows.to(hidden.dtype)
        if want_weight:
            grad_weight = grad_weight.mul_(scale).to(weight.dtype)
        ctx.save_for_backward(grad_rows, grad_weight)
        return total / n if n else total * float("nan")

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        grad_rows, grad_weight = ctx.saved_tensors
        return (None if grad_rows is None else grad_rows * grad_loss,
                None if grad_weight is None else grad_weight * grad_loss, None, None)


def head_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int = 1024) -> Tensor:
    """``F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX)`` (mean over the scored targets)
    without the full logits: ``chunk`` rows at a time. hidden (..., D), weight (vocab, D), targets (...)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 (rows of logits at a time)")
    return HeadCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), chunk)
