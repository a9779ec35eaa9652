"""``callbacks.threads``: torch's CPU thread count follows the cores other processes leave idle while a run trains.

A run takes the cores idle when it starts (``training.threads.choose_threads``); on a shared machine that changes
under it. Measured (issue 54): a run started while another process held a core kept its one thread after that process
ended and trained at 0.54x the plain-PyTorch loop for its whole life. This callback looks every ``every_seconds`` of
wall time (a look reads /proc/stat and this process's CPU time: microseconds) and moves the count through
``threads.ThreadFollower``, which counts only the other processes' load and changes after two looks that agree.

A changed count changes the order of some floating-point sums: the weights then differ in the last bits from a run
that kept its count (a 100-step run on 1 vs 2 threads: every tensor, by at most 1e-6), as between two runs started
at different loads. On a machine that stays as it was the count never moves, and the run is bit-identical to one
without the callback; ``OMP_NUM_THREADS=N`` fixes the count (and turns the callback off) where bits must agree across
loads.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import lightning as L
import torch

from pe_geometry.settings.training import ThreadFollowerSettings
from pe_geometry.training import threads

log = logging.getLogger(__name__)


class ThreadCountFollower(L.Callback):
    """Every ``every_seconds``, one look of ``threads.ThreadFollower`` from the count the run started with, at most
    torch's own (``threads.torch_default_threads``)."""

    Settings = ThreadFollowerSettings

    def __init__(self, **settings: Any) -> None:
        self.settings = s = self.Settings(**settings)
        self.every_seconds = s.every_seconds
        self.follower: threads.ThreadFollower | None = None
        self.clock = time.monotonic
        self._next_look = 0.0

    @staticmethod
    def why_not(trainer: L.Trainer) -> str | None:
        """Why this run keeps its count as it is (None: it follows the machine)."""
        told = [v for v in threads.THREAD_VARIABLES if os.environ.get(v)]
        if told:
            return f"{told[0]}={os.environ[told[0]]} fixes it"
        if trainer.world_size > 1:
            return "each DDP process keeps the count it was given"
        if threads.cpu_times() is None:
            return "how busy the cores are is unknown here"
        return None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        why_not = self.why_not(trainer)
        if why_not is not None:
            self.follower = None
            log.debug("threads stay at %d: %s", torch.get_num_threads(), why_not)
            return
        now = torch.get_num_threads()
        self.follower = threads.ThreadFollower(now, most=max(now, threads.torch_default_threads()))
        self.follower.start()
        self._next_look = self.clock() + self.every_seconds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if self.follower is None:
            return
        now = self.clock()
        if now >= self._next_look:
            self._next_look = now + self.every_seconds
            self.follower.look(trainer.global_step)
