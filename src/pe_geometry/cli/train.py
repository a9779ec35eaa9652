"""Train a Transformer from a Hydra config.

    pe-train                                  # decoder + sinusoidal PE on Shakespeare
    pe-train model=encoder pe=rope attention=explicit
    pe-train -m pe=sinusoidal,learned,rope,alibi,none seed=0,1,2

``python train.py ...`` in a checkout runs the same ``run()``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Nothing here imports torch or Lightning: `--help`, `--cfg job` and tab completion answer before
# they would load (measured by `python experiments/benchmark.py --cli`). Nor Hydra, until run() is called: a Ctrl-C
# from the very start of the process is then run()'s to report.
log = logging.getLogger("train")
HYDRA_MAIN = {"version_base": "1.3", "config_path": "pkg://pe_geometry.configs", "config_name": "train"}


def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a ``-m`` sweep, from the config Hydra composed (``run`` hands it to ``hydra.main``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    in_sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        return train_and_report(cfg, in_sweep)
    except KeyboardInterrupt:
        sys.exit(report_interrupt(cfg, in_sweep))


def train_and_report(cfg: DictConfig, in_sweep: bool) -> float | None:
    """``train``, with each way it can end said in one line and an exit code (in a sweep: recorded, and go on)."""
    # a train.log on a full disk: one warning line, not a traceback per record; first, before any library that logs
    # on import (datasets 2.x logs the PyTorch version it found)
    from pe_geometry.training.storage import quiet_log_file_errors, storage_failure

    quiet_log_file_errors()
    if not in_sweep:
        refuse_bad_values_early(cfg)
    # heavy imports after Hydra has parsed the command line
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from pe_geometry.data.corpus import CorpusError
    from pe_geometry.extras import MissingExtraError
    from pe_geometry.training.interrupt import ignore_signals_once_finished
    from pe_geometry.training.pipeline import train
    from pe_geometry.training.run_folder import RunFolderInUse
    from pe_geometry.training.task import NonFiniteLossError
    from pe_geometry.training.validate import ConfigError

    if not in_sweep:  # this process ends with its run: a signal once training has finished still exits 0
        ignore_signals_once_finished()
    try:
        metrics = train(cfg)
    except SIGTERMException:
        # GracefulStop saved last.ckpt between steps; Lightning raised this (a SystemExit with status 0).
        sys.exit(report_stop(cfg, in_sweep))  # a sweep stops too
    except Exception as err:  # noqa: BLE001 - in a sweep every failure is reported, not only the expected ones
        in_use = isinstance(err, RunFolderInUse)  # the folder, and the train.log open in it, are the live run's
        refused = (ConfigError, CorpusError, MissingExtraError, RunFolderInUse)
        code = 1 if isinstance(err, NonFiniteLossError) else 2 if isinstance(err, refused) else None
        if code is None and (disk := storage_failure(err, cfg)) is not None:
            err, code = disk, 2  # a full or read-only disk, however Lightning passed it on: one line naming the file
        if code is None:
            if not in_sweep:
                raise  # an unexpected error in a single run keeps its traceback
            log.exception("job failed")  # the traceback goes to this job's train.log
        if (in_sweep or code != 2) and not in_use:  # a refused single run keeps no log (its folder goes): the stderr line is enough
            log.error("error: %s", err)
        if not in_sweep:
            print(f"error: {err}", file=sys.stderr)
            if code == 2 and not in_use:  # refused before it wrote anything: no stub folder under outputs/
                from pe_geometry.training.run_folder import remove_stub_run_dir

                runtime = HydraConfig.get().runtime
                remove_stub_run_dir(Path(runtime.output_dir), Path(runtime.cwd))
            sys.exit(code)
        # In a sweep, sys.exit would end every job still to come (Hydra does not catch SystemExit): report this
        # one and go on. It is recorded in the sweep folder, not in this process: a launcher may run it in a worker
        # or on another machine; the launching process lists the failures when the sweep ends (training/sweep.py).
        from pe_geometry.training.sweep import record_failed_job

        print(f"error: sweep {record_failed_job(err)}", file=sys.stderr)
        return None
    return metrics.get("val/loss")  # for Hydra sweepers that optimise a value


def refuse_bad_values_early(cfg: DictConfig) -> None:
    """A value that cannot work (``model.dropout=2``, ``+pe.bsae=3``, ``model.d_model=33`` with 4 heads) answered in
    well under a second: the components' settings dataclasses are torch-free (``check_config(import_classes=False)``),
    so this runs before torch and Lightning load (~9 CPU-s). The full check, after the imports, still runs in
    ``train`` (and on a resume, against the checkpoint's config). A sweep's jobs are checked there, where a refused
    job is recorded and the sweep goes on."""
    import copy

    from hydra.core.hydra_config import HydraConfig

    from pe_geometry.training.run_folder import remove_stub_run_dir
    from pe_geometry.training.validate import ConfigError, check_config

    runtime = HydraConfig.get().runtime
    try:
        check_config(copy.deepcopy(cfg), import_classes=False)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        remove_stub_run_dir(Path(runtime.output_dir), Path(runtime.cwd))
        sys.exit(2)


def signal_name(signum: int) -> str:
    try:
        return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def report_stop(cfg: DictConfig, in_sweep: bool = False) -> int:
    """After a stop signal ended the run (``training.interrupt``): say so in the log and, once, on the terminal,
    with the command that resumes it. Returns the exit code, 128 + the signal (130 Ctrl-C, 143 SIGTERM,
    138/140 SIGUSR1/SIGUSR2), so a scheduler does not take a stopped run for a finished one. A sweep job records
    how it stopped in the sweep folder; the sweep's own process prints the command that continues the sweep."""
    from pe_geometry.training.interrupt import received_signal
    from pe_geometry.training.resume import resume_command

    signum = received_signal() or signal.SIGTERM  # (Lightning's own SIGTERM handler stops a run before training starts)
    name = signal_name(signum)
    log.error("error: stopped by %s; exit code %d; resume with %s", name, 128 + signum, resume_command(cfg))  # every rank's log
    if in_sweep:
        from pe_geometry.training.sweep import record_stopped_job

        record_stopped_job(f"stopped by {name}; checkpoints/last.ckpt saved")
    elif int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line on the terminal, however many DDP ranks
        print(f"error: stopped by {name}; resume with {resume_command(cfg)}", file=sys.stderr)
    return 128 + signum


def training_started() -> bool:
    """Whether GracefulStop took over Ctrl-C in this run (``training.interrupt``). Not imported here if it was not
    imported yet: then training had not started, and a Ctrl-C may have cut an import short, torch's say."""
    interrupt = sys.modules.get("pe_geometry.training.interrupt")
    return interrupt is not None and interrupt.training_started()


def report_interrupt(cfg: DictConfig, in_sweep: bool) -> int:
    """A ``KeyboardInterrupt`` from ``train``: a Ctrl-C before training started (while importing, building the
    data or the model), or a second Ctrl-C, which stops at once without saving. One line; returns 130."""
    from hydra.core.hydra_config import HydraConfig

    if training_started():
        from pe_geometry.training.resume import resume_command

        line = f"interrupted (Ctrl-C twice); resume from the last saved checkpoint with {resume_command(cfg)}"
    else:  # (a resume still in its staging folder: that folder holds only what Hydra wrote, and goes)
        line = f"interrupted before training started; {written(Path(HydraConfig.get().runtime.cwd))}"
    if in_sweep:  # the sweep's own process prints the command that continues the sweep
        from pe_geometry.training.sweep import record_stopped_job

        log.error("error: %s", line)
        record_stopped_job(line)
    else:
        print(f"error: {line}", file=sys.stderr)
    return 128 + signal.SIGINT


def written(start_dir: Path) -> str:
    """What a run interrupted before training has left: a folder holding only what Hydra wrote there (its train.log
    is open) is removed; one that holds more (a resume's .hydra/resume-step<N>/, a config) has no checkpoint of it."""
    from pe_geometry.training.run_folder import remove_stub_run_dir

    folders = {Path(h.baseFilename).parent for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)}
    kept = [folder for folder in folders if not remove_stub_run_dir(folder, start_dir) and folder.exists()]
    return "no checkpoint was written" if kept else "nothing was written"


