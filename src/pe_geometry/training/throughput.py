"""Throughput logging: Lightning's ThroughputMonitor counting tokens, with FLOPs for MFU."""

from __future__ import annotations

import copy

import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch.callbacks import ThroughputMonitor
from torch import Tensor

from pe_geometry.model.transformer import LanguageModel


def block_batch_size(batch: Tensor | tuple[Tensor, Tensor]) -> int:
    block = batch[0] if isinstance(batch, (tuple, list)) else batch  # data=task: (blocks, answer masks)
    return block.shape[0]


def block_tokens(batch: Tensor | tuple[Tensor, Tensor]) -> int:
    """Tokens read in a batch (data=task scores only its answers, but reads every token). Lightning adds this up per
    batch (its docstring says "per sample", but its counter sums one value per batch), so it must be the whole batch's
    count."""
    block = batch[0] if isinstance(batch, (tuple, list)) else batch
    return block.shape[0] * (block.shape[1] - 1)  # a block of seq_len + 1 tokens trains on seq_len positions


class TokenThroughputMonitor(ThroughputMonitor):
    """Logs ``train/device/items_per_sec`` (tokens/s), ``.../flops_per_sec`` and ``.../mfu`` where the device peak is known."""

    def __init__(self, **kwargs) -> None:
        super().__init__(batch_size_fn=block_batch_size, length_fn=block_tokens, **kwargs)


def training_flops_per_batch(model: LanguageModel, batch_size: int, seq_len: int) -> int | None:
    """FLOPs of one forward + backward on a (batch_size, seq_len + 1) block, counted on a meta-device copy; None for
    a model not ours that cannot run there (a peer, model=xtransformers: x-transformers' rotary calls autocast, which
    the meta device does not have), which then logs tokens/s without FLOPs."""
    meta = copy.deepcopy(model).to("meta")
    block = torch.zeros(batch_size, seq_len + 1, dtype=torch.long, device="meta")
    if isinstance(model, LanguageModel):
        return measure_flops(meta, lambda: meta.loss(block), loss_fn=lambda loss: loss)
    try:
        return measure_flops(meta, lambda: meta.loss(block), loss_fn=lambda loss: loss)
    except RuntimeError:
        return None
