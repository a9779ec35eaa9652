"""Lightning callbacks of the training loop itself (geometry recording lives in experiments/)."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that also writes ``last.ckpt`` when training ends between intervals.

    With ``every_n_train_steps`` set, Lightning only saves on those steps, so a
    run of 1000 steps checkpointed every 300 would end with step 900 as "last".
    """

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and self._last_global_step_saved < trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
