"""Hydra launchers that go on past a sweep job whose process was killed, and record it (training/sweep.py).

- ``IsolatedJoblibLauncher`` (``hydra/launcher=local_parallel``): Hydra's joblib launcher runs the jobs in one shared
  pool of loky workers, and one worker killed with ``kill -9`` (or by the out-of-memory killer) breaks the pool:
  loky kills the other workers, so the jobs running beside it die too, and joblib raises ``TerminatedWorkerError``,
  which ended the sweep before its later jobs ran, with no list. Here each job has a one-worker pool of its own,
  at most ``n_jobs`` at a time, so a kill loses that job only; it is recorded as ``killed by signal 9 (SIGKILL)``.
  The other way round, ``kill -9`` of the sweep's own process left its workers training on to the end (and its
  resource trackers with them), beside a continuation of the sweep started meanwhile. Each worker now watches its
  parent (``stop_when_orphaned``) and, once it is gone, stops its job as SIGTERM does: after the current step,
  with ``last.ckpt``, from which the continuation (``ckpt_path=auto``) resumes exactly. (Not ``prctl``'s
  parent-death signal: Linux only, and it fires when the *thread* that started the worker ends, not its process.)
- ``SlurmLauncher`` / ``SubmititLocalLauncher`` (``hydra/launcher=slurm``): the submitit plugin waits for the jobs
  in order and raised at the first one that died (``scancel``, out of memory, a lost node): the sweep command ended
  with a traceback while later array tasks ran on unlisted. Here the dead job is recorded and the others waited for.

A killed job is given back to Hydra as completed with no value: a failed ``JobReturn`` would make Hydra's sweeper
raise and end the sweep; the failure is in the sweep folder, listed and turned into exit code 1 at the end.

Hydra instantiates launchers only from the ``hydra_plugins`` package, hence this module's place.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, CancelledError, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals

from pe_geometry.extras import stand_in
from pe_geometry.training import hydra_compat, sweep

# Without the 'launchers' extra this module must still import: Hydra imports every hydra_plugins module on every
# start. The classes below then derive from stand-ins that raise a one-line MissingExtraError when used.
try:
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher
except ModuleNotFoundError as err:
    JoblibLauncher = stand_in(err, "launchers", "hydra/launcher=local_parallel").JoblibLauncher
try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
except ModuleNotFoundError as err:
    submitit_launcher = stand_in(err, "launchers", "hydra/launcher=slurm")

log = logging.getLogger(__name__)


def lost_job(overrides: Sequence[str]) -> JobReturn:
    """What Hydra gets for a killed job (see the module docstring for why it is not FAILED)."""
    ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
    ret.return_value = None
    return ret


def worker_env(n_jobs: int) -> dict[str, str]:
    """As joblib gives its loky workers: cpu_count // n_jobs threads each (unless set), so that n_jobs runs side by
    side do not oversubscribe the cores."""
    from joblib import cpu_count

    threads = str(max(cpu_count() // n_jobs, 1))
    return {var: os.environ.get(var, threads) for var in hydra_compat.joblib_thread_variables()}


def how_it_died(err: BaseException) -> str:
    """``killed by signal 9 (SIGKILL)`` from loky's ``TerminatedWorkerError`` ("... exit codes ... {SIGKILL(-9)}")."""
    codes = [int(c) for c in re.findall(r"\((-?\d+)\)", str(err))]
    if codes and codes[0] < 0:
        return f"killed by signal {-codes[0]} ({signal.Signals(-codes[0]).name})"
    if codes:
        return f"its worker process exited with code {codes[0]}"
    return f"its worker process died ({type(err).__name__})"


def stop_when_orphaned(launcher_pid: int, poll_s: float = 0.5) -> None:
    """In a job's worker (a thread): once the sweep's process ``launcher_pid`` is gone (its parent changed: ``kill
    -9``, a crash), stop the job as SIGTERM does (``training.interrupt.request_stop``: after the current step, with
    ``last.ckpt``; before training starts, SIGTERM's default ends the worker at once, with nothing to save)."""
    while os.getppid() == launcher_pid:
        time.sleep(poll_s)
    log.warning("the sweep's process (pid %d) is gone: stopping this job as SIGTERM does", launcher_pid)
    interrupt = sys.modules.get("pe_geometry.training.interrupt")  # (not imported yet: the job has not trained yet)
    if interrupt is None:
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        interrupt.request_stop(signal.SIGTERM)


