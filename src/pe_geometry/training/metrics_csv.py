"""Where a run's CSV metric log lives: one ``metrics.csv`` per segment of the run.

``csv/metrics.csv`` is the run as started; a resume from step N writes ``csv/resume-step<N>/metrics.csv``
(Lightning's ``CSVLogger`` with that version, beside its ``hparams.yaml``). A resume re-does the steps from
N on, so its segment replaces the earlier rows from step N on: ``analysis.runs.read_run_rows`` joins them
into the rows of one uninterrupted run. When a segment starts, the segments it replaces whole (those that
start at or after its step; every resume segment, for a fresh run in a used folder) are removed, so the
remaining ones join in the order of their steps.

Standard library only: the report reads runs without importing Lightning.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

CSV_DIR = "csv"  # under the run folder
METRICS_FILE = "metrics.csv"
_RESUME_PREFIX = "resume-step"


def resume_segment(step: int) -> str:
    """The folder (under ``csv/``) of the segment that resumed at ``step``: ``resume-step20``."""
    return f"{_RESUME_PREFIX}{step}"


def resume_folders(run_dir: Path) -> dict[int, Path]:
    """Resume step -> the folder of its segment, for every resume segment folder of the run."""
    log_dir = Path(run_dir) / CSV_DIR
    folders = log_dir.glob(f"{_RESUME_PREFIX}*") if log_dir.is_dir() else ()
    steps = {folder: folder.name.removeprefix(_RESUME_PREFIX) for folder in folders if folder.is_dir()}
    return {int(step): folder for folder, step in steps.items() if step.isdigit()}


def segment_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(first step, metrics file) of each segment that has one, in the order they join: the run as started, then
    the resumes by step."""
    segments = [(0, Path(run_dir) / CSV_DIR / METRICS_FILE)]
    segments += sorted((step, folder / METRICS_FILE) for step, folder in resume_folders(run_dir).items())
    return [(step, path) for step, path in segments if path.is_file()]


def superseded_segments(run_dir: Path, first_step: int) -> list[Path]:
    """The resume segment folders that a segment starting at ``first_step`` replaces whole."""
    return [folder for step, folder in sorted(resume_folders(run_dir).items()) if step >= first_step]


def read_complete_rows(path: Path, header_only: bool = False) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a metrics file, without a last line that a kill cut short (no newline at its end)."""
    if not Path(path).is_file():
        return [], []
    if header_only:
        with open(path, newline="") as f:
            return next(csv.reader(f), []), []
    text = Path(path).read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    rows = list(reader)
    return list(reader.fieldnames or []), rows
