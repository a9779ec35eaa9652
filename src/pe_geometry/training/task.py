"""The LightningModule: wraps any model with a ``loss(block)`` method."""

from __future__ import annotations

import logging
import os
import random

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from pe_geometry.data.tasks import answer_accuracy
from pe_geometry.model.loss import head_cross_entropy
from pe_geometry.model.transformer import LanguageModel
from pe_geometry.training.optimizer import OptimizerFactory, adamw_warmup_cosine

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss, or the weights after an optimiser step, became NaN or inf."""


def first_non_finite_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or inf, else None (one device sync for all parameters).

    It runs after every optimiser step, so the common case is one fused pass: a tensor's norm is finite
    exactly when its entries are (short of a norm overflowing, which the exact pass then clears). Checking
    ``isfinite`` tensor by tensor cost 7.6 ms a step at the benchmark's larger config, 0.7 % of the step.
    """
    named = [(name, p.detach()) for name, p in module.named_parameters()]
    if not named or bool(torch.stack(torch._foreach_norm([p for _, p in named])).isfinite().all()):
        return None
    return next((name for name, p in named if not p.isfinite().all()), None)


def split_batch(batch: Tensor | tuple[Tensor, Tensor] | list[Tensor]) -> tuple[Tensor, Tensor | None]:
    """(block, answer mask): a text datamodule serves blocks alone (mask None), data=task (blocks, answer masks)."""
    if isinstance(batch, (tuple, list)):
        block, answer_mask = batch
        return block, answer_mask
    return batch, None


def answer_loss(model: LanguageModel, block: Tensor, answer_mask: Tensor,
                with_logits: bool = True) -> tuple[Tensor, Tensor | None]:
    """Cross-entropy on the answer tokens only, and the logits: a decoder's next-token targets are ``block[:, 1:]``,
    so ``answer_mask[:, 1:]`` says which of them are scored. ``with_logits=False`` (training): no logits (None), and a
    model with ``model.loss_chunk`` set runs its head on the answer rows alone, fused with the loss (model/loss.py)."""
    scored = answer_mask[:, 1:]
    chunk = getattr(model, "loss_chunk", None)  # (a peer, or a stand-in, has none)
    if not with_logits and chunk is not None:
        hidden, targets = model.logits_and_targets(block, head=False)
        return head_cross_entropy(hidden[scored], model.head.weight, targets[scored], chunk), None
    logits, targets = model.logits_and_targets(block)
    return F.cross_entropy(logits[scored].float(), targets[scored]), logits


