"""A full or read-only disk, reported as one line instead of a traceback.

Our own writers (``pe_geometry.files``: checkpoints, ``metrics.csv``, the token cache) raise ``StorageError``
naming the file. ``storage_failure`` also finds the raw ``OSError`` of a write we do not own (Lightning's
``hparams.yaml``, say), however deep it sits in the exception chain; ``quiet_log_file_errors`` keeps a
log file on that disk from printing logging's traceback for every record.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pe_geometry.files import STORAGE_ERRNOS, StorageError, describe_errno

__all__ = ["StorageError", "quiet_log_file_errors", "storage_failure"]


def storage_failure(err: BaseException, cfg: DictConfig) -> StorageError | None:
    """The full or read-only disk behind ``err`` as one line that names the file and the last complete
    checkpoint of the run; None when ``err`` has another cause.

    Lightning stops a run by flushing its loggers, which on a full disk can fail again: the new error
    carries the first in its context. The earliest write that failed is the one reported.
    """
    chain, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        chain.append(err)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)  # (``raise ... from None`` ends it)
    ours = [e for e in chain if isinstance(e, StorageError)]
    raw = [e for e in chain if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS]
    if ours:
        line = str(ours[-1])
    elif raw:  # not one of our writes: it may have been a read, so no verb
        cause = raw[-1]
        line = describe_errno(cause.errno) + (f": {cause.filename}" if cause.filename else "")
    else:
        return None
    output_dir = OmegaConf.select(cfg, "paths.output_dir", default=None, throw_on_resolution_failure=False)
    last = Path(output_dir, "checkpoints", "last.ckpt") if output_dir else None
    if last is not None and last.is_file():  # written by rename: complete, even if a later save failed
        line += f"; the last complete checkpoint is {last}"
    return StorageError((ours or raw)[-1].errno, line)


def quiet_log_file_errors(logger: logging.Logger | None = None) -> None:
    """Make each log file handler of ``logger`` (the root logger: Hydra's ``train.log``) report a failed write
    (a full or read-only disk) in one ``warning:`` line on stderr, once, instead of logging's
    "--- Logging error ---" traceback for every record, which buried the run's own ``error:`` line.
    Other errors in a handler (a bad format string) keep logging's traceback."""
    for handler in (logger or logging.getLogger()).handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handleError = _report_once(handler)


def _report_once(handler: logging.FileHandler):
    reported = False

    def handle_error(record: logging.LogRecord) -> None:
        nonlocal reported
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            logging.FileHandler.handleError(handler, record)
        elif not reported:
            reported = True
            reason = describe_errno(err.errno) if err.errno else str(err)
            print(f"warning: cannot write the log file {handler.baseFilename} ({reason}); "
                  "records that do not fit are lost, and later failures are not reported", file=sys.stderr)

    return handle_error
