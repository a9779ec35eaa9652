"""Sweep bookkeeping: how each job of a ``-m`` sweep ended, kept in the sweep folder, listed when the sweep ends.

A job may run in the launching process (Hydra's basic launcher), in a worker process (``local_parallel``) or on
another machine (``slurm``), so a failure cannot be kept in a Python list: the launching process never sees the
worker's. Each job writes ``<sweep dir>/job_status_<n>.json`` itself (atomically, by rename): ``running`` when it
starts (with its pid), ``failed`` with the error if it fails, ``stopped`` with the signal if a stop signal ended it
(Ctrl-C, SIGTERM: the sweep's process then prints the command that continues the sweep, ``continue_command``); a
job that succeeds removes it, so a sweep without failures leaves its folder as before. A job killed outright
(``kill -9``, out of memory) writes nothing more: its launcher records ``killed`` with the signal where it can
(hydra_plugins/pe_geometry/launchers.py), and a record still saying ``running`` when the sweep ends is listed too.
``SweepReport`` (a Hydra callback, configs/hydra/default.yaml) does the job's part in every job, and lists the
failures in the launching process when the sweep ends, followed by the command that makes the sweep's report.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from pe_geometry.files import temp_beside
from pe_geometry.training.hydra_compat import job_error

log = logging.getLogger(__name__)

# Files, not a folder, beside the job folders and listed after them (a digit sorts before a letter): scripts that
# take a sweep folder's sub-folders for its jobs, or its first entries for job 0 and 1, still do.
RECORD = re.compile(r"job_status_(\d+)\.json")


def sweep_folder(hydra: DictConfig) -> Path:
    """``hydra.sweep.dir`` (the ``hydra`` node of a job's or the sweep's config) from the folder the sweep was started
    in: with ``hydra.job.chdir=true`` a job runs inside its own folder, where a relative one would point elsewhere."""
    return Path(hydra.runtime.cwd, hydra.sweep.dir)


def job_record_path(sweep_dir: str | Path, num: int) -> Path:
    return Path(sweep_dir) / f"job_status_{num}.json"


def records(sweep_dir: str | Path) -> list[Path]:
    """The record files in a sweep folder, by job number."""
    found = [(int(m[1]), path) for path in Path(sweep_dir).glob("job_status_*.json") if (m := RECORD.fullmatch(path.name))]
    return [path for _, path in sorted(found)]


def read_record(sweep_dir: str | Path, num: int) -> dict[str, Any] | None:
    try:
        return json.loads(job_record_path(sweep_dir, num).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_record(sweep_dir: str | Path, num: int, overrides: Sequence[str], status: str, error: str | None = None) -> None:
    """Replace job ``num``'s record, whole or not at all (a kill mid-write leaves the previous one). Best effort:
    a full disk must not turn a job's outcome into a second failure, so it is a warning."""
    path = job_record_path(sweep_dir, num)
    record = {"num": num, "overrides": list(overrides), "status": status, "error": error, "pid": os.getpid()}
    try:
        fd, tmp = temp_beside(path)  # the umask's mode, not mkstemp's 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        log.warning("could not record sweep job %d as %s in %s: %s", num, status, path, err)


def describe(num: int, overrides: Sequence[str], error: str) -> str:
    """``job 3 (optimizer.lr=0.002 seed=1): ConfigError: ...``: one line of the end-of-sweep list."""
    return f"job {num} ({' '.join(overrides) or 'no overrides'}): {error}"


