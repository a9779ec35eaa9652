"""A full or read-only disk, and a cache file replaced by a directory: one clear line, no traceback, and the
last complete checkpoint (and cache entry) left whole. See docs/RELIABILITY.md.

In-process, a full disk is ``FakeDisk`` standing in for the ``os`` module of ``pe_geometry.files``, through which
every writer of ours goes (checkpoints, ``metrics.csv``, the token cache): a chosen file takes what fits,
then fails with ENOSPC as a real one does. Tests may run as root, where ``chmod`` stops no write, so the
read-only cases patch the failing call in-process. The ``slow`` tests run ``train.py`` against a real
full or read-only tmpfs in a private mount namespace (``unshare``), and skip where that is not allowed;
``/dev/full`` (ENOSPC on every write) stands for a log file on a full disk.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pe_geometry import files
from pe_geometry.data.corpus import TextFilesCorpus
from pe_geometry.data.datamodule import TextDataModule
from pe_geometry.files import StorageError
from pe_geometry.training.callbacks import AtomicCheckpointIO, _CrashSafeMetricsWriter
from pe_geometry.training.pipeline import check_writable, train
from pe_geometry.training.storage import quiet_log_file_errors, storage_failure
from pe_geometry.training.validate import ConfigError
from tests import forkserver
from tests.conftest import ROOT, TINY, tiny_train_config

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="FakeDisk tells files apart by /proc/self/fd")


class FakeDisk:
    """The ``os`` module, except that writes to a file whose path contains ``match`` take ``free`` bytes in all
    and then fail with ``error`` (a short write first, as a filling disk gives); ``fsync_fails`` fails the fsync
    instead (where delayed allocation or NFS first report a full disk)."""

    def __init__(self, match: str, free: int = 0, error: int = errno.ENOSPC, fsync_fails: bool = False) -> None:
        self.match, self.free, self.error, self.fsync_fails = match, free, error, fsync_fails

    def __getattr__(self, name: str):
        return getattr(os, name)

    def _hit(self, fd: int) -> bool:
        return self.match in os.readlink(f"/proc/self/fd/{fd}")

    def write(self, fd: int, data) -> int:
        if not self._hit(fd) or self.fsync_fails:
            return os.write(fd, data)
        if self.free <= 0:
            raise OSError(self.error, os.strerror(self.error))
        written = os.write(fd, bytes(data[: self.free]))
        self.free -= written
        return written

    def fsync(self, fd: int) -> None:
        if self.fsync_fails and self._hit(fd):
            raise OSError(self.error, os.strerror(self.error))
        os.fsync(fd)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# -- checkpoints ---------------------------------------------------------------------------------
@pytest.mark.parametrize("failure", ["full", "full_at_fsync", "read_only"])
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint_and_no_temp_file(failure, tmp_path, monkeypatch):
    path = tmp_path / "checkpoints" / "last.ckpt"
    io_plugin = AtomicCheckpointIO()
    io_plugin.save_checkpoint({"global_step": 1, "weights": torch.zeros(1000)}, path)
    if failure == "read_only":  # the temp file cannot even be created
        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path.parent))
        monkeypatch.setattr(files.tempfile, "mkstemp", read_only)
    else:
        monkeypatch.setattr(files, "os", FakeDisk("last.ckpt", free=1000, fsync_fails=failure == "full_at_fsync"))
    reason = "read-only file system" if failure == "read_only" else "no space left on device"
    with pytest.raises(StorageError, match=rf"^{reason} writing {re.escape(str(path))}$") as err:
        io_plugin.save_checkpoint({"global_step": 2, "weights": torch.ones(1000)}, path)
    assert err.value.errno == (errno.EROFS if failure == "read_only" else errno.ENOSPC)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False)["global_step"] == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_a_full_disk_while_training_is_one_line_naming_the_file_and_the_last_complete_checkpoint(
        tmp_path, tiny_corpus, cache_dir, monkeypatch):
    """Step 2 is saved; the disk is full when step 4 is: the run stops with StorageError, and train.py's line
    (``storage_failure``) names the file and the checkpoint to resume from, which is step 2's, whole."""
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=6", "trainer.val_check_interval=6"])
    monkeypatch.setattr(files, "os", FakeDisk("step000004.ckpt", free=50_000))
    with pytest.raises(StorageError) as err:
        train(cfg)
    run = tmp_path / "run"
    assert str(err.value) == f"no space left on device writing {run}/checkpoints/step000004.ckpt"
    assert str(storage_failure(err.value, cfg)) == (
        f"no space left on device writing {run}/checkpoints/step000004.ckpt; "
        f"the last complete checkpoint is {run}/checkpoints/last.ckpt"
    )
    monkeypatch.undo()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step000002.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2
    assert not temp_files(tmp_path)


