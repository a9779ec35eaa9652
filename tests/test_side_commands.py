"""Bad input to the side commands (pe-extrapolate, pe-verdict, pe-report, pe-generate, pe-bench): one
``error:`` line naming the value and exit code 2, as a bad training config gets; never a traceback, never a run that
exits 0 having scored nothing."""

from __future__ import annotations

import math
import sys

import pytest
import torch
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


@pytest.mark.parametrize("option, value, message", [
    ("--max-batches", "0", "--max-batches: 0 must be >= 1"),  # once: every run's length_extrapolation.json made n/a
    ("--multipliers", "0", "--multipliers: 0 must be >= 1"),
    ("--null-draws", "-1", "--null-draws: -1 must be >= 2"),  # once: a verdict.json with -1 draws, then a crash
    ("--null-draws", "1", "--null-draws: 1 must be >= 2"),
])
def test_pe_report_refuses_numbers_that_would_overwrite_results_with_nothing(option, value, message, tmp_path,
                                                                              monkeypatch, capsys):
    from pe_geometry.cli.report import cli

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "length_extrapolation.json").write_text('{"kept": true}')
    code, err = run_script(cli, [str(tmp_path), option, value], monkeypatch, capsys)
    assert code == 2 and message in one_error_line(err)
    assert [p.name for p in tmp_path.rglob("*")] == ["run", "length_extrapolation.json"]  # nothing written
    assert (tmp_path / "run" / "length_extrapolation.json").read_text() == '{"kept": true}'


