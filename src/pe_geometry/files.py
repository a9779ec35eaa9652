"""Files written whole or not at all, and a failed write as one line naming the file. Standard library only: every
layer writes through here (checkpoints, ``metrics.csv``, the token cache, reports, ``run_info.json``).

- ``atomic_write_bytes`` / ``atomic_write_text``: a temporary file beside the target, fsync, then ``os.replace``: a
  reader (or a run killed mid-write) never sees half a file, and a failed write leaves the previous file as it was.
- ``append_bytes``: an append that is cut back off if it fails half-way (a full disk), so the next one starts on a
  line of its own.
- ``StorageError``: a write that failed for want of space or permission (a full disk, a read-only mount), one line
  naming the file, which ``train.py`` prints as ``error: ...``; ``storage_errors`` turns an ``OSError`` into one.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Why a disk write fails for reasons outside the program: no space, a quota, a read-only mount, permissions.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class StorageError(OSError):
    """A file could not be written (full disk, read-only mount, ...); ``str()`` is one line naming the file.

    An ``OSError`` (with the cause's errno), so code that handles ``OSError`` still does.
    """

    def __str__(self) -> str:
        return self.strerror or super().__str__()  # without OSError's "[Errno 28] ...: '<path>'" framing


def describe_errno(code: int) -> str:
    """``"no space left on device"`` for ENOSPC: the system's wording, to sit inside a sentence."""
    reason = os.strerror(code)
    return reason[:1].lower() + reason[1:]


@contextmanager
def storage_errors(path: Path) -> Iterator[None]:
    """Re-raise an ``OSError`` from writing ``path`` as a ``StorageError`` that names it (the target, not a temp file)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as err:
        if err.errno is None:  # not from the system: leave it as it is
            raise
        raise StorageError(err.errno, f"{describe_errno(err.errno)} writing {path}", str(path)) from err


def write_all(fd: int, data: bytes, path: Path) -> None:
    """``os.write`` may take only part of the buffer (a filling disk takes what fits, then fails): loop to the end."""
    view = memoryview(data)
    with storage_errors(path):
        while view:
            view = view[os.write(fd, view):]


def current_umask() -> int:
    """The process's umask (read by setting it and back: the only portable way; Linux also shows it in
    /proc/self/status)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def temp_beside(path: Path) -> tuple[int, str]:
    """A new temporary file in ``path``'s folder (``.<name>.<random>.tmp``), open for writing, with the mode a plain
    ``open()`` would give the file under this umask: ``mkstemp`` makes it 0600, which the rename would keep, so a
    teammate on a shared cluster could not read a run's checkpoints, logs or the shared token cache."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~current_umask())
    return fd, tmp


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` whole or leave the previous file: a temp file beside it, fsync, then ``os.replace``.
    Every file a run or a report writes goes through here (or ``atomic_write_text``): a reader never sees half."""
    with storage_errors(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_beside(path)
        try:
            try:
                write_all(fd, data, path)
                os.fsync(fd)  # a full disk may only say so here (delayed allocation, NFS)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)  # the previous file at ``path`` is untouched
            raise


def atomic_write_text(path: Path, text: str) -> None:
    """``atomic_write_bytes`` for UTF-8 text (report.md, summary.json, run_info.json, ...)."""
    atomic_write_bytes(Path(path), text.encode("utf-8"))


def append_bytes(path: Path, data: bytes) -> None:
    """Append ``data`` whole or not at all: a write cut short (a full disk) is cut back off, so the next
    append does not run on from half a line."""
    with storage_errors(path):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # (as open(): the umask applies)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                write_all(fd, data, path)
            except BaseException:
                os.ftruncate(fd, end)  # shrinking needs no space
                raise
        finally:
            os.close(fd)
