"""pe-bench (cli/bench.py): one console script, a subcommand per benchmark (pe_geometry/benchmarks/), each with the
options its script in experiments/ took; bad input is one ``error:`` line and exit code 2, before any run is read."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pe_geometry.cli.bench import BENCHMARKS, cli, parser

# every option each benchmark takes (its script in experiments/ took the same, less pretrained's --trained*)
OPTIONS = {
    "extrapolation": {"--include-unfinished", "--out", "--multipliers", "--target-len", "--scalings", "--mask-draws",
                      "--cache", "--keep", "--relabel"},
    "tasks": {"--include-unfinished", "--out", "--multipliers", "--examples", "--seed", "--bootstrap", "--depth-bins",
              "--cache", "--quick", "--contrast", "--contrast-at", "--plan", "--contrast-tasks"},
    "pretrained": {"--out", "--models", "--quick", "--force", "--no-band", "--presets", "--trained", "--trained-geometry"},
    "training-length": {"--root", "--plan", "--jobs", "--out", "--set"},
    "generation-context": {"--times", "--samples", "--seed", "--prompt", "--json"},
    "readers": {"--out", "--no-defaults"},
}


def run_cli(argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["pe-bench", *argv])
    with pytest.raises(SystemExit) as stopped:
        cli()
    return stopped.value.code, capsys.readouterr().err


def error_line(err: str) -> str:
    """The last stderr line, which must be the only ``error:`` line (argparse prints its usage above it)."""
    lines = [line for line in err.strip().splitlines() if line]
    assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, err
    return lines[-1]


def test_every_benchmark_has_its_options():
    _, subparsers = parser()
    assert set(subparsers) == set(BENCHMARKS) == set(OPTIONS)
    for name, sub in subparsers.items():
        taken = {o for action in sub._actions for o in action.option_strings if o.startswith("--")} - {"--help"}
        assert taken == OPTIONS[name], name


def test_the_benchmarks_import_nothing_from_experiments():
    package = Path(importlib.import_module("pe_geometry.benchmarks").__file__).parent
    for path in [*package.glob("*.py"), Path(importlib.import_module("pe_geometry.cli.bench").__file__)]:
        text = path.read_text()
        assert "experiments" not in [line.split()[1].split(".")[0] for line in text.splitlines()
                                     if line.lstrip().startswith(("import ", "from "))], path
        assert "sys.path" not in text, path


@pytest.mark.parametrize("argv, message", [
    (["tasks", "x", "--out", "y", "--examples", "0"], "pe-bench tasks: error: argument --examples: 0 must be >= 1"),
    (["tasks", "x", "--out", "y", "--multipliers", "1", "0"], "argument --multipliers: 0 must be >= 1"),
    (["tasks", "x", "--out", "y", "--depth-bins", "0"], "argument --depth-bins: 0 must be >= 1"),  # ran, exit 0
    (["tasks", "x", "--out", "y", "--depth-bins", "-2"], "argument --depth-bins: -2 must be >= 1"),  # ran, exit 0
    (["tasks", "x", "--out", "y", "--seed", "-1"], "argument --seed: -1 must be >= 0"),  # numpy's traceback
    (["tasks", "x", "--out", "y", "--bootstrap", "0"], "argument --bootstrap: 0 must be >= 1"),
    (["extrapolation", "x", "--out", "y", "--multipliers", "0"], "argument --multipliers: 0 must be >= 1"),  # traceback
    (["extrapolation", "x", "--out", "y", "--multipliers", "1", "-2"], "argument --multipliers: -2 must be >= 1"),
    (["extrapolation", "x", "--out", "y", "--mask-draws", "0"], "argument --mask-draws: 0 must be >= 1"),  # traceback
    (["extrapolation", "x", "--out", "y", "--target-len", "0"], "argument --target-len: 0 must be >= 1"),  # ran, exit 0
    (["extrapolation", "x", "--out", "y", "--scalings", "bogus"],
     "argument --scalings: 'bogus' is not one of linear, ntk, dynamic_ntk, yarn, llama3"),  # scored every run first
    (["tasks", "x", "--out", "y", "--contrast-tasks", "sorting"], "argument --contrast-tasks: invalid choice: 'sorting'"),
    # these three were found after every run had been scored
    (["tasks", "x", "--out", "y", "--contrast", "a", "b", "--contrast-at", "3"],
     "pe-bench tasks: error: --contrast-at 3 is not one of the multipliers [1, 2, 4, 8, 16]"),
    (["tasks", "x", "--out", "y", "--plan", "p.yaml", "--contrast", "a", "b"], "--plan names its own contrasts: drop --contrast"),
    (["tasks", "x", "--out", "y", "--plan", "missing.yaml"], "pe-bench tasks: error: --plan missing.yaml: no such file"),
    (["extrapolation", "x", "--out", "y", "--relabel", "a=b"], "pe-bench extrapolation: error: --relabel takes OLD=NEW pairs, with --keep"),
    (["extrapolation", "x", "--out", "y", "--multipliers", "two"], "argument --multipliers: 'two' is not an integer"),
    (["pretrained"], "the following arguments are required: --out"),
    (["training-length", "fit"], "argument step: invalid choice: 'fit'"),
    (["sorting"], "pe-bench: error: argument BENCHMARK: invalid choice: 'sorting'"),
    ([], "pe-bench: error: the following arguments are required: BENCHMARK"),
])
def test_a_bad_value_is_one_error_line_and_exit_code_2(argv, message, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2 and message in error_line(err)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("benchmark", ["tasks", "extrapolation"])
@pytest.mark.parametrize("option", ["--out", "--cache"])
def test_an_output_folder_under_a_file_is_one_error_line_before_any_run_is_read(benchmark, option, monkeypatch, capsys,
                                                                                 tmp_path):
    (tmp_path / "a_file").write_text("kept")
    argv = [benchmark, str(tmp_path), "--out", str(tmp_path / "out")]
    argv += [option, str(tmp_path / "a_file" / "sub")] if option == "--cache" else []
    if option == "--out":
        argv[3] = str(tmp_path / "a_file" / "sub")
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2 and error_line(err).endswith(f"cannot be a folder: {tmp_path / 'a_file'} is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # was NotADirectoryError after the scoring


def test_the_text_benchmark_refuses_task_runs_before_scoring_any(monkeypatch, capsys, tmp_path):
    """A data=task run's loss on longer text is not what it learned: it was scored beside text runs with exit 0."""
    import pe_geometry.benchmarks.runs as runs

    run = fake_run(tmp_path / "0_decoder-rope-s0", task=True)
    monkeypatch.setattr(runs, "checkpoint_ending", lambda path: pytest.fail("a checkpoint was read"))
    code, err = run_cli(["extrapolation", str(tmp_path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and error_line(err).startswith(f"error: {run} was trained on a task (data=task)")
    assert "pe-bench tasks" in error_line(err) and not (tmp_path / "out").exists()


def test_the_task_benchmark_refuses_text_runs_before_scoring_any(monkeypatch, capsys, tmp_path):
    """A text run among task runs was refused only at its turn, after the task runs before it had been scored."""
    task, text = fake_run(tmp_path / "0_decoder-rope-s0", task=True), fake_run(tmp_path / "1_decoder-rope-s0", task=False)
    import pe_geometry.benchmarks.runs as runs

    monkeypatch.setattr(runs, "checkpoint_ending", lambda path: pytest.fail("a checkpoint was read"))
    code, err = run_cli(["tasks", str(task.parent), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and error_line(err) == (f"error: {text} was not trained with data=task: pe-bench tasks reads task "
                                             "runs only; pe-bench extrapolation scores a text run (1 such run(s))")
    assert not (tmp_path / "out").exists()


def fake_run(run: Path, task: bool) -> Path:
    """A run folder as the torch-free checks see it: config.yaml and an (empty) checkpoints/last.ckpt."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    module = "task_datamodule.TaskDataModule" if task else "datamodule.TextDataModule"
    (run / "config.yaml").write_text(f"data:\n  _target_: pe_geometry.data.{module}\n")
    return run


def test_no_runs_or_no_plan_is_one_error_line_before_anything_is_written(monkeypatch, capsys, tmp_path):
    code, err = run_cli(["tasks", str(tmp_path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and error_line(err).startswith("error: no run with checkpoints/last.ckpt under")
    monkeypatch.chdir(tmp_path)  # no experiments/plans/ here: a user's folder
    code, err = run_cli(["training-length", "score"], monkeypatch, capsys)
    assert code == 2 and error_line(err).startswith("error: --plan experiments/plans/training_length.yaml: no such file")
    assert not (tmp_path / "out").exists()


def test_a_benchmark_without_its_extra_is_one_error_line_before_any_run_is_read(monkeypatch, capsys, tmp_path):
    """pe-bench extrapolation in an install without matplotlib (the report extra): refused before scoring for hours."""
    # Lightning first, as in such an install: torchmetrics decides at import whether matplotlib exists (find_spec), and
    # here it does, so importing Lightning after matplotlib is blocked below would fail inside torchmetrics instead
    import lightning  # noqa: F401

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    # imported anew, as in a process that has never had matplotlib
    monkeypatch.delitem(sys.modules, "pe_geometry.benchmarks.extrapolation_report", raising=False)
    fake_run(tmp_path / "0_decoder-rope-s0", task=False)  # passes the torch-free checks; its checkpoint is never read
    code, err = run_cli(["extrapolation", str(tmp_path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    line = error_line(err)
    assert code == 2 and line.startswith("error: pe-bench extrapolation's figures needs matplotlib")
    assert line.endswith("pip install 'pe-geometry[report]'")


def pe_bench() -> str:
    """The console script pip installed beside this interpreter."""
    script = Path(sys.executable).parent / "pe-bench"
    if not script.is_file():
        pytest.skip("pe-bench is not installed beside this Python (pip install -e . installs it)")
    return str(script)


@pytest.mark.slow  # a pe-bench process per benchmark
@pytest.mark.parametrize("benchmark", [None, *BENCHMARKS])
def test_the_console_script_and_every_benchmark_answer_help(benchmark, tmp_path):
    argv = [pe_bench(), *([benchmark] if benchmark else []), "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith(f"usage: pe-bench {benchmark or '[-h] BENCHMARK'}")
    if benchmark is None:
        assert all(name in result.stdout for name in BENCHMARKS)
    else:
        assert all(option in result.stdout for option in OPTIONS[benchmark])


@pytest.mark.slow  # a pe-bench process
def test_the_console_script_refuses_a_bad_value_in_one_error_line(tmp_path):
    result = subprocess.run([pe_bench(), "tasks", str(tmp_path), "--out", str(tmp_path / "out"), "--bootstrap", "0"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert error_line(result.stderr) == "pe-bench tasks: error: argument --bootstrap: 0 must be >= 1"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # trains a tiny run
def test_generation_context_reads_a_tiny_run_and_writes_its_figures(tmp_path, tiny_corpus, cache_dir, capsys):
    """pe-bench generation-context (once experiments/generation_context.py, with no test): both ways of reading, the
    NLL inside and past the training length, and the speeds, printed and written with --json."""
    import json

    from pe_geometry.cli.bench import main
    from pe_geometry.training.pipeline import train
    from tests.conftest import tiny_train_config

    train(tiny_train_config(tmp_path / "a", tiny_corpus, cache_dir, ["trainer.max_steps=3"]))
    figures = main(["generation-context", str(tmp_path / "a" / "run"), "--times", "2", "--samples", "2",
                    "--json", str(tmp_path / "figures.json")])
    assert set(figures) == {"train", "full", "speed"}
    assert all(figures[c]["nll_in_context"] > 0 and figures[c]["nll_past"] > 0 for c in ("train", "full"))
    written = json.loads((tmp_path / "figures.json").read_text())
    assert (written["samples"], written["new_tokens"]) == (2, 2 * written["seq_len"])
    assert "NLL rest" in capsys.readouterr().out
