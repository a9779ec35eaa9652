"""Run folders hold runs: a refused command leaves none behind, a resume logs into the run it continues.

Hydra makes the job's output folder, writes ``.hydra/*.yaml`` into it and opens ``train.log`` there
before ``main`` runs. For a resume that folder would be a stub beside the run (and with
``hydra.run.dir=<run>``, the run's own ``.hydra/`` and ``train.log`` overwritten by a command that is
then refused). So ``train.py`` points Hydra at a private staging folder for a resume
(``stage_resume``); once the checkpoint and the config have passed their checks, ``adopt_staged_output``
moves that folder's ``.hydra/`` to ``<run>/.hydra/resume-step<N>/`` and continues ``<run>/train.log``
after a segment marker. A refused resume leaves nothing anywhere: the staging folder is removed at exit.
A new run refused by its checks (a bad value, an empty corpus) removes the folder Hydra made for it
(``remove_stub_run_dir``), so ``outputs/`` lists only runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path

_staging: Path | None = None  # this process's staging folder, when it stages a resume

# Hydra flags that answer without running the job, so without making or touching a run folder
ANSWERS_ONLY = {"-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion"}


def answers_only(argv: list[str]) -> bool:
    return any(arg.partition("=")[0] in ANSWERS_ONLY for arg in argv)


def _value(argv: list[str], key: str) -> str | None:
    """The last value given to ``key`` on the command line (Hydra: the last one wins)."""
    found = None
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep and name.lstrip("+") == key:
            found = value.strip("'\"")
    return found


def overwrites_a_run(argv: list[str]) -> str | None:
    """A new single run (no ``ckpt_path``) given ``hydra.run.dir=<a run's folder>`` would have Hydra overwrite that
    run's ``.hydra/`` before any check: the error line, said before Hydra starts; else None. (``train`` refuses the
    same inside a sweep job, where the folder is Hydra's to name.)"""
    if "-m" in argv or "--multirun" in argv or _value(argv, "ckpt_path") not in (None, "", "null", "None"):
        return None
    run_dir = _value(argv, "hydra.run.dir")
    if run_dir is None or "${" in run_dir or answers_only(argv):
        return None
    if (Path(run_dir).expanduser() / "checkpoints" / "last.ckpt").is_file():
        return (f"hydra.run.dir={run_dir} already holds a run (checkpoints/last.ckpt): a new run there would overwrite it; "
                "continue it with ckpt_path=last, or give the new run another folder")
    return None


def stage_resume(argv: list[str]) -> list[str]:
    """``argv`` with ``hydra.run.dir`` pointed at a fresh staging folder when it resumes a single run; else as given."""
    global _staging
    ckpt = _value(argv, "ckpt_path")
    if ckpt in (None, "", "null", "None") or "-m" in argv or "--multirun" in argv:
        return argv
    if any(arg.startswith("hydra.job.name=train_ddp_process_") for arg in argv):
        return argv  # a DDP rank Lightning started: it shares rank 0's folder
    if answers_only(argv):
        return argv  # answers without running
    extra = []
    if ckpt != "last" and Path(ckpt).expanduser().parent.name != "checkpoints":
        return argv  # a checkpoint outside a run's checkpoints/: the resume becomes a new run in the folder Hydra makes
    if ckpt == "last":  # "this run folder's last.ckpt": the folder the command names, before Hydra is pointed elsewhere
        run_dir = _value(argv, "hydra.run.dir")
        if run_dir is None or "${" in run_dir:
            return argv  # no folder named: the run's error says there is no checkpoint there
        extra.append(f"ckpt_path={Path(run_dir).expanduser().absolute() / 'checkpoints' / 'last.ckpt'}")
    _staging = Path(tempfile.mkdtemp(prefix="pe-geometry-resume-"))
    atexit.register(shutil.rmtree, _staging, ignore_errors=True)
    return [*argv, *extra, f"hydra.run.dir={_staging}"]


def is_staged(output_dir: Path) -> bool:
    return _staging is not None and Path(output_dir).resolve() == _staging.resolve()


def adopt_staged_output(run_dir: Path, step: int) -> None:
    """Move the staged ``.hydra/`` into the run and continue its ``train.log`` (after the resume's checks passed)."""
    global _staging
    if _staging is None or not _staging.is_dir() or Path(run_dir).resolve() == _staging.resolve():
        return  # (the run continuing in the staging folder itself would be deleted with it: never adopt into it)
    staged, _staging = _staging, None
    run_dir.mkdir(parents=True, exist_ok=True)
    if (staged / ".hydra").is_dir():
        target = run_dir / ".hydra" / f"resume-step{step}"
        shutil.rmtree(target, ignore_errors=True)  # the same resume run again: its latest command
        shutil.copytree(staged / ".hydra", target, dirs_exist_ok=True)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if not isinstance(handler, logging.FileHandler) or Path(handler.baseFilename).parent != staged:
            continue
        handler.flush()
        earlier = Path(handler.baseFilename).read_text()
        log_file = run_dir / Path(handler.baseFilename).name
        with open(log_file, "a") as f:
            f.write(f"---- resumed at step {step}, {datetime.now():%Y-%m-%d %H:%M:%S} ----\n{earlier}")
        moved = logging.FileHandler(log_file, mode="a")
        moved.setLevel(handler.level)
        moved.setFormatter(handler.formatter)
        for log_filter in handler.filters:
            moved.addFilter(log_filter)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(moved)
        from pe_geometry.training.storage import quiet_log_file_errors  # the moved log, too: one warning on a full disk

        quiet_log_file_errors()
    shutil.rmtree(staged, ignore_errors=True)


HYDRA_STUB = {".hydra", "train.log"}  # what Hydra writes into a job's folder before the job runs


def remove_stub_run_dir(run_dir: Path, start_dir: Path) -> bool:
    """Delete ``run_dir`` if it holds only what Hydra wrote there (a run refused before it wrote anything),
    and the folders above it up to ``start_dir`` (where the command was started) that it leaves empty."""
    run_dir, start_dir = Path(run_dir).absolute(), Path(start_dir).absolute()
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - HYDRA_STUB:
        return False
    if Path.cwd().absolute().is_relative_to(run_dir):  # hydra.job.chdir=true: step out before removing it
        os.chdir(start_dir)
    root = logging.getLogger()
    for handler in list(root.handlers):  # the log file is open: close it first
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
            root.removeHandler(handler)
            handler.close()
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:  # outputs/<date>/ that only this run was in
        if parent == start_dir or not parent.is_relative_to(start_dir) or any(parent.iterdir()):
            break
        parent.rmdir()
    return True