def job_in_worker(launcher_pid: int, *job: Any) -> JobReturn:
    """The joblib plugin's job (``hydra_compat.execute_joblib_job``) in a loky worker, which dies with the sweep's
    process (``stop_when_orphaned``)."""
    threading.Thread(target=stop_when_orphaned, args=(launcher_pid,), name="stop-when-orphaned", daemon=True).start()
    try:
        return hydra_compat.execute_joblib_job(*job)
    finally:
        if os.getppid() != launcher_pid:  # no one to hand the result to: end here, not in loky's broken-pipe traceback
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + signal.SIGTERM)


class IsolatedJoblibLauncher(JoblibLauncher):
    """``n_jobs`` jobs at a time, each in a loky worker process of its own (the other joblib settings do not apply)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from joblib import effective_n_jobs

        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        n_jobs = effective_n_jobs(self.joblib.get("n_jobs", -1))  # -1: one per CPU
        log.info(f"Launching {len(job_overrides)} jobs, {n_jobs} at a time, each in its own process; sweep output dir: {sweep_dir}")
        for idx, overrides in enumerate(job_overrides):
            log.info(f"\t#{initial_job_idx + idx} : {' '.join(filter_overrides(overrides))}")

        # A job stopped by SIGTERM or Ctrl-C ends the sweep, as under the basic launcher (its SystemExit comes back
        # here), and so does an error Hydra raises: no further job starts; the running ones got the signal too.
        stop = threading.Event()
        env, state = worker_env(n_jobs), Singleton.get_state()
        pool = ThreadPoolExecutor(n_jobs)  # a thread per running job, waiting on its process
        futures = [pool.submit(self._run_in_own_process, initial_job_idx + idx, overrides, env, state, stop)
                   for idx, overrides in enumerate(job_overrides)]
        interrupted = False
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except KeyboardInterrupt:  # Ctrl-C reached the running jobs too: each saves a checkpoint, says how to resume
            interrupted = True
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        for future in futures:  # in job order: the first error is the one that stopped the rest
            if not future.cancelled() and future.exception() is not None:
                raise future.exception()
        if interrupted:
            sys.exit(128 + signal.SIGINT)
        return [future.result() for future in futures]

    def _run_in_own_process(self, idx: int, overrides: Sequence[str], env: dict[str, str], state: dict[Any, Any],
                            stop: threading.Event) -> JobReturn:
        from joblib.externals.loky import ProcessPoolExecutor
        from joblib.externals.loky.process_executor import TerminatedWorkerError

        if stop.is_set():
            raise CancelledError(f"sweep job {idx} not started: the sweep was stopped")
        executor = ProcessPoolExecutor(max_workers=1, env=env)
        try:
            job = executor.submit(job_in_worker, os.getpid(), idx, overrides, self.hydra_context, self.config, self.task_function, state)
            return job.result()
        except TerminatedWorkerError as err:
            how = how_it_died(err)
            print(f"error: sweep {sweep.describe(idx, overrides, how)}", file=sys.stderr)  # as a failed job says at once
            sweep.record_killed_job(sweep.sweep_folder(self.config.hydra), idx, overrides, how)
            return lost_job(overrides)
        except BaseException:
            stop.set()  # before this thread can take the next job
            raise
        finally:
            executor.shutdown(wait=True)


class _WaitForEveryJob:
    """The submitit plugin's ``launch``, with a job that died recorded instead of raised (see the module docstring)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import cloudpickle
        from submitit.core.utils import UncompletedJobError

        sweep_dir = sweep.sweep_folder(self.config.hydra)

        def results_or_record(results: Any, job: Any) -> list[JobReturn]:
            try:
                return results(job)
            except UncompletedJobError:  # no result: killed, cancelled, out of memory or time, or an error Hydra raised
                num, overrides = hydra_compat.submitit_job(job)
                how = f"submitit job {job.job_id} ended without a result (state {job.state}; its log: {job.paths.stderr})"
                print(f"error: sweep {sweep.describe(num, overrides, how)}", file=sys.stderr)
                sweep.record_killed_job(sweep_dir, num, overrides, how)
                return [lost_job(overrides)]

        # submitit runs this launcher object in each job (``python -m submitit.core._submit``, started wherever the
        # sweep was): its class travels by value, so the job needs no hydra_plugins/ of this checkout on its sys.path.
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        # The plugin reads the results inside its own launch; this is where a dead job's error can be caught.
        with hydra_compat.submitit_results_read_by(results_or_record):
            return super().launch(job_overrides, initial_job_idx)


class SlurmLauncher(_WaitForEveryJob, submitit_launcher.SlurmLauncher):
    pass


class SubmititLocalLauncher(_WaitForEveryJob, submitit_launcher.LocalLauncher):
    """The same on this machine (``hydra/launcher=submitit_local hydra.launcher._target_=<this class>``): the tests'
    stand-in for a cluster."""
