"""Lightning callbacks and loggers of the training loop itself (geometry recording lives in analysis/)."""

from __future__ import annotations

import csv
import io
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.exceptions import SIGTERMException

# the same temp-file-then-rename writer as the token cache; a full or read-only disk raises StorageError naming the file
from pe_geometry.files import append_bytes, atomic_write_bytes, storage_errors
from pe_geometry.training import lightning_compat as compat
from pe_geometry.training.metrics_csv import CSV_DIR, read_complete_rows, resume_folders, resume_segment, segment_files, superseded_segments

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
    for folder in (run_dir, run_dir / "checkpoints", run_dir / CSV_DIR, *resume_folders(run_dir).values()):
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
    - A step that validates is saved after its validation (see ``on_train_batch_end``).
    - A stop signal (Ctrl-C, a scheduler's SIGTERM, SIGUSR1/SIGUSR2 before a time limit) saves
      ``last.ckpt`` before exiting (``training.interrupt.GracefulStop`` stops between steps). Any other
      error (a NaN loss, say) keeps the last good checkpoint.
    Checkpoints are written by ``AtomicCheckpointIO``, so a kill during a save never
    leaves a truncated ``last.ckpt``.
    """

    def __init__(self, *args, **kwargs) -> None:
        # A resume from an older checkpoint re-saves step files that exist: overwrite them (and last.ckpt),
        # rather than writing step...-v1.ckpt and last-v1.ckpt beside a stale last.ckpt.
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)
        self._deferred_step: int | None = None  # a grid step whose save waits for its validation

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning warns "Checkpoint directory ... exists and is not empty" whenever checkpoints/ holds files. Here
        # that is only ever a resume continuing its own run (a new run into a folder holding a run is refused before
        # it starts: run_folder.overwrites_a_run, pipeline.read_checkpoint), so the line is noise about the run itself.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            super().setup(trainer, pl_module, stage)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        # A step checkpoint on a step that validates is saved after that validation, not before it: Lightning's
        # resume from a checkpoint saved before its step's validation skips that validation, so what the validation
        # changes (EarlyStopping's count, the best val/loss of callbacks=early_stop, the metrics row) would be lost and
        # the resumed run would stop elsewhere. Saved after it, the resume skips a validation that is in the checkpoint.
        if self._on_grid(trainer) and compat.validates_after_this_batch(trainer):
            self._deferred_step = trainer.global_step
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Lightning does not keep which step it saved last: after a resume at a grid step, the first micro-batch of the
        # next step (gradient accumulation) still has that global_step and would save it again, mid-step.
        compat.mark_saved(self, max(compat.last_saved_step(self), trainer.global_step))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_new(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._deferred_step == trainer.global_step and not compat.skips_saving(self, trainer):
            self._deferred_step = None
            compat.save_top_k(self, trainer)
            compat.save_last(self, trainer)
        # A run stopping after this validation (GracefulStop raised the flag) saves here, where Lightning's own
        # after-validation checkpoints are taken: their resume skips the finished validation and counts the
        # logging step on by one. Saved later, on the exception, Lightning had already counted that step, the
        # resume counted it again, and every later train/loss and lr row was logged one step late.
        if trainer.received_sigterm and trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._save_on_stop(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # GracefulStop turns the stop signals into this exception between steps, where step, data position and
        # RNG agree. A bare KeyboardInterrupt (Ctrl-C twice) can come mid-step: saving then would resume one batch off.
        if isinstance(exception, SIGTERMException):
            self._save_on_stop(trainer)

    def _save_on_stop(self, trainer: L.Trainer) -> None:
        if self._save_last_if_new(trainer):
            log.warning("interrupted at step %d: saved last.ckpt in %s", trainer.global_step, self.dirpath)

    def _on_grid(self, trainer: L.Trainer) -> bool:
        """This step is one of ``every_n_train_steps`` (a time-based interval is left to Lightning)."""
        every = compat.step_interval(self)
        return every is not None and trainer.global_step % every == 0

    def _save_last_if_new(self, trainer: L.Trainer) -> bool:
        """Save ``last.ckpt`` unless this step is saved already; True if it saved (``lightning_compat.save_last``:
        ModelCheckpoint's public hooks save it only beside a step checkpoint)."""
        if not self.save_last or compat.last_saved_step(self) >= trainer.global_step:
            return False
        compat.save_last(self, trainer)
        return True


def ran_out_of_patience(callback: EarlyStopping) -> bool:
    """Lightning's rule: stopped once ``patience`` validations in a row (at least one) did not improve."""
    return callback.wait_count >= max(callback.patience, 1)


class EarlyStop(EarlyStopping):
    """Lightning's EarlyStopping, which a resume does not restart: a run whose last checkpoint was saved after the
    validation that stopped it (``StepCheckpoint`` saves after a step's validation) ends again at once, instead of
    training on until the next validation (``ckpt_path=auto`` on a sweep resumes its finished jobs too). The configured
    ``patience`` wins over the checkpoint's, so a resume with a larger one continues a stopped run."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        patience = self.patience
        super().load_state_dict(state_dict)
        self.patience = patience

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if ran_out_of_patience(self) or self._stopped_on_a_threshold():
            trainer.should_stop = True
            log.warning("this run stopped early at step %d (%s had not improved for %d validations): nothing to continue",
                        trainer.global_step, self.monitor, self.wait_count)

    def _stopped_on_a_threshold(self) -> bool:
        """A stop on a non-finite value or a threshold, which leaves the count below patience (Lightning >= 2.6 records
        why it stopped; older ones do not, and then only the count says)."""
        reason = getattr(self, "stopping_reason", None)
        return reason is not None and reason.name in ("STOPPING_THRESHOLD", "DIVERGENCE_THRESHOLD", "NON_FINITE_METRIC")


class BestCheckpoint(ModelCheckpoint):
    """ModelCheckpoint on a monitored metric (``callbacks=early_stop``: the lowest val/loss in ``best.ckpt``) that
    keeps its best score when the run folder has moved.

    Lightning's own forgets ``best_model_score`` on a resume whose ``dirpath`` differs from the checkpoint's, so the
    first validation after it would overwrite ``best.ckpt`` with whatever it scored. A run folder may be moved and
    resumed in its new place (the resume follows the folder), so the saved paths inside the old folder are rebased
    onto the new one first. ``best.ckpt`` is overwritten in place (no ``best-v1.ckpt``).
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("enable_version_counter", False)
        super().__init__(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        old = state_dict.get("dirpath")
        if old and self.dirpath and old != self.dirpath:
            state_dict = rebase_paths(state_dict, Path(old), Path(self.dirpath))
        super().load_state_dict(state_dict)


def rebase_paths(state: dict[str, Any], old: Path, new: Path) -> dict[str, Any]:
    """A ModelCheckpoint state with every path inside ``old`` moved under ``new`` (paths elsewhere kept)."""

    def moved(path):
        if not path:
            return path
        try:
            return str(new / Path(path).relative_to(old))
        except ValueError:
            return path

    out = {**state, "dirpath": str(new)}
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in out:
            out[key] = moved(out[key])
    if "best_k_models" in out:
        out["best_k_models"] = {moved(path): score for path, score in out["best_k_models"].items()}
    return out


class _CrashSafeMetricsWriter(ExperimentWriter):
    """Lightning's CSV writer with its two writes made crash-safe, which plain ``CSVLogger`` (as of Lightning 2.6) is
    not:

    - When a new column appears (the first ``val/loss``, say) Lightning rewrites metrics.csv in place: a kill
      during that rewrite left it empty, and a full disk left it cut, its earlier rows lost. Here the new file
      is written beside it and renamed over it (``atomic_write_bytes``): a kill or a full disk leaves the
      previous complete file.
    - Rows are appended whole or not at all (``append_bytes``): a full disk cuts a half row back off, so the
      rows held back are written whole once there is room. A row cut short by a kill is left out on reading.

    A write that fails raises ``StorageError`` naming the file. Only ``save`` differs from Lightning's; it uses
    the writer's public ``metrics``, ``metrics_keys`` and ``metrics_file_path``.
    """

    def save(self) -> None:
        if not self.metrics:
            return
        path = Path(self.metrics_file_path)
        self.metrics_keys = sorted(set(self.metrics_keys).union(*self.metrics))  # Lightning's column order: sorted
        header, _ = read_complete_rows(path, header_only=True)
        if header != self.metrics_keys:  # a new column, or no file yet: the whole file anew
            _, rows = read_complete_rows(path)
            atomic_write_bytes(path, self._csv(rows + self.metrics, header=True))
        else:
            append_bytes(path, self._csv(self.metrics, header=False))
        self.metrics = []

    def _csv(self, rows: list[dict], header: bool) -> bytes:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.metrics_keys)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return text.getvalue().encode()


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger``, one metrics file per segment of a run (``training.metrics_csv``):
    ``csv/metrics.csv`` as started, ``csv/resume-step<N>/metrics.csv`` for a resume from step N. The run
    reader (``analysis.runs.read_run_rows``) joins them; the files are written by ``_CrashSafeMetricsWriter``.

    A resume of a run that had not written its first metrics file yet (killed before the first flush) writes
    ``csv/metrics.csv``: it is then the first record of the run.
    """

    def __init__(self, save_dir: str, name: str = CSV_DIR, version: str = "", resume_step: int | None = None, **kwargs) -> None:
        # (name and version as Lightning's: configs of older runs set them; the run reader reads csv/)
        self._first_step = resume_step or 0
        if resume_step is not None and segment_files(Path(save_dir)):
            version = resume_segment(resume_step)
        super().__init__(save_dir, name=name, version=version, **kwargs)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if compat.started_experiment(self) is None:
            # Segments that start at or after this one's step are replaced whole: removed, so the segments left
            # join in the order of their steps (after a resume from an earlier step, too).
            for folder in superseded_segments(Path(self.save_dir), self._first_step):
                with storage_errors(folder):
                    shutil.rmtree(folder)
            os.makedirs(self.root_dir, exist_ok=True)
            compat.set_experiment(self, _CrashSafeMetricsWriter(log_dir=self.log_dir))
        return compat.started_experiment(self)