def too_long_for_the_file_system(path: Path) -> str | None:
    """Why the file system cannot hold ``path`` (a folder name or the whole path over its limits), or None. Checked
    before anything touches the path: ``exists()`` on it raises OSError (File name too long)."""
    def limit(name: str, default: int) -> int:
        try:
            return os.pathconf("/", name)
        except (OSError, ValueError):
            return default

    name_max, path_max = limit("PC_NAME_MAX", 255), limit("PC_PATH_MAX", 4096)
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        return f"a folder name of {len(os.fsencode(longest))} bytes, over this file system's {name_max}"
    if len(os.fsencode(str(path))) >= path_max:
        return f"a path of {len(os.fsencode(str(path)))} bytes, over this file system's {path_max - 1}"
    return None


def unusable_run_dir(argv: list[str]) -> str | None:
    """Hydra creates ``hydra.run.dir``/``hydra.sweep.dir`` before ``main`` runs and reports a failure
    as a traceback: check an explicitly given one first, so it is one line like any bad input."""
    from pe_geometry.training.run_folder import answers_only

    sweep = "-m" in argv or "--multirun" in argv
    dir_key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    creates_run_dir = not answers_only(argv)
    if creates_run_dir and not any(arg.partition("=")[0].lstrip("+") == dir_key for arg in argv):
        argv = [*argv, f"{dir_key}={'multirun' if sweep else 'outputs'}"]  # the default (configs/hydra/default.yaml), under the cwd
    for arg in argv:
        key, sep, value = arg.partition("=")
        value = value.strip("'\"")
        if not sep or key.lstrip("+") not in ("hydra.run.dir", "hydra.sweep.dir"):
            continue
        static = value.split("${", 1)[0]  # an interpolation (${now:...}) is resolved later: check the fixed part before it
        if not static:
            continue
        path = Path(static).expanduser().absolute()
        if problem := too_long_for_the_file_system(path):
            from pe_geometry.data.corpus import shortened_path

            return f"{key}={shortened_path(value, limit=80)} cannot be created: {problem}"
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir():
            return f"{key}={value} cannot be created: {existing} is a file, not a directory"
        if not os.access(existing, os.W_OK):
            return f"{key}={value} cannot be created: {existing} is not writable"
    return None


