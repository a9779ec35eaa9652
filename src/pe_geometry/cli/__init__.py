"""The console scripts (pyproject's [project.scripts]); each module's ``main`` also answers a Python caller."""

from __future__ import annotations

from collections.abc import Callable


def console_script(main: Callable[[], object]) -> Callable[[], None]:
    """The console script of a ``main`` that returns its result to a Python caller. A console script hands its return
    value to ``sys.exit``, which would print that result and exit with 1; the script drops it (exit code 0)."""
    def script() -> None:
        main()

    script.__doc__ = f"Runs {main.__module__}.main as a console script (exit code 0 unless it exits itself)."
    return script
