"""Where in its training data a data module is, so that a resumed run sees exactly the batches the uninterrupted one
would have seen (exact resume).

Lightning saves a data module's ``state_dict`` in every checkpoint and hands it back to ``load_state_dict`` on resume;
``DataPosition`` keeps that state: the training batches this rank consumed (counted as they are transferred), in the
current epoch where the module counts epochs. The module's ``train_dataloader`` calls ``start_position`` for where to
start: the loaded position the first time after a resume (which then becomes the current one), else the current one.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DataPosition:
    """Mix in before ``LightningDataModule``; call ``start_position`` in ``train_dataloader``. ``counts_epochs``: the
    position is (epoch, batches in that epoch), reset at each new epoch; else the batches of the whole run."""

    counts_epochs: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._position: dict[str, int] = {"epoch": 0, "batches": 0} if self.counts_epochs else {"batches": 0}
        self._resume_from: dict[str, int] | None = None

    def start_position(self) -> tuple[dict[str, int], bool]:
        """Where the training loader starts, and whether that is a checkpoint's position (consumed: asked again, the
        answer is the current position)."""
        resumed = self._resume_from is not None
        if resumed:
            self._position, self._resume_from = dict(self._resume_from), None
        return self._position, resumed

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.training:
            if self.counts_epochs and trainer.current_epoch != self._position["epoch"]:
                self._position = {"epoch": trainer.current_epoch, "batches": 0}
            self._position["batches"] += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return dict(self._position)

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_from = dict(state)
