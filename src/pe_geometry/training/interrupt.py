"""Ctrl-C and SIGTERM stop a run between optimiser steps, on every rank at once, with a checkpoint that resumes exactly.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be: in the middle of a
step, after the datamodule has counted the batch as consumed but before the optimiser has
stepped, so a checkpoint saved then resumes one batch off. Lightning's own SIGTERM handler
broadcasts from inside the signal handler, which under DDP meets the other rank in the middle of
a gradient all-reduce (a hang, or a gloo "connection reset").

``GracefulStop`` replaces both handlers while training runs. A handler only records the signal.
After each optimiser step every rank agrees on it (one all-reduce of one number under DDP) and,
if any rank got one, all ask Lightning to stop: Lightning then raises ``SIGTERMException`` at the
end of that step, after the step's validation, on every rank, and ``StepCheckpoint`` saves
``last.ckpt`` once. Its step, the datamodule's data position and the RNG states then agree (a
signal during a validation that falls between the micro-batches of a gradient-accumulation step
waits for that step's end). A signal that arrives after the last step lets the run finish (its
final validation and measurements included) and exit 0. A second Ctrl-C stops at once, without saving.

Once a run has finished (``ignore_signals_once_finished``, for a process that ends with its run),
a signal during what is left (the summary, W&B's teardown, Python's exit) is logged and ignored:
the process exits 0 rather than being killed with -2/-15, which would read as a failed run.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import lightning as L
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: int | None = None  # the signal that stopped this process's run, for train.py's exit code
_ignore_once_finished = False  # set by ignore_signals_once_finished


def received_signal() -> int | None:
    """The signal (``signal.SIGINT`` or ``signal.SIGTERM``) that stopped the last run in this process, else None."""
    return _received


def ignore_signals_once_finished() -> None:
    """After this process's run has finished training, SIGINT and SIGTERM only log: the process still exits 0.

    For a process that ends with its run (``train.py``'s single run): the run's results are saved, and
    a signal while W&B finishes or Python exits would otherwise kill it with -2/-15, a failure to a
    scheduler or a shell. Not for a sweep (a signal between its jobs must stop it) nor a notebook or
    test session (Ctrl-C must keep working there). ``GracefulStop.on_fit_end`` installs the handlers.
    """
    global _ignore_once_finished
    _ignore_once_finished = True


def _log_finished(signum: int, frame: FrameType | None) -> None:
    log.warning("received %s after the run had finished: ignored, finishing normally", signal.Signals(signum).name)


class GracefulStop(L.Callback):
    def __init__(self) -> None:
        self._pending: int | None = None  # a signal this process received, not yet acted on
        self._stopping = False
        self._last_step = -1
        self._at_step_end = True  # the last training batch completed an optimiser step (not a micro-batch)

    # -- the handlers ------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        global _received
        _received, self._pending, self._stopping, self._last_step = None, None, False, trainer.global_step
        self._at_step_end = True  # a run starts (or resumes) between steps
        for signum in STOP_SIGNALS:  # Lightning restores the previous handlers in its teardown
            try:
                signal.signal(signum, self._record)
            except ValueError:  # not the main thread (a notebook's worker, say): keep Python's behaviour
                return

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning calls this only when fit ended normally, after its teardown has put back the handlers that
        # on_train_start replaced: from here on the run is finished.
        if _ignore_once_finished:
            for signum in STOP_SIGNALS:
                try:
                    signal.signal(signum, _log_finished)
                except ValueError:  # not the main thread
                    return

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._pending == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step
        if self._pending is None:
            log.warning("received %s: stopping after the current step (saving checkpoints/last.ckpt)", signal.Signals(signum).name)
        self._pending = signum

    # -- when to stop -----------------------------------------------------------------------
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        self._at_step_end = trainer.global_step != self._last_step
        if not self._at_step_end:  # a micro-batch of gradient accumulation: no step yet
            return
        self._last_step = trainer.global_step
        self._maybe_stop(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning abandons a validation when it sees the stop flag; that row would then be lost for
        # good (a resume does not repeat it), so the flag waits until the validation has finished.
        if self._stopping:
            trainer._signal_connector.received_sigterm = False

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stopping:
            trainer._signal_connector.received_sigterm = True
        elif self._at_step_end and trainer.state.fn == "fit" and not trainer.sanity_checking:
            # A signal during validation: stop before the next step. Not when the validation fell between
            # the micro-batches of a step (val_check_interval counts batches): that step is finished first,
            # else the checkpoint would hold a half-consumed step (data position one micro-batch ahead).
            self._maybe_stop(trainer)

    def _maybe_stop(self, trainer: L.Trainer) -> None:
        global _received
        signum = self._agreed_signal(trainer)
        if not signum or self._stopping:
            return
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
            log.warning("%s came after the last step: finishing the run", signal.Signals(signum).name)
            return
        _received, self._stopping = signum, True
        log.warning("interrupted at step %d by %s", trainer.global_step, signal.Signals(signum).name)
        trainer._signal_connector.received_sigterm = True  # Lightning raises SIGTERMException at the step's end

    def _agreed_signal(self, trainer: L.Trainer) -> int:
        """The largest signal number any rank has received (0: none). A collective: every rank calls it at the same point."""
        signum = self._pending or 0
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signum
