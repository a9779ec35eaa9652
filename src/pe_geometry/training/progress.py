"""What a run says while it trains: one progress bar over the whole run, or plain log lines.

``StepProgress`` counts optimiser steps of the whole run (``trainer.max_steps``), so its ETA is
for the run, not for an epoch; a resumed run starts the bar at its resume step. When stdout is not
a terminal (nohup, a SLURM log, a pipe) it writes one line every ``log_every_n_steps`` steps
instead: step, train loss, last validation loss, tokens/s, ETA. The last step's line waits for the validation
after it, so it shows that step's val/loss (the summary's), not the one before. A job of a sweep starts each
line (and names its bar) with its folder's name, so the lines of jobs that run side by side can be told apart.

``ValidateAtEnd`` asks Lightning to validate after the last step, so every run ends with a
validation loss, also one shorter than ``trainer.val_check_interval``.

``ParameterSummary`` is the model summary without a FLOPs figure Lightning cannot measure here.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from tqdm import tqdm

from pe_geometry.settings.training import StepProgressSettings
from pe_geometry.training.lightning_compat import summary_table

log = logging.getLogger("train")


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m', 125 -> '2m05s', 7 -> '7s'."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StepProgress(ProgressBar):
    """Whole-run progress in optimiser steps: a bar on a terminal, log lines elsewhere."""

    Settings = StepProgressSettings

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        s = self.settings = self.Settings(**settings)
        self.log_every_n_steps = s.log_every_n_steps
        self.use_lines = (not sys.stdout.isatty()) if s.force_lines is None else s.force_lines
        self._enabled = True
        self._bar: tqdm | None = None
        self._start_time = 0.0
        self._start_step = 0
        self._last_step = -1  # the global step at the last batch end: a micro-batch leaves it unchanged
        self._final_line: list[str] | None = None  # the last step's line, printed once its validation has run
        self._job = sweep_job_name()

    # Lightning's ProgressBar interface
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not (self._enabled and trainer.is_global_zero):
            return
        self._start_time, self._start_step = time.monotonic(), trainer.global_step
        self._last_step = trainer.global_step
        self._tokens_per_step = self._tokens_per_optimiser_step(trainer)
        if not self.use_lines:
            self._bar = tqdm(total=trainer.max_steps, initial=trainer.global_step, unit="step", dynamic_ncols=True, file=sys.stdout,
                             desc=self._job)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if not (self._enabled and trainer.is_global_zero) or trainer.global_step == self._last_step:
            return  # (a micro-batch of gradient accumulation: no optimiser step to report)
        step = self._last_step = trainer.global_step
        metrics = trainer.callback_metrics
        train_loss, val_loss = metrics.get("train/loss"), metrics.get("val/loss")
        if self._bar is not None:
            self._bar.update(step - self._bar.n)
            shown = {"loss": f"{float(train_loss):.3f}"} if train_loss is not None else {}
            if val_loss is not None:
                shown["val"] = f"{float(val_loss):.3f}"
            self._bar.set_postfix(shown, refresh=False)
        elif step % self.log_every_n_steps == 0 or step == trainer.max_steps:
            elapsed = time.monotonic() - self._start_time
            done = step - self._start_step
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = format_duration((trainer.max_steps - step) / rate) if rate > 0 else "?"
            parts = [(f"[{self._job}] " if self._job else "") + f"step {step}/{trainer.max_steps}"]
            if train_loss is not None:
                parts.append(f"train/loss {float(train_loss):.4f}")
            parts.append(f"{rate * self._tokens_per_step:,.0f} tokens/s")
            parts.append(f"ETA {eta}")
            if step == trainer.max_steps:  # ValidateAtEnd validates after this step: print the line with its val/loss
                self._final_line = parts
            else:
                self._log_line(parts, val_loss)

    def _log_line(self, parts: list[str], val_loss) -> None:
        """The parts with the val/loss inserted after the train loss (before tokens/s)."""
        shown = f"val/loss {float(val_loss):.4f}" if val_loss is not None else "val/loss -"
        log.info(" | ".join(parts[:-2] + [shown] + parts[-2:]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._final_line is not None:
            self._log_line(self._final_line, trainer.callback_metrics.get("val/loss"))
            self._final_line = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)

    @staticmethod
    def _tokens_per_optimiser_step(trainer: L.Trainer) -> int:
        dm = getattr(trainer, "datamodule", None)
        if dm is None:
            return 0
        return int(dm.batch_size * dm.seq_len * trainer.accumulate_grad_batches * trainer.world_size)


def sweep_job_name() -> str | None:
    """The job's folder name (``0_decoder-learned-s0``) when Hydra runs this process as a job of a sweep; None otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    return Path(HydraConfig.get().runtime.output_dir).name


class ValidateAtEnd(L.Callback):
    """Validate once after the last optimiser step (Lightning otherwise only validates every
    ``val_check_interval`` steps, so a run stopping between two checks ends without a val loss)."""

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            # Lightning validates on a requested stop (its early-stopping path) before ending the loop.
            trainer.should_stop = True


class ParameterSummary(ModelSummary):
    """Lightning's model summary (``ModelSummary(max_depth=1)``) without its FLOPs column and total: Lightning
    counts FLOPs only through an ``example_input_array``, which the task has not, so they read 0
    (``throughput/*`` logs the real rate). The public callback has no switch for them; its ``summarize`` (the
    method Lightning's own ``RichModelSummary`` overrides) gets the columns, and this one drops the FLOPs column."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes, *args, **kwargs) -> None:
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = summary_table(columns, total_parameters, trainable_parameters, model_size, total_training_modes)
        log.info("\n%s", "\n".join(line for line in table.splitlines() if not line.endswith("Total Flops")))

