"""Every use of Lightning's private API, one named function each: the one module to read when Lightning changes.

pyproject.toml allows ``lightning>=2.6,<2.7``; each function says the versions it was checked at, and
``tests/test_lightning_compat.py`` runs every one against a real ``Trainer``, which CI does at both bounds (``.ci/run``:
the newest allowed versions, then the lowest, ``.ci/lowest_constraints.py``). Why each is needed (there is no public
way to do it) is said where it is used: ``training.interrupt`` (the stop signals), ``training.callbacks`` (the step
checkpoint, the CSV logger), ``training.pipeline`` (the W&B logger), ``training.progress`` (the parameter summary).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


# -- the trainer's signal connector ---------------------------------------------------------------------------------
def set_stop_flag(trainer: L.Trainer, stop: bool) -> None:
    """Raise (or lower) the flag Lightning's SIGTERM handler raises: while set, Lightning raises ``SIGTERMException`` at
    the end of the current training batch and after each validation batch but the last; ``trainer.received_sigterm``
    reads it. Checked at Lightning 2.6.0 and 2.6.6 (``trainer._signal_connector.received_sigterm``)."""
    trainer._signal_connector.received_sigterm = stop


def cluster_environment(trainer: L.Trainer) -> Any:
    """The cluster environment whose ``auto_requeue`` Lightning reads when it installs its signal handlers (a
    single-device strategy has no ``cluster_environment`` of its own). Checked at Lightning 2.6.0 and 2.6.6
    (``trainer._accelerator_connector.cluster_environment``)."""
    return trainer._accelerator_connector.cluster_environment


def restore_after_fit(trainer: L.Trainer, signum: int, handler: Any) -> None:
    """Make ``handler`` the one Lightning's teardown puts back for ``signum`` (it puts back the handlers installed before
    fit). Checked at Lightning 2.6.0 and 2.6.6 (``trainer._signal_connector._original_handlers``)."""
    trainer._signal_connector._original_handlers[signum] = handler


# -- the fit loop ---------------------------------------------------------------------------------------------------
def validates_after_this_batch(trainer: L.Trainer) -> bool:
    """Whether the fit loop runs a validation right after the training batch that just ended (called from
    ``on_train_batch_end``): Lightning's own decision. A validation split without a whole batch never reaches
    ``on_validation_end``: no validation, as Lightning's ModelCheckpoint decides for its own deferred save. Checked at
    Lightning 2.6.0 and 2.6.6 (``epoch_loop._skip_next_val``, ``epoch_loop._should_check_val_fx``,
    ``fit_loop._data_fetcher``)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    val_batches = trainer.num_val_batches
    return (trainer.state.fn == "fit" and not getattr(epoch_loop, "_skip_next_val", False)
            and sum(val_batches if isinstance(val_batches, list) else [val_batches]) > 0
            and bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)))


# -- ModelCheckpoint ------------------------------------------------------------------------------------------------
def last_saved_step(checkpoint: ModelCheckpoint) -> int:
    """The global step ``checkpoint`` saved last (0 before its first save). Checked at Lightning 2.6.0 and 2.6.6
    (``ModelCheckpoint._last_global_step_saved``)."""
    return checkpoint._last_global_step_saved


def mark_saved(checkpoint: ModelCheckpoint, step: int) -> None:
    """Have ``checkpoint`` take ``step`` as saved already: it does not save that step again. Checked at Lightning 2.6.0
    and 2.6.6 (``ModelCheckpoint._last_global_step_saved``)."""
    checkpoint._last_global_step_saved = step


def step_interval(checkpoint: ModelCheckpoint) -> int | None:
    """``every_n_train_steps`` when ``checkpoint`` saves on a grid of steps, else None (none, or a time interval).
    Checked at Lightning 2.6.0 and 2.6.6 (``ModelCheckpoint._every_n_train_steps``, ``._train_time_interval``)."""
    every = checkpoint._every_n_train_steps
    return every if checkpoint._train_time_interval is None and every >= 1 else None


def skips_saving(checkpoint: ModelCheckpoint, trainer: L.Trainer) -> bool:
    """Lightning's own reasons not to save now (a sanity check, a fast dev run, this step saved already...). Checked at
    Lightning 2.6.0 and 2.6.6 (``ModelCheckpoint._should_skip_saving_checkpoint``)."""
    return checkpoint._should_skip_saving_checkpoint(trainer)


def save_top_k(checkpoint: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Save what ``checkpoint`` keeps of this step (its top-k, or the step file when it monitors nothing). Checked at
    Lightning 2.6.0 and 2.6.6 (``ModelCheckpoint._save_topk_checkpoint``, ``._monitor_candidates``)."""
    checkpoint._save_topk_checkpoint(trainer, checkpoint._monitor_candidates(trainer))


def save_last(checkpoint: ModelCheckpoint, trainer: L.Trainer) -> None:
    """Save ``last.ckpt`` now (its public hooks save it only beside a step file, or when none was saved at all; its
    ``save_on_exception`` saves on every exception, a NaN loss too, and a step file besides). Checked at Lightning
    2.6.0 and 2.6.6 (``ModelCheckpoint._save_last_checkpoint``, ``._monitor_candidates``)."""
    checkpoint._save_last_checkpoint(trainer, checkpoint._monitor_candidates(trainer))


# -- loggers --------------------------------------------------------------------------------------------------------
def started_experiment(logger: Any) -> Any:
    """A logger's experiment (the CSV writer, the W&B run) if it has been started, else None; reading
    ``logger.experiment`` would start one. Checked at Lightning 2.6.0 and 2.6.6 (``Logger._experiment`` of
    ``CSVLogger`` and ``WandbLogger``)."""
    return logger._experiment


def set_experiment(logger: Any, experiment: Any) -> None:
    """Give a logger its experiment, as its own ``experiment`` property does when it starts one (a subclass that
    builds another writer). Checked at Lightning 2.6.0 and 2.6.6 (``CSVLogger._experiment``)."""
    logger._experiment = experiment


def drop_wandb_init_argument(logger: Any, name: str) -> None:
    """Leave ``name`` out of what a ``WandbLogger`` passes to ``wandb.init`` (it always passes ``anonymous``, None by
    default, which newer wandb deprecates with a warning). Checked at Lightning 2.6.0 and 2.6.6
    (``WandbLogger._wandb_init``)."""
    logger._wandb_init.pop(name, None)


# -- the model summary ----------------------------------------------------------------------------------------------
def summary_table(columns: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int]) -> str:
    """Lightning's own model-summary table of ``columns`` (what ``ModelSummary.summarize`` gets), its FLOPs total 0 (it
    ends in a "Total Flops" line). Checked at Lightning 2.6.0 and 2.6.6
    (``lightning.pytorch.utilities.model_summary.model_summary._format_summary_table``: total, trainable, size in MB,
    ``{"train": n, "eval": n}``, total FLOPs, then the columns)."""
    from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

    return _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, 0, *columns)