class LanguageModelTask(L.LightningModule):
    """Trains ``model`` on its own ``loss(block)``, or on the answer tokens alone where the batches carry an answer
    mask (data=task); ``optimizer`` (configs/optimizer/, settings bound by Hydra) builds the optimiser and LR schedule
    for a run of ``max_steps`` steps."""

    def __init__(self, model: LanguageModel, optimizer: OptimizerFactory = adamw_warmup_cosine, max_steps: int = 1000) -> None:
        super().__init__()
        self.model = model
        self.build_optimizer, self.max_steps = optimizer, max_steps

    def setup(self, stage: str) -> None:
        # ThroughputMonitor reads this to log FLOP/s (and MFU where the device's peak is known); counting it traces a
        # meta-device copy of the model (0.3-0.6 s of a tiny fit), so only a run that logs throughput pays it.
        from lightning.pytorch.callbacks import ThroughputMonitor

        dm = getattr(self.trainer, "datamodule", None)
        logs_throughput = any(isinstance(cb, ThroughputMonitor) for cb in getattr(self.trainer, "callbacks", ()))
        if dm is not None and logs_throughput and not hasattr(self, "flops_per_batch"):
            from pe_geometry.training.throughput import training_flops_per_batch

            self.flops_per_batch = training_flops_per_batch(self.model, dm.batch_size, dm.seq_len)
        if stage == "fit" and self.global_rank > 0:
            # Every DDP rank is seeded alike, so each drew the same MLM masks and dropout (on other text). Rank r > 0
            # gets its own stream, seeded from (seed, r) hashed (not seed + r: seed 1's rank 0 would be seed 0's
            # rank 1); rank 0 keeps the seeded one, so a single process trains as before. A resume then restores
            # each rank's saved state.
            seed = int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))
            torch.manual_seed(int(np.random.SeedSequence([seed, self.global_rank]).generate_state(1)[0]))  # CPU and accelerators

    def training_step(self, batch: Tensor | tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        block, answer_mask = split_batch(batch)
        loss = self.model.loss(block) if answer_mask is None else answer_loss(self.model, block, answer_mask, with_logits=False)[0]
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss is {loss.item()} at step {self.global_step}; stopping. The last good "
                "checkpoint is kept (checkpoints/last.ckpt); try a lower optimizer.lr or gradient clipping"
            )
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:
        step = self.global_step  # the step being taken, as in the loss check's message
        super().optimizer_step(*args, **kwargs)
        # A finite loss can still take a step to NaN/inf weights (a huge learning rate): stop here, before
        # the checkpoint callback saves them as "last good" or the geometry callback measures them.
        bad = first_non_finite_parameter(self.model)
        if bad is not None:
            raise NonFiniteLossError(
                f"weights became non-finite ({bad} holds nan/inf) in the optimiser step of step {step}; stopping. "
                "The last good checkpoint is kept (checkpoints/last.ckpt); try a lower optimizer.lr or gradient clipping"
            )

    def validation_step(self, batch: Tensor | tuple[Tensor, Tensor], batch_idx: int) -> None:
        # Validation's random draws (MLM masks) must not advance the training RNG: a run resumed
        # from a checkpoint saved just before a validation skips that validation (Lightning), and
        # would otherwise draw different training masks from then on than the uninterrupted run.
        block, answer_mask = split_batch(batch)
        device = block.device
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
            if answer_mask is None:
                loss = self.model.loss(block)
            else:
                loss, logits = answer_loss(self.model, block, answer_mask)
        if answer_mask is None:
            self.log("val/loss", loss, prog_bar=True, sync_dist=True)
            return
        score = answer_accuracy(logits, block, answer_mask)
        n_answer = int(score.n_answer.sum())
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=n_answer)  # (per answer token)
        self.log("val/answer_accuracy", score.token_accuracy, sync_dist=True, batch_size=n_answer)
        self.log("val/answer_exact_match", score.exact_match_rate, sync_dist=True, batch_size=len(block))

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self) -> dict:
        return self.build_optimizer(self.model, max_steps=self.max_steps)

    # Random states travel with the checkpoint, so a resumed run draws the same masks and dropout as the
    # uninterrupted one: every rank's (each draws its own; rank 0 alone writes the file), each with its
    # accelerator's generator (masks are drawn on the tokens' device). "rng_states" stays rank 0's, as before.
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
                  "devices": accelerator_rng_states(self.device)}
        per_rank = gather_from_ranks(states)  # a collective: Lightning builds the checkpoint on every rank
        checkpoint["rng_states"], checkpoint["rng_states_per_rank"] = per_rank[0], per_rank

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        per_rank = checkpoint.get("rng_states_per_rank")
        if per_rank is None:  # a checkpoint from before per-rank states: one state, restored on every rank
            states = checkpoint.get("rng_states")
        elif self.global_rank < len(per_rank):
            states = per_rank[self.global_rank]
        else:
            log.warning("the checkpoint has random states for %d rank(s), not rank %d: its stream starts afresh "
                        "(the resume is not exact)", len(per_rank), self.global_rank)
            states = None
        if states is not None:
            torch.set_rng_state(states["torch"])
            np.random.set_state(states["numpy"])
            random.setstate(states["python"])
            set_accelerator_rng_states(states.get("devices", {}))


def accelerator_rng_states(device: torch.device) -> dict:
    """The generator state of every CUDA device (``{"cuda": [...]}``), else of ``device``'s accelerator (mps, xpu...)."""
    if torch.cuda.is_available():
        return {"cuda": torch.cuda.get_rng_state_all()}
    if device.type not in ("cpu", "meta"):
        return {device.type: torch.get_device_module(device.type).get_rng_state()}
    return {}


def set_accelerator_rng_states(states: dict) -> None:
    """Restore what ``accelerator_rng_states`` saved, on the accelerators this process has."""
    for kind, state in states.items():
        module = torch.get_device_module(kind)
        if not module.is_available():  # a GPU checkpoint resumed on CPU, say: nothing to restore
            continue
        if kind == "cuda":
            module.set_rng_state_all(state[: module.device_count()])
        else:
            module.set_rng_state(state)


def gather_from_ranks(obj) -> list:
    """``obj`` of every rank, indexed by global rank (``[obj]`` in a single process). A collective under DDP."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
