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

import hydra
from omegaconf import DictConfig

# Nothing here imports torch or Lightning: `--help`, `--cfg job` and tab completion answer before
# they would load (measured by `python experiments/benchmark.py --cli`).
log = logging.getLogger("train")
# Registers the resolvers the configs use (run_folder_name, arm); kept in a module of their own so that any
# code composing configs/ (tests, notebooks, benchmarks) gets them without importing this script.
import pe_geometry.training.names  # noqa: E402, F401


@hydra.main(version_base="1.3", config_path="pkg://pe_geometry.configs", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # a train.log on a full disk: one warning line, not a traceback per record; first, before any library that logs
    # on import (datasets 2.x logs the PyTorch version it found)
    from pe_geometry.training.storage import quiet_log_file_errors, storage_failure

    quiet_log_file_errors()
    # heavy imports after Hydra has parsed the command line
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from pe_geometry.data.corpus import CorpusError
    from pe_geometry.extras import MissingExtraError
    from pe_geometry.training.interrupt import ignore_signals_once_finished
    from pe_geometry.training.pipeline import resume_command, train
    from pe_geometry.training.task import NonFiniteLossError
    from pe_geometry.training.validate import ConfigError

    in_sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    if not in_sweep:  # this process ends with its run: a signal once training has finished still exits 0
        ignore_signals_once_finished()
    try:
        metrics = train(cfg)
    except SIGTERMException:
        # GracefulStop saved last.ckpt between steps; Lightning raised this (a SystemExit with status 0).
        sys.exit(report_stop(cfg))  # a sweep stops too
    except KeyboardInterrupt:
        # a second Ctrl-C stops at once, without saving: the last checkpoint on disk is the one to resume from
        print(f"error: interrupted (Ctrl-C twice); resume from the last saved checkpoint with {resume_command(cfg)}", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - in a sweep every failure is reported, not only the expected ones
        code = 1 if isinstance(err, NonFiniteLossError) else 2 if isinstance(err, (ConfigError, CorpusError, MissingExtraError)) else None
        if code is None and (disk := storage_failure(err, cfg)) is not None:
            err, code = disk, 2  # a full or read-only disk, however Lightning passed it on: one line naming the file
        if code is None:
            if not in_sweep:
                raise  # an unexpected error in a single run keeps its traceback
            log.exception("job failed")  # the traceback goes to this job's train.log
        if in_sweep or code != 2:  # a refused single run keeps no log (its folder goes): the stderr line is enough
            log.error("error: %s", err)
        if not in_sweep:
            print(f"error: {err}", file=sys.stderr)
            if code == 2:  # refused before it wrote anything: no stub folder under outputs/
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


def report_stop(cfg: DictConfig) -> int:
    """After a stop signal ended the run (``training.interrupt``): say so in the log and, once, on the terminal,
    with the command that resumes it. Returns the exit code, 128 + the signal (130 Ctrl-C, 143 SIGTERM,
    138/140 SIGUSR1/SIGUSR2), so a scheduler does not take a stopped run for a finished one."""
    from pe_geometry.training.interrupt import received_signal
    from pe_geometry.training.pipeline import resume_command

    signum = received_signal() or signal.SIGTERM  # (Lightning's own SIGTERM handler stops a run before training starts)
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    log.error("error: stopped by %s; exit code %d", name, 128 + signum)  # every rank's log
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one line on the terminal, however many DDP ranks
        print(f"error: stopped by {name}; resume with {resume_command(cfg)}", file=sys.stderr)
    return 128 + signum


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
    from pe_geometry.extras import missing_extra_for
    from pe_geometry.training.run_folder import overwrites_a_run, stage_resume

    if problem := unusable_run_dir(sys.argv[1:]) or missing_extra_for(sys.argv[1:]) or overwrites_a_run(sys.argv[1:]):
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)

    sys.argv[1:] = stage_resume(sys.argv[1:])  # a resume writes nothing until its checks pass, then logs into its run
    main()  # a sweep with failed jobs lists them and exits 1 (training/sweep.py's SweepReport, a Hydra callback)


if __name__ == "__main__":
    run()
