"""The CSV metric log of a resumed run: one file per segment, joined by the run reader (training/metrics_csv.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pe_geometry.analysis.readers.runs import read_metrics, read_run_rows
from pe_geometry.training.callbacks import ResumableCSVLogger


def write_segment(run: Path, folder: str, steps: range, column: str = "train/loss", scale: float = 1.0) -> None:
    path = run / "csv" / folder / "metrics.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"step,{column}\n" + "".join(f"{s},{float(scale * s)}\n" for s in steps))


def log_rows(logger: ResumableCSVLogger, steps: range) -> None:
    for step in steps:
        logger.log_metrics({"train/loss": 0.5 * step}, step=step)
    logger.save()


def test_a_later_segment_replaces_the_rows_from_its_resume_step_on(tmp_path):
    write_segment(tmp_path, "", range(10))
    write_segment(tmp_path, "resume-step4", range(4, 8), "val/loss", scale=10)  # a column the first segment lacks
    write_segment(tmp_path, "resume-step6", range(6, 10), scale=100)
    rows = read_run_rows(tmp_path)
    assert [(r["step"], r["train/loss"], r["val/loss"]) for r in rows] == [
        *((str(s), str(float(s)), "") for s in range(4)),  # the run as started, up to the first resume
        ("4", "", "40.0"), ("5", "", "50.0"),  # the resume from step 4, up to the next resume
        *((str(s), str(100.0 * s), "") for s in range(6, 10)),
    ]
    steps, values = read_metrics(tmp_path)["train/loss"]  # what the report plots
    assert steps.tolist() == [0, 1, 2, 3, 6, 7, 8, 9] and np.allclose(values, [0, 1, 2, 3, 600, 700, 800, 900])


def test_a_resume_writes_its_own_file_and_leaves_the_earlier_one_untouched(tmp_path):
    log_rows(ResumableCSVLogger(str(tmp_path)), range(6))
    first = (tmp_path / "csv" / "metrics.csv").read_bytes()
    logger = ResumableCSVLogger(str(tmp_path), resume_step=2)
    assert Path(logger.log_dir) == tmp_path / "csv" / "resume-step2"
    log_rows(logger, range(2, 8))
    assert (tmp_path / "csv" / "metrics.csv").read_bytes() == first
    assert [r["step"] for r in read_run_rows(tmp_path)] == [str(s) for s in range(8)]


def test_a_resume_from_an_earlier_step_removes_the_segments_it_replaces(tmp_path):
    """A resume from step 4 after one from step 6: the step-6 segment is replaced whole. Left in place, it would be
    joined after the newer one (segments join in step order) and bring back rows the newer resume re-did."""
    write_segment(tmp_path, "", range(10))
    write_segment(tmp_path, "resume-step2", range(2, 10))
    write_segment(tmp_path, "resume-step6", range(6, 12))
    log_rows(ResumableCSVLogger(str(tmp_path), resume_step=4), range(4, 8))
    assert sorted(p.name for p in (tmp_path / "csv").iterdir() if p.is_dir()) == ["resume-step2", "resume-step4"]
    assert [r["step"] for r in read_run_rows(tmp_path)] == [str(s) for s in range(8)]


def test_a_fresh_run_in_a_used_folder_starts_a_fresh_log(tmp_path):
    write_segment(tmp_path, "", range(10))
    write_segment(tmp_path, "resume-step6", range(6, 12))
    log_rows(ResumableCSVLogger(str(tmp_path)), range(3))
    assert not (tmp_path / "csv" / "resume-step6").exists()
    assert [r["step"] for r in read_run_rows(tmp_path)] == ["0", "1", "2"]


def test_a_resume_of_a_run_that_logged_nothing_yet_is_its_first_record(tmp_path):
    """Killed before its first flush: the resume's file is csv/metrics.csv, where the report and the run summary look."""
    log_rows(ResumableCSVLogger(str(tmp_path), resume_step=4), range(4, 6))
    assert [r["step"] for r in read_run_rows(tmp_path)] == ["4", "5"]
    assert (tmp_path / "csv" / "metrics.csv").is_file()
