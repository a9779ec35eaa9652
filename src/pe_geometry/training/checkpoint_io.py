"""A run's checkpoint files: which file a path names, reading one, and what pe-train keeps in it beside Lightning's state.

A run writes ``<run>/checkpoints/last.ckpt`` and, on its step grid, ``step<N>.ckpt``. Besides Lightning's state (the
weights, the optimiser, the step) every checkpoint carries, put there by ``RunConfigInCheckpoint``:

- ``run_config``: the run's resolved config, what a resume trains with and what a reader rebuilds the run from
  (``saved_config``);
- ``group_choices``: its group options (``pe=rope``, ``control=...``; ``saved_group_choices``);
- ``wandb_run_id``: the W&B run a resume continues (``saved_wandb_id``).

For a resume (``training.resume``, which decides what to do with a checkpoint) and for every reader of a finished run
(``run_loader.load_trained_run``, ``analysis.best_checkpoint``): ``find_checkpoint`` (the file a ``ckpt_path`` names),
``run_folder_of``, ``step_checkpoints`` and ``read_checkpoint_file`` (read once, on the CPU, every problem one
``RunLoadError`` line naming the file).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import to_absolute_path

from pe_geometry.training.validate import ConfigError

LAST_CHECKPOINT = Path("checkpoints") / "last.ckpt"  # a run folder's last checkpoint
STEP_CHECKPOINT = re.compile(r"step(\d+)\.ckpt")  # callbacks.checkpoint.filename: step{step:06d}
RUN_CONFIG, GROUP_CHOICES, WANDB_RUN_ID = "run_config", "group_choices", "wandb_run_id"  # what pe-train adds


class RunLoadError(ConfigError):
    """A run or checkpoint that cannot be loaded; the message is one line naming the file and why."""


# -- which file ------------------------------------------------------------------------------------------------------
def find_checkpoint(given: str | Path, run_dir: Path | None = None) -> Path:
    """The checkpoint file ``given`` names. For a resume (``run_dir``: the folder the run writes in) ``last`` is that
    folder's ``checkpoints/last.ckpt`` and anything else a file, relative to where the command was typed; for a reader
    of a finished run (no ``run_dir``) a run folder stands for its ``checkpoints/last.ckpt``. RunLoadError (a
    ConfigError) when there is no such file."""
    if run_dir is not None:
        path = run_dir / LAST_CHECKPOINT if str(given) == "last" else Path(to_absolute_path(str(given))).expanduser()
        where = f"at {path}"
    else:
        path, where = Path(given).expanduser(), "there"
        if path.is_dir():
            if not (path / LAST_CHECKPOINT).is_file():
                raise RunLoadError(f"{path}: no checkpoint {path / LAST_CHECKPOINT}")
            return path / LAST_CHECKPOINT
    if not path.is_file():
        raise RunLoadError(f"ckpt_path={given if run_dir is not None else path}: no checkpoint file {where}")
    return path


def run_folder_of(checkpoint: Path, default: Path) -> Path:
    """The run a checkpoint belongs to: ``<run>`` for ``<run>/checkpoints/*.ckpt``; else ``default``."""
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else default


def step_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``checkpoints/step<N>.ckpt`` of a run folder, in step order."""
    found = [(int(m.group(1)), p) for p in (run_dir / "checkpoints").glob("step*.ckpt") if (m := STEP_CHECKPOINT.fullmatch(p.name))]
    return sorted(found)


# -- reading ---------------------------------------------------------------------------------------------------------
def read_checkpoint_file(path: Path, required: tuple[str, ...] = ("state_dict",)) -> dict:
    """The checkpoint at ``path`` (on the CPU), read once; a truncated or foreign file, or one without the
    ``required`` entries, is one error line instead of a traceback from deep inside torch."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)  # ours carry numpy RNG states
        for key in required:
            checkpoint[key]  # noqa: B018 - raises KeyError when missing
    except Exception as err:
        reason = " ".join(str(err).split())  # torch's unpickling messages span lines: one line, as every error here
        raise RunLoadError(f"ckpt_path={path} is not a readable Lightning checkpoint ({type(err).__name__}: {reason})") from None
    return checkpoint


def saved_config(checkpoint: dict) -> dict[str, Any] | None:
    """The run's resolved config as the checkpoint carries it (``run_config``); None for a checkpoint pe-train did not
    write."""
    stored = checkpoint.get(RUN_CONFIG)
    return stored if isinstance(stored, dict) else None


def saved_group_choices(checkpoint: dict) -> dict[str, Any] | None:
    """The run's group options (``{"pe": "rope", "control": None, ...}``); None for a checkpoint without them (an older
    one, or not pe-train's)."""
    stored = checkpoint.get(GROUP_CHOICES)
    return stored if isinstance(stored, dict) else None


def saved_wandb_id(checkpoint: dict) -> str | None:
    """The id of the W&B run the checkpoint's run logged to; None without one."""
    return checkpoint.get(WANDB_RUN_ID)


# -- writing ---------------------------------------------------------------------------------------------------------
class RunConfigInCheckpoint(L.Callback):
    """Puts the run's resolved config (``checkpoint["run_config"]``), its group choices (``pe=rope``, ``control=...``)
    and its W&B run id in every checkpoint."""

    def __init__(self, run_config: dict[str, Any], choices: dict[str, Any] | None = None) -> None:
        self.run_config, self.choices = run_config, dict(choices or {})

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[RUN_CONFIG] = self.run_config
        checkpoint[GROUP_CHOICES] = {k: v for k, v in self.choices.items() if not str(k).startswith("hydra")}
        from pe_geometry.training.wandb_run import wandb_loggers  # a light import; wandb itself is only touched if used

        for logger in wandb_loggers(trainer.loggers):
            checkpoint[WANDB_RUN_ID] = logger.version
