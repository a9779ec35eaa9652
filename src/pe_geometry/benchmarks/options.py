"""Argument types the benchmark commands share: a bad value is argparse's one error line (exit 2) at parse time, before
any run is read or any file written, instead of a traceback from deep inside the scoring (``--multipliers 0``,
``--seed -1``, ``--out`` under a file)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``, else argparse's one-line error naming the value (exit code 2) before
    anything is read or written (0 multipliers or batches would score nothing and write n/a over a result)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in its message
    return parse


def output_folder(text: str) -> Path:
    """A folder that exists or can be made: its nearest existing ancestor is a writable directory (a path under a
    file fails here, not in ``mkdir`` after the scoring)."""
    path = Path(text).expanduser()
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text} cannot be a folder: {existing} is a file")
    if not os.access(existing, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} cannot be written: {existing} is not writable")
    return path


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """One of ``choices`` (argparse's ``choices=`` lists them in the usage line too; this names them in the error)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(choices)}")
        return text

    parse.__name__ = "choice"
    return parse


def json_file(text: str) -> Path:
    """A JSON file to read, or one to write where none is yet: an existing one must parse (a damaged file is this one
    line, not a ``JSONDecodeError`` after minutes of work); a new one needs a folder that can be made."""
    import json

    path = Path(text).expanduser()
    if path.is_file():
        try:
            json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise argparse.ArgumentTypeError(f"{text} is not a readable JSON file ({type(err).__name__}: {err})") from None
        return path
    if path.exists():
        raise argparse.ArgumentTypeError(f"{text} is not a file")
    output_folder(str(path.parent))
    return path