# -- metrics.csv ---------------------------------------------------------------------------------
def test_a_full_disk_while_writing_metrics_leaves_no_partial_row_and_the_rows_are_kept(tmp_path, monkeypatch):
    csv_path = tmp_path / "metrics.csv"
    writer = _CrashSafeMetricsWriter(str(tmp_path))
    for step in range(3):
        writer.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    writer.save()
    before = csv_path.read_text()
    writer.log_metrics({"train/loss": 0.2}, step=3)  # an append
    monkeypatch.setattr(files, "os", FakeDisk("metrics.csv", free=5))  # room for half a row
    with pytest.raises(StorageError, match=rf"^no space left on device writing {re.escape(str(csv_path))}$"):
        writer.save()
    assert csv_path.read_text() == before  # the half row was cut back off
    writer.log_metrics({"val/loss": 0.5}, step=3)  # a new column: the whole file is rewritten
    with pytest.raises(StorageError, match="no space left on device writing .*metrics.csv"):
        writer.save()
    assert csv_path.read_text() == before and not temp_files(tmp_path)
    monkeypatch.undo()  # space again: the rows held back are written
    writer.save()
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        ("0", "1.0", ""), ("1", "0.5", ""), ("2", "0.3333333333333333", ""), ("3", "0.2", ""), ("3", "", "0.5")]