def run() -> None:
    """The console script ``pe-train`` (and ``python train.py`` in a checkout)."""
    argv = sys.argv[1:]
    sweep = "-m" in argv or "--multirun" in argv
    try:
        from pe_geometry.extras import missing_extra_for
        from pe_geometry.training.option_keys import key_of_another_option
        from pe_geometry.training.run_folder import overwrites_a_run, stage_resume, with_run_choices

        if problem := unusable_run_dir(argv) or missing_extra_for(argv) or overwrites_a_run(argv):
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)

        # a resume composes with the run's own options, writes nothing until its checks pass, then logs into its run
        composed_with = with_run_choices(argv)
        if problem := key_of_another_option(composed_with):  # else Hydra's six-line "Could not override", exit 1
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)
        sys.argv[1:] = stage_resume(composed_with)
        import hydra

        # Registers the resolvers the configs use (run_folder_name, arm); kept in a module of their own so that any
        # code composing configs/ (tests, notebooks, benchmarks) gets them without importing this script.
        import pe_geometry.training.names  # noqa: F401

        hydra.main(**HYDRA_MAIN)(main)()  # a sweep with failed jobs lists them and exits 1 (training/sweep.py's SweepReport)
    except KeyboardInterrupt:
        # Ctrl-C outside main's handlers: while Python imports, or Hydra composes or sets the job up, or between a
        # sweep's jobs
        line = stopped_sweep(argv, signal.SIGINT) if sweep else f"interrupted before training started; {written(Path.cwd())}"
        print(f"error: {line}", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except SystemExit as stop:
        # a sweep job stopped by a signal ends the sweep with 128 + that signal (each job recorded how it stopped)
        if sweep and isinstance(stop.code, int) and stop.code > 128:
            print(f"error: {stopped_sweep(argv, stop.code - 128)}", file=sys.stderr)
        raise


def stopped_sweep(argv: list[str], signum: int) -> str:
    """The line for a sweep a signal stopped: the command that continues it where it stopped."""
    from pe_geometry.training import sweep

    name = signal_name(signum)
    if sweep.launched_sweep() is None:
        return f"sweep stopped by {name} before it started; nothing was written"
    return f"sweep stopped by {name}; continue it with {sweep.continue_command(argv, sweep.launched_sweep())}"


if __name__ == "__main__":
    run()
