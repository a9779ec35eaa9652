"""Stop signals end a run between optimiser steps, on every rank at once, with a checkpoint that resumes exactly.

The stop signals: Ctrl-C (SIGINT), SIGTERM (a scheduler pre-empting the job) and SIGUSR1/SIGUSR2, which a
scheduler sends some time before a job's time limit (``sbatch --signal=USR1@120``; submitit, behind
``hydra/launcher=slurm``, asks SLURM for SIGUSR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` names another).

``GracefulStop`` replaces their handlers while training runs. A handler only records the signal. After
each optimiser step every rank agrees on it (one all-reduce of one number under DDP) and, if any rank got
one, all raise Lightning's stop flag: Lightning then raises ``SIGTERMException`` at the end of that step,
after the step's validation, on every rank, and ``StepCheckpoint`` saves ``last.ckpt`` once. Its step, the
datamodule's data position and the RNG states then agree (a signal during a validation that falls between
the micro-batches of a gradient-accumulation step waits for that step's end). A signal that arrives after
the last step lets the run finish (its final validation and measurements included) and exit 0. A second
Ctrl-C stops at once, without saving. ``cli/train.py`` exits with 128 + the signal and prints the resume command.

Why not Lightning's own SIGTERM handling (as of Lightning 2.6): its handler raises the
stop flag at once, so Lightning stops after the current *micro-batch* (under gradient accumulation, a
checkpoint one batch ahead of its step) or abandons a validation half-way (a row a resume never repeats);
and under DDP it broadcasts from inside the signal handler, where it meets the other rank in the middle of a
gradient all-reduce (a hang, or gloo's "connection reset"). Python's own ``KeyboardInterrupt`` strikes
mid-step in the same way. What is Lightning's here: the stop flag and the ``SIGTERMException`` it raises at
the end of a step, and its teardown, which puts back every handler replaced here.

Under SLURM Lightning would also take SIGUSR1 for its auto-requeue: a checkpoint saved inside the signal
handler, mid-step, as ``hpc_ckpt_<n>.ckpt`` (which a resume with ``ckpt_path`` does not know), then
``scontrol requeue``, which reruns the original command: a new run from step 0. ``GracefulStop.setup`` turns
that off (``SLURMEnvironment.auto_requeue``), so SIGUSR1 stops the run as SIGTERM does, with ``last.ckpt``
and the printed resume command; requeueing is left to the user (``max_num_timeout: 0`` in the launcher).

Once a run has finished (``ignore_signals_once_finished``, for a process that ends with its run),
a stop signal during what is left (the summary, W&B's teardown, Python's exit) is logged and ignored:
the process exits 0 rather than being killed by it, which would read as a failed run. Two moments needed more
than a handler: Lightning's teardown puts back the handlers it found before fit (Python's default, which a
SIGTERM kills with) before ``on_fit_end`` runs, so the handler it puts back is set at ``on_train_end``; and Python
resets every handler to the default before it tears its modules down (seconds with torch loaded), so once the
process exits (an ``atexit`` call) the stop signals are ignored outright (``SIG_IGN``, which Python keeps).

Before training starts (imports, composing, building the data and the model: ``training_started()`` is False)
Ctrl-C is Python's ``KeyboardInterrupt``: ``cli/train.py`` turns it into one line and exit code 130.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
from types import FrameType

import lightning as L
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment

from pe_geometry.training.lightning_compat import cluster_environment, restore_after_fit, set_stop_flag

log = logging.getLogger(__name__)
# SIGUSR1/2 do not exist on Windows
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_received: int | None = None  # the signal that stopped this process's run, for train.py's exit code
_ignore_once_finished = False  # set by ignore_signals_once_finished
_training_started = False  # GracefulStop took over the stop signals in this process's current run
_training: GracefulStop | None = None  # the GracefulStop of the run training in this process now (request_stop)


def received_signal() -> int | None:
    """The stop signal (one of ``STOP_SIGNALS``) that stopped the last run in this process, else None."""
    return _received


def run_starting() -> None:
    """A new run starts in this process (``pipeline.train``; a sweep runs several in one): it has not trained yet."""
    global _received, _training_started
    _received, _training_started = None, False


def training_started() -> bool:
    """Whether this process's current run got as far as training (its first step began), so that a Ctrl-C is
    GracefulStop's; before that it is Python's ``KeyboardInterrupt``, and there is no checkpoint of this run to resume."""
    return _training_started


def request_stop(signum: int = signal.SIGTERM) -> None:
    """From any thread (a watchdog): stop this process's run as ``signum`` would. While it trains, as if the signal
    had come (after the current step, with ``last.ckpt``), unless a stop signal came first; before it trains, the
    signal itself (SIGTERM's default ends the process: nothing to save yet); once it has stopped or finished,
    nothing (it ends by itself; a real second SIGTERM then would kill it before it has said how it ended)."""
    stop = _training
    if stop is not None:
        stop.request(signum)
    elif not _training_started:
        os.kill(os.getpid(), signum)


def ignore_signals_once_finished() -> None:
    """After this process's run has finished training, the stop signals only log: the process still exits 0.

    For a process that ends with its run (``train.py``'s single run): the run's results are saved, and
    a signal while W&B finishes or Python exits would otherwise kill it (-2, -15, -10, -12), a failure to a
    scheduler or a shell. Not for a sweep (a signal between its jobs must stop it) nor a notebook or
    test session (Ctrl-C must keep working there). ``GracefulStop.on_fit_end`` installs the handlers.
    """
    global _ignore_once_finished
    _ignore_once_finished = True


def _log_finished(signum: int, frame: FrameType | None) -> None:
    log.warning("received %s after the run had finished: ignored, finishing normally", signal.Signals(signum).name)


def _ignore_from_now_on() -> None:
    """At exit: Python puts back the default handlers before it tears its modules down, and a stop signal then
    would kill the finished run's process (-15). ``SIG_IGN`` is a disposition Python leaves in place."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


# Lightning's private state, reached through ``training.lightning_compat``: there is no public way to ask Lightning for
# its SIGTERM stop (``trainer.received_sigterm`` is read-only, and ``trainer.should_stop`` ends the run as finished, with
# a validation and final measurements at that step, rows the uninterrupted run has not), nor to reach a single-device
# run's cluster environment (``trainer.strategy.cluster_environment`` exists for DDP-like strategies only, while
# Lightning's signal setup reads the accelerator connector's), nor to choose the handlers its teardown puts back.


class GracefulStop(L.Callback):
    def __init__(self) -> None:
        self._pending: int | None = None  # a signal this process received, not yet acted on
        self._stopping = False
        self._last_step = -1
        self._at_step_end = True  # the last training batch completed an optimiser step (not a micro-batch)

    # -- the handlers ------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # Lightning installs its handlers after the callbacks' setup: here it still reads this switch.
        environment = cluster_environment(trainer)
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            environment.auto_requeue = False
            log.info("SLURM: Lightning's auto-requeue is off; SIGUSR1/SIGUSR2 stop the run after the current step "
                     "and save checkpoints/last.ckpt")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        global _received, _training_started, _training
        _received, self._pending, self._stopping, self._last_step = None, None, False, trainer.global_step
        _training_started, _training = True, self
        self._at_step_end = True  # a run starts (or resumes) between steps
        for signum in STOP_SIGNALS:  # Lightning restores the previous handlers in its teardown
            try:
                signal.signal(signum, self._record)
            except ValueError:  # not the main thread (a notebook's worker, say): keep Python's behaviour
                return

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        global _training
        _training = None  # stopped (or failed): nothing left for request_stop to stop

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        global _training
        _training = None
        # The run ends normally (a stop raises instead). Lightning's teardown, before on_fit_end, puts back the
        # handlers from before fit: Python's default for SIGTERM, which would kill the finished run. Put back ours.
        if _ignore_once_finished:
            for signum in STOP_SIGNALS:
                restore_after_fit(trainer, signum, _log_finished)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning calls this only when fit ended normally, after its teardown has put back the handlers that
        # on_train_start replaced: from here on the run is finished.
        if _ignore_once_finished:
            for signum in STOP_SIGNALS:
                try:
                    signal.signal(signum, _log_finished)
                except ValueError:  # not the main thread
                    return
            atexit.register(_ignore_from_now_on)  # registered last, so it runs first: for all that is left

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._pending == signal.SIGINT:
            raise KeyboardInterrupt  # Ctrl-C twice: the user does not want to wait for the step
        self.request(signum)

    def request(self, signum: int) -> None:
        """Stop after the current step, as ``signum`` asks (a signal handler, or ``request_stop`` from a thread)."""
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
            set_stop_flag(trainer, False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._stopping:
            set_stop_flag(trainer, True)
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
        set_stop_flag(trainer, True)  # Lightning raises SIGTERMException at the step's end

    def _agreed_signal(self, trainer: L.Trainer) -> int:
        """The largest signal number any rank has received (0: none). A collective: every rank calls it at the same point."""
        signum = self._pending or 0
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signum