# -- the run folder at start -----------------------------------------------------------------------
@pytest.mark.parametrize("failure", ["full", "read_only"])
def test_an_unwritable_run_folder_is_one_line_at_start_and_leaves_no_probe(failure, tmp_path, monkeypatch):
    real_open = Path.open

    def unwritable(self, mode="r", *args, **kwargs):
        if "w" in mode and self.parent == tmp_path:
            if failure == "read_only":
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            real_open(self, mode, *args, **kwargs).close()  # a full disk makes the file, then fails the write
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", unwritable)
    reason = "Read-only file system" if failure == "read_only" else "No space left on device"
    with pytest.raises(ConfigError, match=rf"^paths.output_dir={re.escape(str(tmp_path))} is not writable \({reason}\)$"):
        check_writable(tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- the token cache -------------------------------------------------------------------------------
def _datamodule(corpus: dict[str, Path], cache: Path) -> TextDataModule:
    return TextDataModule(TextFilesCorpus(train_files=[str(corpus["train"])], val_files=[str(corpus["validation"])]), vocab_size=300,
                          seq_len=16, batch_size=4, cache_dir=str(cache))


@pytest.mark.parametrize("failure", ["read_only", "full"])
def test_an_unwritable_token_cache_is_one_line_naming_the_file(failure, tmp_path, tiny_corpus, monkeypatch):
    cache = tmp_path / "cache"
    if failure == "read_only":  # the entry's folder cannot be made (root ignores chmod: patch the call)
        real_mkdir = Path.mkdir

        def read_only(self, *args, **kwargs):
            if self.parent == cache:
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(Path, "mkdir", read_only)
        expected = r"read-only file system writing .*/cache/\w+/tokenizer\.json"
    else:  # the tokenizer fits, the training tokens do not
        monkeypatch.setattr(files, "os", FakeDisk("train.npy", free=1000))
        expected = r"no space left on device writing .*/cache/\w+/train\.npy"
    with pytest.raises(StorageError, match=rf"^{expected}$"):
        _datamodule(tiny_corpus, cache).prepare_data()
    assert not temp_files(tmp_path) and not list(cache.glob("*/meta.json"))  # no entry that looks complete
    monkeypatch.undo()
    dm = _datamodule(tiny_corpus, cache)  # with room again, the entry is built
    dm.prepare_data()
    assert dm.n_tokens("train") > 0 and (dm.cache_entry / "meta.json").is_file()


@pytest.mark.parametrize("name", ["tokenizer.json", "train.npy", "meta.json", "the entry folder"])
def test_a_directory_in_place_of_a_cache_file_is_removed_and_the_entry_rebuilt(name, tmp_path, tiny_corpus, caplog):
    cache = tmp_path / "cache"
    dm = _datamodule(tiny_corpus, cache)
    dm.prepare_data()
    entry, tokens = dm.cache_entry, dm.n_tokens("train")
    if name == "the entry folder":  # the other way round: a file where the entry's folder belongs
        shutil.rmtree(entry)
        entry.write_text("not a folder")
    else:
        (entry / name).unlink()
        (entry / name).mkdir()
        (entry / name / "inside").write_text("something")
    caplog.set_level(logging.WARNING, logger="pe_geometry.data.cache")
    rebuilt = _datamodule(tiny_corpus, cache)
    rebuilt.prepare_data()
    assert rebuilt.n_tokens("train") == tokens
    assert entry.is_dir() and all((entry / f).is_file() for f in ("tokenizer.json", "train.npy", "validation.npy", "meta.json"))
    assert re.search(r"removing .* where .* belongs", caplog.text), caplog.text
    assert not temp_files(tmp_path)


# -- train.py's line: the storage error behind what Lightning raised --------------------------------
def test_storage_failure_reports_the_first_failed_write_and_leaves_other_errors_alone(tmp_path):
    cfg = tiny_train_config(tmp_path, {"train": tmp_path, "validation": tmp_path}, tmp_path)
    first = StorageError(errno.ENOSPC, "no space left on device writing a.ckpt", "a.ckpt")
    later = StorageError(errno.ENOSPC, "no space left on device writing metrics.csv", "metrics.csv")
    later.__context__ = first  # Lightning flushes metrics.csv while it stops after the first: that can fail too
    assert str(storage_failure(later, cfg)) == "no space left on device writing a.ckpt"
    assert storage_failure(later, cfg).errno == errno.ENOSPC
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    raw = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/x/hparams.yaml")  # a write that is not ours
    assert str(storage_failure(raw, cfg)) == (
        f"disk quota exceeded: /x/hparams.yaml; the last complete checkpoint is {tmp_path}/run/checkpoints/last.ckpt"
    )
    assert storage_failure(RuntimeError("a bug"), cfg) is None
    assert storage_failure(OSError(errno.ENOENT, "No such file or directory"), cfg) is None
    chosen = ConfigError("a message of its own")  # raised `from None` while handling an OSError: it says it all
    chosen.__context__, chosen.__suppress_context__ = OSError(errno.EACCES, "Permission denied"), True
    assert storage_failure(chosen, cfg) is None


# -- the log file ----------------------------------------------------------------------------------
def test_a_log_file_on_a_full_disk_is_one_warning_line_not_a_traceback_per_record(capsys):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    logger = logging.getLogger("test_storage.full_log")
    handler = logging.FileHandler("/dev/full")  # every write fails with ENOSPC
    logger.addHandler(handler)
    try:
        quiet_log_file_errors(logger)
        for i in range(3):
            logger.warning("record %d", i)
    finally:
        logger.removeHandler(handler)
        with contextlib.suppress(OSError):  # (its buffer still holds what /dev/full refused)
            handler.close()
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "warning: cannot write the log file /dev/full (no space left on device); "
        "records that do not fit are lost, and later failures are not reported"
    ]


# -- through train.py ------------------------------------------------------------------------------
def _train_py_env(cache: Path) -> dict[str, str]:
    return {**os.environ, "PE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _corpus_args(corpus: dict[str, Path]) -> list[str]:
    return ["data=text_files", f"data.corpus.train_files=[{corpus['train']}]", f"data.corpus.val_files=[{corpus['validation']}]",
            "logger=csv", *TINY]


@pytest.mark.slow  # runs train.py in subprocesses
def test_cli_a_log_file_on_a_full_disk_gives_one_warning_and_the_run_goes_on(tmp_path, tiny_corpus, cache_dir):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")

    def train_py(*extra: str) -> subprocess.CompletedProcess:
        args = [*_corpus_args(tiny_corpus), "hydra.job_logging.handlers.file.filename=/dev/full", "~callbacks.geometry",
                "~callbacks.sample", *extra]
        return forkserver.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=_train_py_env(cache_dir),
                              capture_output=True, text=True, timeout=240)

    result = train_py("trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.startswith("warning: cannot write the log file")] == [
        "warning: cannot write the log file /dev/full (no space left on device); "
        "records that do not fit are lost, and later failures are not reported"
    ]
    assert "Traceback" not in result.stderr and "Logging error" not in result.stderr
    # a refused run: its one error line; a library that logs while importing may still meet the full disk (once)
    refused = train_py("seed=-1", f"hydra.run.dir={tmp_path / 'refused'}")
    assert refused.returncode == 2 and error_lines(refused.stderr) == ["error: seed=-1 must be an integer in [0, 4294967295]"]
    assert refused.stderr.count("warning: cannot write") <= 1 and "Traceback" not in refused.stderr