def record_failed_job(err: BaseException) -> str:
    """Record the current sweep job (Hydra's job config) as failed with ``err``; returns its line for the terminal."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    overrides, error = list(hydra.overrides.task), f"{type(err).__name__}: {err}"
    _failed_here.add(hydra.job.num)  # kept in this process too: the record may not be writable (a full disk)
    write_record(sweep_folder(hydra), hydra.job.num, overrides, "failed", error)
    return describe(hydra.job.num, overrides, error)


_failed_here: set[int] = set()  # jobs this process recorded as failed (on_job_end must not count them a success)


def record_stopped_job(how: str) -> None:
    """Record the current sweep job (Hydra's job config) as stopped by a signal: ``how``, e.g. ``stopped by SIGTERM``."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    write_record(sweep_folder(hydra), hydra.job.num, list(hydra.overrides.task), "stopped", how)


def record_killed_job(sweep_dir: str | Path, num: int, overrides: Sequence[str], how: str) -> None:
    """For a launcher whose job's process died without reporting: unless the job recorded its failure first."""
    record = read_record(sweep_dir, num)
    if record is None or record["status"] == "running":
        write_record(sweep_dir, num, overrides, "killed", how)


def failed_jobs(sweep_dir: str | Path) -> list[str]:
    """One line per job of the sweep that did not succeed (failed, killed, or ended without a word), by job number."""
    lines = []
    for path in records(sweep_dir):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # removed meanwhile: that job succeeded
        error = record["error"] or f"its process (pid {record['pid']}) ended without reporting a result (killed?)"
        lines.append(describe(record["num"], record["overrides"], error))
    return lines


def in_sweep(config: DictConfig) -> bool:
    return config.hydra.mode == RunMode.MULTIRUN


_launched: Path | None = None  # the sweep folder of the sweep this process launches (SweepReport.on_multirun_start)


def launched_sweep() -> Path | None:
    """The folder of the sweep this process launched, once it has started; else None."""
    return _launched


def continue_command(argv: Sequence[str], sweep_dir: Path) -> str:
    """``pe-train -m <the sweep's arguments> hydra.sweep.dir=<its folder> ckpt_path=auto``: continues a stopped sweep
    (each job resumes from its ``last.ckpt``, or starts), quoted for Hydra and the shell so that it runs as printed."""
    from pe_geometry.training.names import hydra_value

    replaced = ("hydra.sweep.dir", "ckpt_path")
    kept = [arg for arg in argv if arg not in ("-m", "--multirun") and arg.partition("=")[0].lstrip("+") not in replaced]
    return shlex.join(["pe-train", "-m", *kept, f"hydra.sweep.dir={hydra_value(str(sweep_dir))}", "ckpt_path=auto"])


class SweepReport(Callback):
    """Writes each sweep job's record (in the job's process) and lists the failures when the sweep ends (in the
    launching process, which then exits 1). Does nothing in a single run."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _launched
        _launched = sweep_folder(config.hydra)
        for path in records(_launched):  # of an earlier sweep into this folder
            path.unlink(missing_ok=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if in_sweep(config):
            write_record(sweep_folder(config.hydra), config.hydra.job.num, config.hydra.overrides.task, "running")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not in_sweep(config):
            return
        sweep_dir, num = sweep_folder(config.hydra), config.hydra.job.num
        record = read_record(sweep_dir, num)
        if (record is not None and record["status"] != "running") or num in _failed_here:
            return  # train.py recorded the failure, with its message (or tried to: a record left "running" is listed too)
        if job_return.status == JobStatus.FAILED:  # an error train.py did not catch (Hydra's sweeper stops at it)
            error = job_error(job_return)  # (its public return_value raises it)
            write_record(sweep_dir, num, config.hydra.overrides.task, "failed", f"{type(error).__name__}: {error}")
        else:
            job_record_path(sweep_dir, num).unlink(missing_ok=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = sweep_folder(config.hydra)
        if lines := failed_jobs(sweep_dir):
            print(f"error: {len(lines)} sweep job(s) failed:", *(f"  {line}" for line in lines), sep="\n", file=sys.stderr, flush=True)
        print(f"report: pe-report {shlex.quote(str(sweep_dir))}", flush=True)  # as a single run's summary ends
        if lines:
            sys.exit(1)  # a sweep with failed jobs is not a success (a scheduler, a script's `&&`)
