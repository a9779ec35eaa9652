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

One writer per run folder: a run holds ``<run>/run.lock`` (``claim_run_folder``) while it writes there. Two runs
started in the same second (same overrides: one folder name), a resume while the run still trains, or a sweep
continued beside the jobs it would resume would otherwise write one folder together (interleaved CSV rows and
checkpoints, a traceback in the CSV logger). The second one is refused with ``RunFolderInUse``, naming the live
process. The lock is ``fcntl.flock`` on an open file, which the kernel releases when its process ends, however
it ends (``kill -9`` too): a lock left by a dead run never blocks its resume. The file stays (it says which
process last wrote the run); deleting it on exit would race a process opening it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no flock; runs there go unlocked
    fcntl = None

log = logging.getLogger(__name__)

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
        try:
            check_not_in_use(Path(run_dir).expanduser())  # a run still writing there: say so, not how to continue it
        except RunFolderInUse as err:
            return str(err)
        return (f"hydra.run.dir={run_dir} already holds a run (checkpoints/last.ckpt): a new run there would overwrite it; "
                "continue it with ckpt_path=last, or give the new run another folder")
    return None


def with_run_choices(argv: list[str]) -> list[str]:
    """A single run's resume (``ckpt_path=...``) composes with the run's own group choices (``pe=rope``,
    ``callbacks=early_stop``, ``data=task``), read from its checkpoint, for every group the command line leaves alone:
    then ``callbacks.early_stopping.patience=6`` or ``pe.rotary_fraction=0.5`` names a key the run has, and is applied
    or refused by the resume's own checks, instead of Hydra's "not in struct" against the default options. The added
    choices restate the run's, so they set nothing (``resume.restates_run_choice``). A checkpoint that cannot be read
    here is left to the resume's own error."""
    ckpt = _value(argv, "ckpt_path")
    if ckpt in (None, "", "null", "None", "auto") or "-m" in argv or "--multirun" in argv or answers_only(argv):
        return argv
    if ckpt == "last":
        run_dir = _value(argv, "hydra.run.dir")
        if run_dir is None or "${" in run_dir:
            return argv
        path = Path(run_dir).expanduser() / "checkpoints" / "last.ckpt"
    else:
        path = Path(ckpt).expanduser()
        path = path / "checkpoints" / "last.ckpt" if path.is_dir() else path
    if not path.is_file():
        return argv
    try:
        import torch

        choices = torch.load(path, map_location="cpu", weights_only=False, mmap=True).get("group_choices") or {}
    except Exception:  # noqa: BLE001 - the resume reads it again and says what is wrong in one line
        return argv
    given = {arg.partition("=")[0].lstrip("~+") for arg in argv}
    added = [f"{group}={option}" for group, option in choices.items()
             if option not in (None, "null", "") and not str(group).startswith("hydra") and group not in given]
    return [*added, *argv]  # before the command line's own overrides


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
    if _value(argv, "branch") in ("true", "True", "1"):
        return argv  # a branch is a new run in the folder Hydra makes: nothing to stage
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


LOCK_FILE = "run.lock"
HYDRA_STUB = {".hydra", "train.log", LOCK_FILE}  # what a job's folder holds before the run writes anything


def remove_stub_run_dir(run_dir: Path, start_dir: Path) -> bool:
    """Delete ``run_dir`` if it holds only what Hydra wrote there, and its lock (a run refused or interrupted before
    it wrote anything), unless another live run holds it, and the folders above it up to ``start_dir`` (where the
    command was started) that it leaves empty."""
    run_dir, start_dir = Path(run_dir).absolute(), Path(start_dir).absolute()
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - HYDRA_STUB:
        return False
    try:
        check_not_in_use(run_dir)
    except RunFolderInUse:
        return False  # another run started in the same folder (the same second) and is still starting
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


class RunFolderInUse(Exception):
    """A live process holds the run folder's lock: this one must not write there (exit code 2, one line)."""


def _holder(lock: Path) -> str:
    """``pid 123 on host, started 2025-01-01 12:00:00`` from the lock file (its holder may be writing it: retry)."""
    for _ in range(20):
        try:
            info = json.loads(lock.read_text(encoding="utf-8"))
            return f"pid {info['pid']} on {info['host']}, started {info['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            time.sleep(0.05)
    return "a process whose pid the lock file does not say"


def _in_use(run_dir: Path, holder: str) -> RunFolderInUse:
    return RunFolderInUse(f"{run_dir} is in use by a run that is still going ({holder}): wait for it to end or stop "
                          "it first; two runs in one folder would mix their logs and checkpoints")


@contextmanager
def claim_run_folder(run_dir: Path) -> Iterator[None]:
    """Hold ``<run_dir>/run.lock`` while the ``with`` body writes the run; ``RunFolderInUse`` if a live process holds
    it. The file records this process (pid, host, start time) for the error line of the process refused."""
    if fcntl is None:
        yield
        return
    lock = Path(run_dir) / LOCK_FILE
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (Python's default)
    with os.fdopen(fd, "r+", encoding="utf-8") as f:  # closing it releases the lock; so does the kernel when we die
        if _locked(f, fcntl.LOCK_EX, lock):
            f.truncate(0)
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": f"{datetime.now():%Y-%m-%d %H:%M:%S}"}))
            f.flush()
        yield


def check_not_in_use(run_dir: Path) -> None:
    """``RunFolderInUse`` if a live process holds ``run_dir``'s lock. Changes nothing: a shared lock, given back at once."""
    lock = Path(run_dir) / LOCK_FILE
    if fcntl is not None and lock.is_file():
        with open(lock, encoding="utf-8") as f:
            _locked(f, fcntl.LOCK_SH, lock)


def _locked(f, how: int, lock: Path) -> bool:
    """``flock(f, how)`` without waiting: True once held, ``RunFolderInUse`` if a live process holds it, False (and a
    warning) on a file system without locks (some network mounts), where the run goes on unprotected as before."""
    try:
        fcntl.flock(f, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        raise _in_use(lock.parent, _holder(lock)) from None
    except OSError as err:
        log.warning("cannot lock %s (%s): nothing stops a second run from writing this folder too", lock, err.strerror)
        return False