def _private_mounts() -> list[str] | None:
    """An ``unshare`` command whose tmpfs mounts no other process sees (root, or a user namespace), or None."""
    if shutil.which("unshare") is None:
        return None
    with tempfile.TemporaryDirectory() as probe:
        for command in (["unshare", "--mount"], ["unshare", "--mount", "--map-root-user"]):
            try:
                done = subprocess.run([*command, "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {probe}"],
                                      capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                return command
    return None


@pytest.mark.slow  # runs train.py in subprocesses
def test_cli_a_real_full_or_read_only_disk_is_one_error_line(tmp_path, tiny_corpus, cache_dir):
    """On tmpfs mounts of a private mount namespace: a read-only current folder (the default run folder),
    a read-only token cache, and a disk that fills up between two checkpoints of a run."""
    unshare = _private_mounts()
    if unshare is None:
        pytest.skip("cannot mount a tmpfs here (needs root or user namespaces)")
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    train_py = shlex.join([sys.executable, str(ROOT / "train.py"), *_corpus_args(tiny_corpus)])
    # 1400 kB: the run's small files and two checkpoints of 480 kB (step 2 and last.ckpt) fit, the third does not.
    script = f"""
        mount -t tmpfs -o size=10m tmpfs {mnt} && mkdir {mnt}/ro {mnt}/ro/cwd {mnt}/ro/cache && mount -o remount,ro {mnt} || exit 99
        (cd {mnt}/ro/cwd && PE_CACHE_DIR={cache_dir} {train_py}) 2> {out}/cwd.err; echo $? > {out}/cwd.rc
        PE_CACHE_DIR={mnt}/ro/cache {train_py} hydra.run.dir={out}/cache-run 2> {out}/cache.err; echo $? > {out}/cache.rc
        umount {mnt} && mount -t tmpfs -o size=1400k tmpfs {mnt} || exit 99
        PE_CACHE_DIR={cache_dir} {train_py} trainer.max_steps=6 hydra.run.dir={mnt}/run 2> {out}/full.err; echo $? > {out}/full.rc
        cp -a {mnt}/run {out}/full-run
    """
    done = subprocess.run([*unshare, "bash", "-c", script], cwd=tmp_path, env=_train_py_env(cache_dir),
                          capture_output=True, text=True, timeout=400)
    assert done.returncode != 99, done.stderr

    def result(case: str) -> tuple[int, str]:
        stderr = (out / f"{case}.err").read_text()
        assert "Traceback" not in stderr and "Logging error" not in stderr, stderr[-3000:]
        return int((out / f"{case}.rc").read_text()), stderr

    code, stderr = result("cwd")
    assert code == 2 and error_lines(stderr) == [f"error: hydra.run.dir=outputs cannot be created: {mnt}/ro/cwd is not writable"], stderr
    code, stderr = result("cache")
    assert code == 2, stderr[-3000:]
    assert len(error_lines(stderr)) == 1, stderr[-3000:]
    assert re.fullmatch(rf"error: read-only file system writing {mnt}/ro/cache/data/\w+/tokenizer\.json", error_lines(stderr)[0])
    code, stderr = result("full")
    assert code == 2, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    match = re.fullmatch(rf"error: no space left on device writing {mnt}/run/checkpoints/step(\d+)\.ckpt; "
                         rf"the last complete checkpoint is {mnt}/run/checkpoints/last\.ckpt", lines[0])
    assert match, lines[0]
    checkpoints = out / "full-run" / "checkpoints"
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == int(match.group(1)) - 2  # the save before
    assert not temp_files(out / "full-run")


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_an_atomic_write_keeps_the_umasks_mode(umask, mode, tmp_path):
    """A file written whole (checkpoints, metrics.csv, config.yaml, reports) gets the mode a plain open() would: a
    teammate on a shared cluster can read a run unless the umask says otherwise (mkstemp alone makes it 0600)."""
    from pe_geometry.files import atomic_write_text

    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "run_info.json", "{}")
        atomic_write_text(tmp_path / "run_info.json", "{}")  # replacing one keeps it too
    finally:
        os.umask(previous)
    assert (tmp_path / "run_info.json").stat().st_mode & 0o777 == mode
