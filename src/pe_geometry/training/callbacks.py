"""Lightning callbacks and loggers of the training loop itself (geometry recording lives in experiments/)."""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.exceptions import SIGTERMException

# the same temp-file-then-rename writer as the token cache; a full or read-only disk raises StorageError naming the file
from pe_geometry.data.cache import append_bytes, atomic_write_bytes, storage_errors

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes a checkpoint to a temporary file *in the checkpoint's own directory*, fsyncs it, then renames it.

    Lightning's save stages the file in the system temp directory and moves it, which is a copy, not an
    atomic rename, when that directory is on another filesystem (a node's /tmp vs a shared run dir).
    Remote URLs (``s3://...``) keep Lightning's behaviour. A full or read-only disk raises ``StorageError`` naming
    the checkpoint; its temporary file is removed and the checkpoint already at that path is left whole.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(Path(path), buffer.getvalue())


def remove_partial_writes(run_dir: Path) -> list[Path]:
    """Delete the temporary files (``.<name>.<random>.tmp``) that a killed atomic write left in a run directory.

    Only the run's own folders are swept (not the shared token cache, where another run may be writing).
    Call it on global rank 0 before training starts, when no write of this run is in flight.
    """
    removed = []
    for folder in (run_dir, run_dir / "checkpoints", run_dir / "csv"):
        for path in folder.glob(".*.tmp") if folder.is_dir() else ():
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.warning("removed %d half-written file(s) left by a killed run: %s", len(removed), ", ".join(p.name for p in removed))
    return removed


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also writes ``last.ckpt`` at the end and on an interruption.

    - With ``every_n_train_steps`` set, Lightning only saves on those steps, so a run
      of 1000 steps checkpointed every 300 would end with step 900 as "last".
    - Ctrl-C and SIGTERM (a scheduler pre-empting the job) save ``last.ckpt`` before
      exiting (``training.interrupt.GracefulStop`` stops between steps). Any other error
      (a NaN loss, say) keeps the last good checkpoint.
    Checkpoints are written by ``AtomicCheckpointIO``, so a kill during a save never
    leaves a truncated ``last.ckpt``.
    """

    def __init__(self, *args, **kwargs) -> None:
        # A resume from an older checkpoint re-saves step files that exist: overwrite them (and last.ckpt),
        # rather than writing step...-v1.ckpt and last-v1.ckpt beside a stale last.ckpt.
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_new(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        # A run stopping after this validation (GracefulStop raised the flag) saves here, where Lightning's own
        # after-validation checkpoints are taken: their resume skips the finished validation and counts the
        # logging step on by one. Saved later, on the exception, Lightning had already counted that step, the
        # resume counted it again, and every later train/loss and lr row was logged one step late.
        if trainer.received_sigterm and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save_on_stop(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # GracefulStop turns Ctrl-C and SIGTERM into this exception between steps, where step, data position and
        # RNG agree. A bare KeyboardInterrupt (Ctrl-C twice) can come mid-step: saving then would resume one batch off.
        if isinstance(exception, SIGTERMException):
            self._save_on_stop(trainer)

    def _save_on_stop(self, trainer: L.Trainer) -> None:
        if self.save_last and self._last_global_step_saved < trainer.global_step:
            log.warning("interrupted at step %d: saving last.ckpt in %s", trainer.global_step, self.dirpath)
        self._save_last_if_new(trainer)

    def _save_last_if_new(self, trainer: L.Trainer) -> None:
        if self.save_last and self._last_global_step_saved < trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class _ResumingWriter(ExperimentWriter):
    """A crash-safe metrics.csv that keeps the rows of an interrupted run up to the resume step, then appends.

    - Crash-safe: Lightning rewrites the whole file in place when a new column appears (the first
      ``val/loss``, say), and a kill during that rewrite leaves it empty. Here every rewrite goes to a
      temporary file that is renamed over the old one, so a kill leaves the previous complete file;
      plain appends add whole rows, and a row cut short by a kill is dropped when the file is read back.
    - Resumable: Lightning's writer deletes an existing metrics.csv. On resume we keep the rows logged up
      to and including the checkpoint's step, and drop any new row whose (step, metric names) is already
      there, so the series has no gap and no duplicate, and re-running a finished run's resume keeps its
      final rows.
    """

    def __init__(self, log_dir: str, resume_step: int | None) -> None:
        super().__init__(log_dir)  # (its check that deletes metrics.csv is replaced below)
        kept, header = [], []
        if resume_step is not None:
            header, rows = read_complete_rows(Path(self.metrics_file_path))
            kept = [row for row in rows if row.get("step") and int(row["step"]) <= resume_step]
        self._seen = {self._row_key(row) for row in kept}
        self.metrics_keys = sorted(header) if kept else []
        if kept:
            self._replace_file(kept)
        elif os.path.isfile(self.metrics_file_path):
            with storage_errors(Path(self.metrics_file_path)):
                os.remove(self.metrics_file_path)  # a fresh run in a used directory starts a fresh series (Lightning's rule)

    def _check_log_dir_exists(self) -> None:
        """Lightning deletes an existing metrics.csv here; ``__init__`` decides what to keep instead."""

    @staticmethod
    def _row_key(row: dict) -> tuple:
        return int(row["step"]), frozenset(k for k, v in row.items() if k != "step" and v not in ("", None))

    def _replace_file(self, rows: list[dict]) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(Path(self.metrics_file_path), text.getvalue().encode())

    def save(self) -> None:
        self.metrics = [m for m in self.metrics if self._row_key(m) not in self._seen]
        if not self.metrics:
            return
        self._record_new_keys()
        header, _ = read_complete_rows(Path(self.metrics_file_path), header_only=True)
        if sorted(header) != self.metrics_keys:  # a new column (or no file yet): rewrite the whole file
            _, old_rows = read_complete_rows(Path(self.metrics_file_path))
            self._replace_file(old_rows + self.metrics)
        else:
            text = io.StringIO()
            csv.DictWriter(text, fieldnames=self.metrics_keys).writerows(self.metrics)
            append_bytes(Path(self.metrics_file_path), text.getvalue().encode())  # whole rows, or none on a full disk
        self.metrics = []


def read_complete_rows(path: Path, header_only: bool = False) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a metrics.csv, without a last line that a kill cut short (no newline at its end)."""
    if not path.is_file():
        return [], []
    if header_only:
        with open(path, newline="") as f:
            return next(csv.reader(f), []), []
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = list(reader)
    return list(reader.fieldnames or []), rows


class ResumableCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv continues across a resume (see ``_ResumingWriter``)."""

    def __init__(self, *args, resume_step: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._resume_step = resume_step

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            os.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ResumingWriter(log_dir=self.log_dir, resume_step=self._resume_step)
        return self._experiment
