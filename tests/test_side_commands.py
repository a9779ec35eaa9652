"""Bad input to the side commands (pe-extrapolate, pe-verdict, pe-report, pe-generate, the extrapolation script): one
``error:`` line naming the value and exit code 2, as a bad training config gets; never a traceback, never a run that
exits 0 having scored nothing."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf


def run_script(script, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["prog", *argv])
    with pytest.raises(SystemExit) as stopped:
        script()
    err = capsys.readouterr().err
    return stopped.value.code, err


def one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    assert lines and "Traceback" not in err, err
    return lines[-1]


def test_pe_extrapolate_refuses_a_missing_run_and_lengths_that_score_nothing(tmp_path, monkeypatch, capsys):
    from pe_geometry.cli.extrapolate import cli

    code, err = run_script(cli, ["/nonexistent/run"], monkeypatch, capsys)
    assert code == 2 and "no such run folder or checkpoint: /nonexistent/run" in one_error_line(err)
    code, err = run_script(cli, [str(tmp_path), "--multipliers", "0"], monkeypatch, capsys)
    assert code == 2 and "--multipliers: 0 must be >= 1" in one_error_line(err)
    code, err = run_script(cli, [str(tmp_path), "--max-batches", "0"], monkeypatch, capsys)
    assert code == 2 and "--max-batches: 0 must be >= 1" in one_error_line(err)
    code, err = run_script(cli, [str(tmp_path)], monkeypatch, capsys)  # a folder that holds no run: the loader's line
    assert code == 2 and one_error_line(err) == f"error: {tmp_path}: no checkpoint {tmp_path}/checkpoints/last.ckpt"


@pytest.mark.parametrize("content", ["{not json", "plain text\n", "[1, 2]", "\udcff"])
def test_pe_verdict_refuses_a_corrupt_summary_or_a_file_that_is_not_one(tmp_path, monkeypatch, capsys, content):
    from pe_geometry.cli.verdict import cli

    (tmp_path / "summary.json").write_text(content, errors="surrogateescape")
    code, err = run_script(cli, [str(tmp_path)], monkeypatch, capsys)
    line = one_error_line(err)
    assert code == 2 and str(tmp_path / "summary.json") in line
    assert "not a summary.json pe-report wrote" in line or "has no verdict" in line


def test_pe_report_on_a_missing_or_empty_folder_exits_2(tmp_path, monkeypatch, capsys):
    from pe_geometry.cli.report import cli

    for folder in (tmp_path / "missing", tmp_path):
        code, err = run_script(cli, [str(folder), "--no-pretrained"], monkeypatch, capsys)
        assert code == 2 and one_error_line(err) == f"error: no runs under {folder} (a run has config.yaml and csv/metrics.csv)"


def test_the_extrapolation_script_on_an_empty_folder_exits_2(tmp_path):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "experiments" / "extrapolation.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: no run with checkpoints/last.ckpt under")


GENERATE_BAD = [
    ("temperature", math.nan, "temperature=nan must be a finite number"),
    ("temperature", math.inf, "temperature=inf must be a finite number"),
    ("top_p", math.nan, "top_p=nan must be a finite number"),
    ("top_k", 2.5, "top_k=2.5 must be an integer >= 0 or null"),
    ("use_cache", "maybe", "use_cache='maybe'; valid: true, false"),
    ("seed", -1, "seed=-1 must be >= 0"),
    ("seed", "x", "seed='x' must be an integer"),
    ("max_new_tokens", 1.5, "max_new_tokens=1.5 must be an integer"),
]


@pytest.mark.parametrize("key, value, message", GENERATE_BAD, ids=[f"{k}={v}" for k, v, _ in GENERATE_BAD])
def test_pe_generate_refuses_values_that_would_sample_nonsense_before_loading_anything(key, value, message):
    from pe_geometry.cli.generate import CONFIG_PATH, GenerateError, check_options

    cfg = OmegaConf.load(CONFIG_PATH)
    cfg.ckpt_path = "unused"
    check_options(cfg)  # the defaults pass
    cfg[key] = value
    with pytest.raises(GenerateError) as err:
        check_options(cfg)
    assert str(err.value) == message