def test_pe_report_refuses_a_corrupt_pretrained_json_or_an_out_under_a_file(tmp_path, monkeypatch, capsys):
    from pe_geometry.cli.report import cli

    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "a_file").write_text("kept")
    code, err = run_script(cli, [str(tmp_path), "--pretrained-json", str(tmp_path / "bad.json")], monkeypatch, capsys)
    assert code == 2 and f"{tmp_path / 'bad.json'} is not a readable JSON file (JSONDecodeError" in one_error_line(err)
    code, err = run_script(cli, [str(tmp_path), "--out", str(tmp_path / "a_file" / "report")], monkeypatch, capsys)
    assert code == 2 and one_error_line(err).endswith(f"cannot be a folder: {tmp_path / 'a_file'} is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "bad.json"]  # nothing written


def test_pe_report_on_runs_that_logged_no_row_exits_2_and_writes_no_report(tmp_path, monkeypatch, capsys):
    """A run killed before its first logged step (metrics.csv with its header only) made a report of nothing, exit 0."""
    from pe_geometry.cli.report import cli

    run = tmp_path / "run"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text("step,train/loss\n")
    (run / "config.yaml").write_text("model:\n  _target_: pe_geometry.model.DecoderLM\n"
                                     "pe:\n  _target_: pe_geometry.model.RotaryPE\nseed: 0\n")
    code, err = run_script(cli, [str(tmp_path), "--no-pretrained"], monkeypatch, capsys)
    assert code == 2 and one_error_line(err).startswith(f"error: no logged rows under {tmp_path}: every run's metrics.csv")
    assert not (tmp_path / "report").exists()


def test_pe_report_on_a_missing_or_empty_folder_exits_2(tmp_path, monkeypatch, capsys):
    from pe_geometry.cli.report import cli

    for folder in (tmp_path / "missing", tmp_path):
        code, err = run_script(cli, [str(folder), "--no-pretrained"], monkeypatch, capsys)
        assert code == 2 and one_error_line(err) == f"error: no runs under {folder} (a run has config.yaml and csv/metrics.csv)"


def test_pe_bench_extrapolation_on_an_empty_folder_exits_2(tmp_path, monkeypatch, capsys):
    """The console script's function, run in this process (``pe-bench extrapolation`` less the seconds of a new
    interpreter importing torch): the exit code and the stderr line are its console wrapper's."""
    from pe_geometry.cli.bench import cli

    code, err = run_script(cli, ["extrapolation", str(tmp_path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2
    assert one_error_line(err).startswith("error: no run with checkpoints/last.ckpt under")
    assert not (tmp_path / "out").exists()


def fake_run(run, task: bool):
    """A run folder as the torch-free checks see it: config.yaml and an (empty, never read) checkpoints/last.ckpt."""
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    module = "task_datamodule.TaskDataModule" if task else "datamodule.TextDataModule"
    (run / "config.yaml").write_text(f"data:\n  _target_: pe_geometry.data.{module}\n")
    return run


@pytest.mark.parametrize("given", ["folder", "checkpoint"])
def test_pe_extrapolate_refuses_a_task_run_before_loading_it(given, tmp_path, monkeypatch, capsys):
    """A data=task run's loss on longer text (its stream of examples) was scored and written with exit 0."""
    from pe_geometry.cli.extrapolate import cli

    run = fake_run(tmp_path / "0_decoder-rope-s0", task=True)
    path = run if given == "folder" else run / "checkpoints" / "last.ckpt"
    code, err = run_script(cli, [str(path)], monkeypatch, capsys)
    assert code == 2 and one_error_line(err).startswith(f"error: {path} was trained on a task (data=task): ")
    assert "pe-bench tasks" in one_error_line(err)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]  # no length_extrapolation.json


def test_pe_report_gives_a_task_run_no_text_extrapolation(tmp_path, monkeypatch):
    """pe-report scored a data=task run's stream of examples as text at 2x and 4x and wrote it into the run."""
    import pe_geometry.analysis.readers.extrapolation as reader
    from pe_geometry.analysis.readers.runs import Run
    from pe_geometry.analysis.report.build import run_extrapolation

    evaluated = []
    monkeypatch.setattr(reader, "evaluate_lengths", lambda path, *args: evaluated.append(path) or {"lengths": {}})
    runs = [Run(fake_run(tmp_path / name, task), "decoder", "rope", 0, {"data": {"_target_": target}}, {})
            for name, task, target in [("task", True, "pe_geometry.data.task_datamodule.TaskDataModule"),
                                       ("text", False, "pe_geometry.data.datamodule.TextDataModule")]]
    runs[0].extrapolation = {"lengths": {"1": {}}}  # one written before: not shown beside the text runs either
    run_extrapolation(runs, [1, 2], 8, compute=True)
    assert evaluated == [tmp_path / "text"] and runs[0].extrapolation is None and runs[1].extrapolation == {"lengths": {}}


UNKNOWN_KEYS = ["tempreture=0.5", "+tempreture=0.5", "++tempreture=0.5"]


@pytest.mark.parametrize("arg", UNKNOWN_KEYS)
def test_pe_generate_names_an_unknown_key_with_or_without_plus_before_hydra_composes(arg, monkeypatch, capsys):
    """``+tempreture=0.5`` reached the sampler (12 s of loading, then this line); without ``+`` it was a list only."""
    from pe_geometry.cli.generate import cli, unknown_option

    line = ("tempreture is not an option of pe-generate; did you mean temperature? (options: ckpt_path, context, device, "
            "max_new_tokens, num_samples, pe, prompt, seed, temperature, top_k, top_p, use_cache)")
    assert unknown_option(["ckpt_path=x", arg]) == line
    code, err = run_script(cli, ["ckpt_path=/nope/last.ckpt", arg], monkeypatch, capsys)
    assert code == 2 and one_error_line(err) == f"error: {line}"


@pytest.mark.parametrize("arg", ["pe.scaling=yarn", "+pe.scaling_factor=4", "hydra.run.dir=x", "~seed", "prompt=a=b",
                                 "temperature=0"])
def test_pe_generate_lets_its_own_keys_through(arg):
    from pe_geometry.cli.generate import unknown_option

    assert unknown_option(["ckpt_path=x", arg]) is None


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


def test_pe_generate_refuses_a_key_it_does_not_have_naming_the_closest():
    """``+tempreture=0.5`` (a typo Hydra's + adds) sampled at the default temperature without a word."""
    from pe_geometry.cli.generate import CONFIG_PATH, GenerateError, check_keys

    cfg = OmegaConf.load(CONFIG_PATH)
    check_keys(cfg)  # every key of its own file passes
    cfg.tempreture = 0.5
    with pytest.raises(GenerateError) as err:
        check_keys(cfg)
    assert str(err.value).startswith("tempreture is not an option of pe-generate; did you mean temperature? (options: ")


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



def test_a_run_folder_name_too_long_for_the_file_system_is_one_line_before_hydra_creates_it(tmp_path):
    """hydra.run.dir of 300 characters: Hydra's mkdir raised OSError (File name too long) as a traceback."""
    from pe_geometry.cli.train import unusable_run_dir

    problem = unusable_run_dir([f"hydra.run.dir={tmp_path / ('a' * 300)}"])
    assert problem.startswith("hydra.run.dir=") and "(" in problem and "characters)" in problem
    assert problem.endswith("cannot be created: a folder name of 300 bytes, over this file system's 255")
    deep = "/".join(["b" * 200] * 25)  # every name fits, the whole path does not
    assert "a path of" in unusable_run_dir(["-m", f"hydra.sweep.dir={tmp_path / deep}"])
    assert unusable_run_dir([f"hydra.run.dir={tmp_path / 'fine'}"]) is None


def test_a_corpus_path_too_long_for_the_file_system_is_a_corpus_error_naming_it_shortened(tmp_path):
    from pe_geometry.data.corpus import CorpusError, TextFilesCorpus

    corpus = TextFilesCorpus(train_files=[str(tmp_path / ("c" * 5000))])
    with pytest.raises(CorpusError) as err:
        corpus.splits()
    message = str(err.value)
    assert message.startswith("corpus file(s) cannot be read: ") and "File name too long" in message
    assert len(message) < 300 and "characters)" in message
    with pytest.raises(CorpusError, match=r"corpus file\(s\) not found: \["):
        TextFilesCorpus(train_files=[str(tmp_path / "missing.txt")]).splits()


@pytest.mark.parametrize("scaling, factor, warned", [("llama3", 1.0, True), ("linear", 1.0, True), ("llama3", 4.0, False),
                                                     ("none", 1.0, False)])
def test_pe_generate_says_when_a_rope_scaling_changes_nothing(scaling, factor, warned):
    """pe.scaling=llama3 alone (factor 1) generated RoPE's own text without a word (issue 53 item 7, pe-generate)."""
    from pe_geometry.cli.generate import unscaled_line
    from pe_geometry.model import RotaryPE

    pe = RotaryPE(d_model=16, n_heads=2, scaling=scaling, scaling_factor=factor, training_length=32)
    line = unscaled_line(torch.nn.Sequential(pe))
    assert (line is not None) is warned
    if warned:
        assert line.startswith(f"warning: pe.scaling={scaling} at pe.scaling_factor=1 changes no frequency")


# Each is refused before torch loads (in a fraction of a second, not the 3-12 s of importing torch and Lightning on a
# loaded machine): (console script's module, its argv); {d} is a folder holding a fake task run and a file.
REFUSED_WITHOUT_TORCH = [
    ("bench", ["tasks", "{d}", "--out", "{d}/out", "--depth-bins", "0"]),
    ("bench", ["tasks", "{d}", "--out", "{d}/out", "--seed", "-1"]),
    ("bench", ["tasks", "{d}", "--out", "{d}/a_file/out"]),
    ("bench", ["tasks", "{d}", "--out", "{d}/out", "--cache", "{d}/a_file/cache"]),
    ("bench", ["tasks", "{d}/text", "--out", "{d}/out"]),
    ("bench", ["extrapolation", "{d}", "--out", "{d}/out", "--multipliers", "1", "-2"]),
    ("bench", ["extrapolation", "{d}", "--out", "{d}/out", "--mask-draws", "0"]),
    ("bench", ["extrapolation", "{d}", "--out", "{d}/out", "--target-len", "0"]),
    ("bench", ["extrapolation", "{d}", "--out", "{d}/out", "--scalings", "bogus"]),
    ("bench", ["extrapolation", "{d}/task", "--out", "{d}/out"]),
    ("bench", ["extrapolation", "{d}/none", "--out", "{d}/out"]),
    ("extrapolate", ["{d}/task"]),
    ("extrapolate", ["{d}/text", "--multipliers", "0"]),
    ("report", ["{d}", "--multipliers", "0"]),
    ("report", ["{d}", "--null-draws", "0"]),
    ("report", ["{d}", "--pretrained-json", "{d}/a_file"]),
    ("report", ["{d}", "--out", "{d}/a_file/report"]),
    ("report", ["{d}/none"]),  # no run
    ("report", ["{d}/header_only"]),  # a run that logged no row
    ("generate", ["ckpt_path={d}/task", "+tempreture=0.5"]),
    ("generate", ["ckpt_path={d}/task", "tempreture=0.5"]),
]


@pytest.mark.slow  # a fresh interpreter, so that torch is not loaded already
def test_bad_input_to_the_side_commands_is_refused_before_torch_loads(tmp_path):
    import json
    import subprocess

    fake_run(tmp_path / "task", task=True)
    fake_run(tmp_path / "text", task=False)
    (tmp_path / "none").mkdir()
    (tmp_path / "a_file").write_text("kept")
    (tmp_path / "header_only" / "run" / "csv").mkdir(parents=True)
    (tmp_path / "header_only" / "run" / "csv" / "metrics.csv").write_text("step,train/loss\n")
    (tmp_path / "header_only" / "run" / "config.yaml").write_text("seed: 0\n")
    cases = [(module, [a.format(d=tmp_path) for a in argv]) for module, argv in REFUSED_WITHOUT_TORCH]
    script = f"""
import contextlib, importlib, io, json, sys
seen = []
for module, argv in {cases!r}:
    sys.argv = ["prog", *argv]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        try:
            importlib.import_module("pe_geometry.cli." + module).cli()
            code = 0
        except SystemExit as stopped:
            code = stopped.code
    seen.append([module, argv, code, err.getvalue().strip().splitlines()[-1:], "torch" in sys.modules])
print(json.dumps(seen))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    for module, argv, code, last, torch_loaded in json.loads(result.stdout):
        assert code == 2 and last and "error:" in last[0], (module, argv, code, last)
        assert not torch_loaded, (module, argv, "refused only after torch loaded")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "header_only", "none", "task", "text"]  # nothing written
    assert sorted(p.name for p in (tmp_path / "header_only" / "run").iterdir()) == ["config.yaml", "csv"]
