"""The console scripts (pyproject's [project.scripts]); each module's ``main`` also answers a Python caller."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pe_geometry.benchmarks.options import at_least as int_at_least  # noqa: F401  (the commands' argparse type)

positive_int = int_at_least(1)


def console_script(main: Callable[[], object]) -> Callable[[], None]:
    """The console script of a ``main`` that returns its result to a Python caller. A console script hands its return
    value to ``sys.exit``, which would print that result and exit with 1; the script drops it (exit code 0).

    Bad input is one ``error:`` line and exit code 2, as for a training config: a ``SchemaError`` (a run or checkpoint
    that cannot be loaded is one) or a ``SystemExit`` carrying its message (``raise SystemExit("error: ...")``, which
    Python itself would end with exit code 1)."""
    from pe_geometry.training.schema import SchemaError

    def script() -> None:
        try:
            main()
        except SchemaError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        except SystemExit as err:
            if not isinstance(err.code, str):
                raise
            print(err.code if err.code.startswith("error:") else f"error: {err.code}", file=sys.stderr)
            sys.exit(2)

    script.__doc__ = f"Runs {main.__module__}.main as a console script (bad input: one error line, exit code 2)."
    return script
