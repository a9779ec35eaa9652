"""The runs a report reads, found without torch or matplotlib: ``pe-report`` on a folder with no run, or with runs
that logged no row, is one error line in a fraction of a second instead of after loading both."""

from __future__ import annotations

import logging
from pathlib import Path

from pe_geometry.analysis.readers.runs import Run, find_runs

log = logging.getLogger("report")
# pe-report --pretrained: MiniLM shown when its analysis is kept (auto), computed when not (minilm), or left out (none)
PRETRAINED_MODES = ("auto", "minilm", "none")


def reportable_runs(source: Path) -> list[Run]:
    """Every run under ``source`` that logged a row. None at all, or only runs whose metrics.csv holds its header (killed
    before their first logged step): one error line (exit code 2); such a run among others is left out with a warning."""
    runs = find_runs(source)
    if not runs:
        raise SystemExit(f"error: no runs under {source} (a run has config.yaml and csv/metrics.csv)")
    empty = [r for r in runs if not any(len(steps) for steps, _ in r.series.values())]
    if len(empty) == len(runs):
        raise SystemExit(f"error: no logged rows under {source}: every run's metrics.csv holds its header only "
                         f"({len(runs)} run(s), e.g. {empty[0].path}); resume it with ckpt_path=auto or train it again")
    for r in empty:
        log.warning("%s: its metrics.csv holds its header only, left out of the report", r.path)
    return [r for r in runs if all(r is not e for e in empty)]
