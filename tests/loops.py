"""One test looping over a grid of values that only repeat a formula, instead of one test id per value."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def named(*values: Any) -> Iterator[None]:
    """An assertion failing inside the ``with`` names the values it failed at (Python 3.10 has no exception notes)."""
    try:
        yield
    except AssertionError as error:
        raise AssertionError(f"at {values}: {error}") from error


def grid(*axes) -> Iterator[tuple]:
    """Every combination of the axes' values (``itertools.product``), to loop over with ``named(*combination)``."""
    return itertools.product(*axes)
