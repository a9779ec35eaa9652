"""The LightningModule: wraps any model with a ``loss(block)`` method."""

from __future__ import annotations

import logging
import math
import os
import random

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from pe_geometry.model.embedding import TokenEmbedding
from pe_geometry.model.positional import PositionalEncoding
from pe_geometry.model.transformer import LanguageModel

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss, or the weights after an optimiser step, became NaN or inf."""


def first_non_finite_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first parameter holding a NaN or inf, else None (one device sync for all parameters)."""
    named = [(name, p) for name, p in module.named_parameters()]
    if not named or bool(torch.stack([p.detach().isfinite().all() for _, p in named]).all()):
        return None
    return next(name for name, p in named if not p.detach().isfinite().all())


def embedding_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The word embedding(s) and the parameters of the positional encoding(s): E and a learned P."""
    modules = [m for m in model.modules() if isinstance(m, (TokenEmbedding, PositionalEncoding))]
    return list({id(p): p for m in modules for p in m.parameters()}.values())


def warmup_cosine(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warm-up, then cosine decay to ``min_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LanguageModelTask(L.LightningModule):
    def __init__(
        self,
        model: LanguageModel,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 100,
        min_lr_ratio: float = 0.1,
        max_steps: int = 1000,
        no_decay_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.save_hyperparameters(ignore=["model"])

    def setup(self, stage: str) -> None:
        # ThroughputMonitor reads this to log FLOP/s (and MFU where the device's peak is known).
        dm = getattr(self.trainer, "datamodule", None)
        if dm is not None and not hasattr(self, "flops_per_batch"):
            from pe_geometry.training.throughput import training_flops_per_batch

            self.flops_per_batch = training_flops_per_batch(self.model, dm.batch_size, dm.seq_len)
        if stage == "fit" and self.global_rank > 0:
            # Every DDP rank is seeded alike, so each drew the same MLM masks and dropout (on other text). Rank r > 0
            # gets its own stream, seeded from (seed, r) hashed (not seed + r: seed 1's rank 0 would be seed 0's
            # rank 1); rank 0 keeps the seeded one, so a single process trains as before. A resume then restores
            # each rank's saved state.
            seed = int(os.environ.get("PL_GLOBAL_SEED", torch.initial_seed()))
            torch.manual_seed(int(np.random.SeedSequence([seed, self.global_rank]).generate_state(1)[0]))  # CPU and accelerators

    def training_step(self, block: Tensor, batch_idx: int) -> Tensor:
        loss = self.model.loss(block)
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

    def validation_step(self, block: Tensor, batch_idx: int) -> None:
        # Validation's random draws (MLM masks) must not advance the training RNG: a run resumed
        # from a checkpoint saved just before a validation skips that validation (Lightning), and
        # would otherwise draw different training masks from then on than the uninterrupted run.
        device = block.device
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device], device_type=device.type):
            loss = self.model.loss(block)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        # Decay matrices only: biases, norms and 1-d parameters keep their scale. With no_decay_embeddings
        # the word embedding and a learned position table keep theirs too (decay shrinks E and P towards
        # the origin, a pull that could shape their geometry); a tied output head is E, so it goes with it.
        params = [p for p in self.model.parameters() if p.requires_grad]
        kept = {id(p) for p in embedding_parameters(self.model)} if hp.get("no_decay_embeddings") else set()
        decay = [p for p in params if p.dim() >= 2 and id(p) not in kept]
        no_decay = [p for p in params if p.dim() < 2 or id(p) in kept]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, hp.warmup_steps, hp.max_steps, hp.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

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
