"""Reliability: a killed run resumes exactly, SIGTERM/Ctrl-C save a checkpoint, a NaN
loss stops cleanly, every run records how it was made, bad inputs are one clear line, DDP works.

Real ``python train.py`` processes where a signal, an exit code or a relaunch is the point (at
most two at a time, one thread each); ``training.pipeline.train`` in-process everywhere else.
The guarantees and the bad-input table are in docs/RELIABILITY.md.
"""

from __future__ import annotations

import copy
import csv
import functools
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from pe_geometry.analysis.readers.runs import read_run_rows
from pe_geometry.data.corpus import CorpusError
from pe_geometry.data.datamodule import EpochShuffleSampler
from pe_geometry.training.pipeline import build_model, train
from pe_geometry.training.resume import read_checkpoint
from pe_geometry.training.task import NonFiniteLossError
from pe_geometry.training.validate import ConfigError
from tests import forkserver
from tests.conftest import CONFIG_DIR, PE_TYPES, ROOT, compose_train_config, fast_loop_covers, tiny_train_config

# A run long enough to interrupt: 34 batches per epoch on the tiny corpus, so 60 steps cross an
# epoch boundary; a checkpoint every 10 steps, validation every 20 (on checkpoint steps, the
# case where Lightning skips the validation after a resume).
STEPS = 60
RUN = [
    "logger=csv", "~callbacks.progress_bar", "trainer.enable_model_summary=false",
    "model.d_model=32", "model.n_heads=4", "model.n_layers=2",
    "data.seq_len=32", "data.batch_size=8", "data.vocab_size=300",
    f"trainer.max_steps={STEPS}", "trainer.val_check_interval=20", "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=10",
    "optimizer.warmup_steps=5",
]
# The geometry recorder (when configured) measures on every checkpoint step, so its columns are
# compared too. It also measures at the resume step itself, which is then a checkpoint step.
HAS_GEOMETRY = bool((OmegaConf.load(CONFIG_DIR / "callbacks" / "default.yaml") or {}).get("geometry"))
GEOMETRY_EVERY_CHECKPOINT = ["callbacks.geometry.every_n_steps=10"] if HAS_GEOMETRY else []
# ThroughputMonitor columns describe the process (wall-clock time, counts since it started), not
# the training, so they cannot repeat across a resume; every other column is compared.
PROCESS_COLUMNS = re.compile(r"/(time|batches|samples|lengths|flops|mfu)$|/device/|_per_sec$")


# -- helpers -------------------------------------------------------------------------------------
def corpus_args(corpus: dict[str, Path]) -> list[str]:
    return [
        "data=text_files",
        f"data.corpus.train_files=[{corpus['train']}]",
        f"data.corpus.val_files=[{corpus['validation']}]",
    ]


def start(run_dir: Path, args: list[str], cache: Path) -> subprocess.Popen:
    """``python train.py <args>`` into ``run_dir``; one thread, so two runs fit the 2 cores side by side."""
    env = {**os.environ, "PE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return forkserver.Popen(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"],
        cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, so a timeout can end DDP's rank 1 too
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args[2:]} did not finish in {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_until(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before {what}:\n{proc.communicate()[1][-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def logged_steps(run: Path, metric: str = "train/loss") -> list[int]:
    """The steps at which a run logged ``metric``, its CSV segments joined as the report reads them."""
    return [int(r["step"]) for r in read_run_rows(run) if r.get(metric)]


def load_ckpt(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def temp_files(*roots: Path) -> list[Path]:
    """Half-written files: our atomic writers' ``.<name>.*.tmp`` and Lightning's ``*.tmp``."""
    return [p for root in roots if root.exists() for p in root.rglob("*.tmp")]


def assert_same_series(resumed: list[dict[str, str]], straight: list[dict[str, str]]) -> None:
    """Row for row (in step order) the same metrics and values (to 1e-6 relative) in every non-process column."""
    columns = {k for k in straight[0] if not PROCESS_COLUMNS.search(k)}
    assert {k for k in resumed[0] if not PROCESS_COLUMNS.search(k)} == columns
    assert any(k.startswith("val/") for k in columns) and "train/loss" in columns

    def key(row):  # which metrics a row carries: several rows share a step
        return int(row["step"]), sorted(k for k in columns if row[k] and k not in ("step", "epoch"))

    # In step order (a callback may log at step k + 1 while step k's rows are still to come),
    # leaving out rows that carry process columns only.
    resumed, straight = (sorted((r for r in rows if key(r)[1]), key=lambda r: int(r["step"])) for rows in (resumed, straight))
    assert [key(r) for r in resumed] == [key(r) for r in straight], "rows missing or duplicated"
    for a, b in zip(resumed, straight):
        for k in sorted(columns):
            if a[k] != b[k]:
                assert math.isclose(float(a[k]), float(b[k]), rel_tol=1e-6), f"step {b['step']}: {k} = {a[k]} resumed, {b[k]} straight"


# -- 1. kill -9, then resume ---------------------------------------------------------------------
@pytest.mark.slow  # runs train.py in a subprocess
@pytest.mark.parametrize("model", ["encoder", "decoder"])
def test_sigkill_then_resume_matches_the_uninterrupted_run(model, tmp_path, tiny_corpus, cache_dir):
    args = [*corpus_args(tiny_corpus), *RUN, *GEOMETRY_EVERY_CHECKPOINT, f"model={model}"]
    straight = start(tmp_path / "straight", args, cache_dir)
    killed = start(tmp_path / "killed", args, cache_dir)
    run = tmp_path / "killed"
    # Kill between checkpoints: a few steps after step 20's, so the resume re-does logged steps.
    wait_until(lambda: max(logged_steps(run), default=-1) >= 24, killed, "step 24")
    killed.send_signal(signal.SIGKILL)
    assert finish(killed).returncode == -signal.SIGKILL  # really killed: no handler ran
    resume_step = load_ckpt(run / "checkpoints" / "last.ckpt")["global_step"]
    assert 20 <= resume_step < STEPS
    assert resume_step - 1 in logged_steps(run), (
        "killed inside the instant between a checkpoint and its step's log row (see docs/RELIABILITY.md)"
    )

    resumed = finish(start(tmp_path / "resumed", [*args, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"], cache_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    done = finish(straight)
    assert done.returncode == 0, done.stderr[-3000:]

    assert not (tmp_path / "resumed" / "checkpoints").exists()  # it continued the killed run's directory
    straight_rows = read_run_rows(tmp_path / "straight")
    assert logged_steps(tmp_path / "straight") == list(range(STEPS))
    assert_same_series(read_run_rows(run), straight_rows)
    a, b = load_ckpt(run / "checkpoints" / "last.ckpt"), load_ckpt(tmp_path / "straight" / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] == STEPS
    for name, tensor in b["state_dict"].items():
        assert torch.equal(a["state_dict"][name], tensor), f"{name} differs after the resume"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        p.name for p in (tmp_path / "straight" / "checkpoints").iterdir()
    )
    assert not temp_files(tmp_path)


# -- 2. SIGTERM / Ctrl-C -------------------------------------------------------------------------
def assert_stopped_with_a_resumable_last_ckpt(result: subprocess.CompletedProcess, sig: int, run: Path, tmp_path: Path) -> None:
    """A run stopped by ``sig``: exit code 128 + sig, one error line with the resume command, and last.ckpt saved at
    the step the log names, which a resume accepts."""
    assert result.returncode == 128 + sig, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    name = "SIGTERM" if sig == signal.SIGTERM else "SIGINT (Ctrl-C)"
    assert error_lines(result.stderr) == [f"error: stopped by {name}; resume with ckpt_path={run}/checkpoints/last.ckpt"]
    interrupted = int(re.search(r"interrupted at step (\d+)", (run / "train.log").read_text()).group(1))
    periodic = max(int(p.stem[4:]) for p in (run / "checkpoints").glob("step*.ckpt"))
    last = load_ckpt(run / "checkpoints" / "last.ckpt")
    assert last["global_step"] == interrupted >= periodic and interrupted > 10
    assert {"state_dict", "optimizer_states", "loops", "rng_states"} <= set(last)
    assert read_checkpoint(str(run / "checkpoints" / "last.ckpt"), tmp_path / "new")[:3] == (
        run / "checkpoints" / "last.ckpt", run, interrupted  # a resume accepts it and continues this run
    )
    assert not temp_files(run)


@pytest.mark.slow  # runs train.py in a subprocess
@pytest.mark.parametrize("sig,exit_code", [(signal.SIGTERM, 143)], ids=["SIGTERM"])  # Ctrl-C: test 10 (same checks)
def test_interrupt_saves_last_ckpt_at_the_interrupted_step(sig, exit_code, tmp_path, tiny_corpus, cache_dir):
    """With the geometry recorder on (test 10, which resumes too, has it off)."""
    run = tmp_path / "run"
    proc = start(run, [*corpus_args(tiny_corpus), *RUN, "trainer.max_steps=5000"], cache_dir)
    wait_until(lambda: max(logged_steps(run), default=-1) >= 14, proc, "step 14")
    proc.send_signal(sig)
    result = finish(proc, timeout=120)
    assert result.returncode == exit_code
    assert_stopped_with_a_resumable_last_ckpt(result, sig, run, tmp_path)


# -- 3. NaN / inf loss ---------------------------------------------------------------------------
def test_nan_loss_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    from pe_geometry.model.transformer import LanguageModel

    calls = {"train": 0}
    original = LanguageModel.cross_entropy

    def nan_from_step_5(self, logits, targets):
        loss = original(self, logits, targets)
        if self.training and logits.device.type != "meta":  # (the FLOP count runs it on a meta copy)
            calls["train"] += 1  # the k-th training call is global step k - 1
            if calls["train"] > 5:
                return loss * float("nan")
        return loss

    monkeypatch.setattr(LanguageModel, "cross_entropy", nan_from_step_5)
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=10", "trainer.val_check_interval=10"])
    with pytest.raises(NonFiniteLossError, match=r"^training loss is nan at step 5; stopping") as err:
        train(cfg)
    assert "\n" not in str(err.value)
    ckpts = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step000002.ckpt", "step000004.ckpt"]
    last = load_ckpt(ckpts / "last.ckpt")
    assert last["global_step"] == 4  # not overwritten at or after the NaN step
    assert all(torch.isfinite(t).all() for t in last["state_dict"].values())
    assert logged_steps(tmp_path / "run") == [0, 1, 2, 3, 4]
    assert not temp_files(tmp_path)


# -- 4. run metadata -----------------------------------------------------------------------------
def test_run_directory_records_the_resolved_config_versions_and_commit(tmp_path, tiny_corpus, cache_dir):
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=2", "pe=rope"])
    train(cfg)
    run = tmp_path / "run"
    saved = (run / "config.yaml").read_text()
    assert "${" not in saved  # resolved: run_name, paths, seeds are values
    assert OmegaConf.to_container(OmegaConf.create(saved)) == OmegaConf.to_container(cfg, resolve=True)
    assert OmegaConf.create(saved).run_name == "decoder-rope-s0"
    info = json.loads((run / "run_info.json").read_text())
    for package in ("torch", "lightning", "hydra-core", "numpy"):
        assert info["packages"][package] == metadata.version(package)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if head:
        assert info["git_commit"] == head
    assert info["python"] == ".".join(map(str, sys.version_info[:3]))
    assert info["vocab_size"] == 300 and info["tokens"]["train"] > 0 and info["n_parameters"] > 0


# -- 5. bad inputs, in-process: one line, nothing written ----------------------------------------
@pytest.fixture(scope="module")
def real_checkpoint(tmp_path_factory, tiny_corpus, cache_dir) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    train(tiny_train_config(root, tiny_corpus, cache_dir, ["trainer.max_steps=2"]))
    return root / "run" / "checkpoints" / "last.ckpt"


def _text_files(tmp_path, train_text, val_text):
    (tmp_path / "train.txt").write_text(train_text)
    (tmp_path / "val.txt").write_text(val_text)
    return {"train": tmp_path / "train.txt", "validation": tmp_path / "val.txt"}


BAD_INPUTS = {
    "garbage_checkpoint": (ConfigError, r"ckpt_path=.*bad.ckpt is not a readable Lightning checkpoint \(\w+: "),
    "truncated_checkpoint": (ConfigError, r"ckpt_path=.*cut.ckpt is not a readable Lightning checkpoint"),
    "missing_checkpoint": (ConfigError, r"ckpt_path=.*nope.ckpt: no checkpoint file at"),
    "last_without_checkpoint": (ConfigError, r"ckpt_path=last: no checkpoint file at .*run/checkpoints/last.ckpt"),
    "output_dir_under_a_file": (ConfigError, r"paths.output_dir=.*file.txt/run is not writable \(Not a directory\)"),
    "char_vocab_below_specials": (ConfigError, r"data.vocab_size=2 is too small for the char tokenizer: it needs at least 4"),
    "empty_train_file": (CorpusError, r"the corpus is empty: its train split has no text"),
    "whitespace_validation_file": (CorpusError, r"the corpus is empty: its validation split has no text"),
    "tiny_corpus": (CorpusError, r"the corpus is too small: its validation split has \d+ tokens, data.seq_len=16 needs at least 17"),
    "max_steps_negative": (ConfigError, r"trainer.max_steps=-1 must be a positive number of steps"),
    "lr_zero": (ConfigError, r"optimizer.lr=0.0 must be a number > 0"),
    "lr_nan": (ConfigError, r"optimizer.lr=nan must be a number > 0"),
    "seed_negative": (ConfigError, r"seed=-1 must be an integer in \[0, 4294967295\]"),
    "seed_expression": (ConfigError, r"seed=2\*\*40 must be an integer in \[0, 4294967295\]"),
    "seed_too_large": (ConfigError, r"seed=1099511627776 must be an integer in \[0, 4294967295\]"),
    "seq_len_not_a_number": (ConfigError, r"data.seq_len=abc must be an integer"),
    "val_check_interval_zero": (ConfigError, r"trainer.val_check_interval=0 must be a positive number of steps or a fraction"),
    "accumulate_zero": (ConfigError, r"trainer.accumulate_grad_batches=0 must be an integer >= 1"),
    "geometry_n_tokens_zero": (ConfigError, r"callbacks.geometry.n_tokens=0 must be a positive integer"),
    "max_steps_null": (ConfigError, r"trainer.max_steps=null must be a positive number of steps"),
    "val_fraction_above_one": (ConfigError, r"data.corpus.val_fraction=1.5 must be a fraction in \(0, 1\)"),
}
# Cases that are a single override (the others build files or checkpoints first).
BAD_OVERRIDES = {
    "lr_nan": ["optimizer.lr=nan"], "seed_negative": ["seed=-1"], "seed_expression": ["seed=2**40"],
    "seed_too_large": [f"seed={2**40}"], "seq_len_not_a_number": ["data.seq_len=abc"],
    "val_check_interval_zero": ["trainer.val_check_interval=0"], "accumulate_zero": ["trainer.accumulate_grad_batches=0"],
    "geometry_n_tokens_zero": ["callbacks.geometry.n_tokens=0"], "max_steps_null": ["trainer.max_steps=null"],
    "val_fraction_above_one": ["data.corpus.val_files=null", "data.corpus.val_fraction=1.5"],
}
if not HAS_GEOMETRY:
    del BAD_INPUTS["geometry_n_tokens_zero"], BAD_OVERRIDES["geometry_n_tokens_zero"]


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_line_and_writes_nothing(case, tmp_path, tiny_corpus, real_checkpoint):
    corpus, extra = tiny_corpus, []
    if case == "garbage_checkpoint":
        # fixed bytes (random ones made the test flaky): these make torch's unpickler raise a message over two lines
        (tmp_path / "bad.ckpt").write_bytes(random.Random(103).randbytes(4096))
        extra = [f"ckpt_path={tmp_path / 'bad.ckpt'}"]
    elif case == "truncated_checkpoint":
        data = real_checkpoint.read_bytes()
        (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
        extra = [f"ckpt_path={tmp_path / 'cut.ckpt'}"]
    elif case == "missing_checkpoint":
        extra = [f"ckpt_path={tmp_path / 'nope.ckpt'}"]
    elif case == "last_without_checkpoint":
        extra = ["ckpt_path=last"]
    elif case == "char_vocab_below_specials":
        extra = ["data.tokenizer=char", "data.vocab_size=2"]
    elif case == "empty_train_file":
        corpus = _text_files(tmp_path, "", "some validation text " * 50)
    elif case == "whitespace_validation_file":
        corpus = _text_files(tmp_path, "some training text " * 50, " \n\t\n  ")
    elif case == "tiny_corpus":
        corpus = _text_files(tmp_path, "to be or not to be " * 200, "tiny")
    elif case == "max_steps_negative":
        extra = ["trainer.max_steps=-1"]
    elif case == "lr_zero":
        extra = ["optimizer.lr=0.0"]
    elif case in BAD_OVERRIDES:
        extra = BAD_OVERRIDES[case]
    cache = tmp_path / "cache"
    cfg = tiny_train_config(tmp_path, corpus, cache, extra)
    if case == "output_dir_under_a_file":
        (tmp_path / "file.txt").write_text("a regular file")
        cfg.paths.output_dir = str(tmp_path / "file.txt" / "run")
    error, message = BAD_INPUTS[case]
    with pytest.raises(error, match=message) as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "csv").exists()
    assert not temp_files(tmp_path)


@pytest.mark.parametrize("model", ["decoder", "encoder"])
def test_learned_pe_rejects_a_longer_input_at_eval_time(model, tmp_path):
    cfg = compose_train_config([f"model={model}", "pe=learned", "pe.max_len=16", "data.seq_len=16", "model.d_model=32"], tmp_path)
    net = build_model(cfg, SimpleNamespace(vocab_size=300, mask_token_id=1)).eval()
    with torch.no_grad():
        assert net(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 300)
        with pytest.raises(ValueError, match=r"sequence of 17 tokens is longer than the learned position table \(pe.max_len=16\)"):
            net(torch.zeros(2, 17, dtype=torch.long))


# -- 5b. bad inputs through the CLI: exit code, one ``error:`` line, no traceback ----------------
def _cli_cases(tmp: Path, corpus: dict[str, Path], checkpoint: Path) -> dict[str, tuple[list[str], Path]]:
    """name -> (train.py arguments, cache dir); all run before the first test that reads them."""
    good = [*corpus_args(corpus), *RUN]
    bad_utf8 = tmp / "latin1.txt"
    bad_utf8.write_bytes("Sc\u00e8ne premi\u00e8re. ".encode("latin-1") * 100)
    (tmp / "file.txt").write_text("a regular file")
    data = checkpoint.read_bytes()
    (tmp / "cut.ckpt").write_bytes(data[: len(data) // 3])
    # A cache entry whose token stream is cut short: it must be reported and rebuilt.
    from pe_geometry.data.corpus import TextFilesCorpus
    from pe_geometry.data.datamodule import TextDataModule

    corrupt_cache = tmp / "corrupt-cache"
    files = TextFilesCorpus(train_files=[str(corpus["train"])], val_files=[str(corpus["validation"])])
    dm = TextDataModule(files, vocab_size=300, seq_len=32, batch_size=8, cache_dir=str(corrupt_cache / "data"))
    dm.prepare_data()
    stream = dm.cache_entry / "train.npy"
    stream.write_bytes(stream.read_bytes()[:1000])
    cache = tmp / "cache"
    return {
        "non_utf8_file": ([*good, f"data.corpus.train_files=[{bad_utf8}]"], cache),
        "truncated_checkpoint": ([*good, f"ckpt_path={tmp / 'cut.ckpt'}"], cache),
        "output_dir_under_a_file": ([*good, f"paths.output_dir={tmp / 'file.txt' / 'run'}"], cache),
        "run_dir_under_a_file": ([*good, f"hydra.run.dir={tmp / 'file.txt' / 'run'}"], cache),
        "run_dir_under_a_file_with_a_date": ([*good, f"hydra.run.dir={tmp / 'file.txt'}/${{now:%H-%M-%S}}"], cache),
        "seed_expression": ([*good, "seed=2**40"], cache),
        "nan_loss": ([*good, "optimizer.lr=1e30", "optimizer.warmup_steps=1", "callbacks.checkpoint.every_n_train_steps=1"], cache),
        "corrupt_cache": ([*good, "trainer.max_steps=2"], corrupt_cache),
    }


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory, tiny_corpus, real_checkpoint) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    tmp = tmp_path_factory.mktemp("cli")
    cases = _cli_cases(tmp, tiny_corpus, real_checkpoint)

    def run(name):
        args, cache = cases[name]
        (tmp / name).mkdir()
        # The last hydra.run.dir wins: the run_dir_under_a_file case overrides this one.
        return finish(start(tmp / name / "run", args, cache)), tmp / name / "run"

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cases, pool.map(run, cases)))
    results["_tmp"] = tmp
    return results


CLI_ERRORS = {
    "non_utf8_file": (
        2,
        r"error: .*latin1.txt is not valid UTF-8 \(byte 2: b'\\xe8'\); convert it, or set data.corpus.encoding_errors=replace",
    ),
    "truncated_checkpoint": (2, r"error: ckpt_path=.*cut.ckpt is not a readable Lightning checkpoint"),
    "output_dir_under_a_file": (2, r"error: paths.output_dir=.*file.txt/run is not writable \(Not a directory\)"),
    "run_dir_under_a_file": (2, r"error: hydra.run.dir=.*file.txt/run cannot be created: .*file.txt is a file, not a directory"),
    "run_dir_under_a_file_with_a_date": (2, r"error: hydra.run.dir=.*file.txt/\$\{now:%H-%M-%S\} cannot be created: .*file.txt is a file"),
    "seed_expression": (2, r"error: seed=2\*\*40 must be an integer in \[0, 4294967295\]"),
    "nan_loss": (1, r"error: training loss is (nan|inf) at step \d+; stopping. The last good checkpoint is kept.*"),
}


@pytest.mark.slow  # runs train.py in a subprocess
@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_bad_input_exits_with_one_error_line(case, cli_results):
    result, run = cli_results[case]
    code, message = CLI_ERRORS[case]
    assert result.returncode == code, result.stderr[-3000:]
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and re.match(message, lines[0]), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not temp_files(cli_results["_tmp"])
    if case == "nan_loss":  # a checkpoint every step: the one before the NaN step is last, nothing later
        step = int(re.search(r"at step (\d+)", lines[0]).group(1))
        assert step >= 1
        expected = ["last.ckpt", *(f"step{s:06d}.ckpt" for s in range(1, step + 1))]
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == expected
        assert load_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == step
    else:
        assert not (run / "checkpoints").exists()


@pytest.mark.slow  # runs train.py in a subprocess
def test_cli_corrupt_cache_is_reported_and_rebuilt(cli_results):
    result, run = cli_results["corrupt_cache"]
    assert result.returncode == 0, result.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert re.search(r"WARNING.*token cache .* is corrupt \(\w+: .*\); rebuilding it", log), log[-2000:]
    assert (run / "checkpoints" / "last.ckpt").exists()
    assert not temp_files(cli_results["_tmp"])


# -- 6. DDP (2 CPU processes, gloo) ----------------------------------------------------------------
def test_epoch_sampler_gives_ranks_disjoint_blocks_and_resumes_per_rank():
    n, world = 103, 2
    shards = [list(EpochShuffleSampler(n, seed=3, rank=r, world_size=world)) for r in range(world)]
    assert [len(s) for s in shards] == [51, 51] == [len(EpochShuffleSampler(n, 3, r, world)) for r in range(world)]
    assert not set(shards[0]) & set(shards[1]) and len(set(shards[0]) | set(shards[1])) == 102
    single = list(EpochShuffleSampler(n, seed=3))  # one process: the whole permutation, as before
    assert sorted(single) == list(range(n)) and single[:102][0::2] == shards[0] and single[:102][1::2] == shards[1]
    resumed = EpochShuffleSampler(n, seed=3, rank=1, world_size=world)
    resumed.skip = 8  # this rank had consumed 8 samples (one batch) of the epoch
    assert list(resumed) == shards[1][8:]
    epoch1 = EpochShuffleSampler(n, seed=3, rank=1, world_size=world)
    epoch1.set_epoch(1)
    assert list(epoch1) != shards[1]


def test_datamodule_shards_training_data_by_rank(tmp_path, tiny_corpus, cache_dir):
    from hydra.utils import instantiate

    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir)
    seen = []
    for rank in range(2):
        dm = instantiate(cfg.data)
        dm.prepare_data()
        dm.trainer = SimpleNamespace(global_rank=rank, world_size=2, training=False)
        seen.append(list(dm.train_dataloader().sampler))
    assert seen[0] and len(seen[0]) == len(seen[1]) and not set(seen[0]) & set(seen[1])


def _ddp_run(tmp_path, tiny_corpus, cache_dir, extra: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    run = tmp_path / "run"
    args = [*corpus_args(tiny_corpus), *RUN, "trainer=ddp", "logger=default", "trainer.max_steps=8",
            "trainer.val_check_interval=4", "callbacks.checkpoint.every_n_train_steps=4", *extra]
    proc = start(run, args, cache_dir)
    return finish(proc, timeout=75), run


def _assert_one_clean_ddp_run(result, run: Path, tmp_path: Path) -> None:
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr  # Lightning's line, through Hydra's console handler
    assert logged_steps(run) == list(range(8))  # each step once: rank 1 logs nothing
    assert len(logged_steps(run, "val/loss")) == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step000004.ckpt", "step000008.ckpt"]
    assert load_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == 8
    assert len(list((run / "wandb").glob("offline-run-*"))) == 1  # one W&B run, from rank 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # rank 1 made no run directory of its own
    assert not temp_files(tmp_path)


@pytest.mark.slow  # runs train.py in a subprocess
def test_ddp_two_cpu_processes_train_one_run_with_the_default_callbacks(tmp_path, tiny_corpus, cache_dir):
    """Two gloo processes with the default callbacks. A callback that runs a collective on rank 0 only
    (``trainer.log_dir`` broadcasts) deadlocks the two processes here, and the run times out."""
    result, run = _ddp_run(tmp_path, tiny_corpus, cache_dir, [])
    _assert_one_clean_ddp_run(result, run, tmp_path)
    # Geometry is measured on rank 0 only: one row at initialisation and one at the end, no duplicates.
    assert logged_steps(run, "geometry/abs_cos_mean")[0] == 0
    geometry_steps = logged_steps(run, "geometry/abs_cos_mean")
    assert len(geometry_steps) == len(set(geometry_steps))


def test_checkpoints_are_renamed_inside_the_run_directory(tmp_path, monkeypatch):
    """The temp file sits beside last.ckpt (a rename, never a cross-filesystem copy); a failed save keeps the
    previous checkpoint whole and leaves no temp file."""
    from pe_geometry import files
    from pe_geometry.training.callbacks import AtomicCheckpointIO

    path = tmp_path / "checkpoints" / "last.ckpt"
    io_plugin = AtomicCheckpointIO()
    io_plugin.save_checkpoint({"global_step": 1}, path)
    renames = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "replace", lambda src, dst: renames.append((Path(src), Path(dst))) or real_replace(src, dst))
    io_plugin.save_checkpoint({"global_step": 2}, path)
    assert renames == [(renames[0][0], path)] and renames[0][0].parent == path.parent
    assert load_ckpt(path)["global_step"] == 2

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        io_plugin.save_checkpoint({"global_step": 3}, path)
    assert load_ckpt(path)["global_step"] == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.ckpt"]


def test_training_saves_through_the_atomic_checkpoint_io(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    from pe_geometry.training.callbacks import AtomicCheckpointIO
    from pe_geometry.training.pipeline import train
    from tests.conftest import tiny_train_config

    saved = []
    real_save = AtomicCheckpointIO.save_checkpoint
    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint",
                        lambda self, ckpt, path, storage_options=None: saved.append(Path(path).name) or real_save(self, ckpt, path))
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, []))
    assert "last.ckpt" in saved


# -- 7. every PE type and attention kernel in every CPU precision -------------------------------------
@functools.cache
def _composed(pe: str, attention: str):
    """Composed once per PE and kernel, for the three precisions below (a composition costs more than their step)."""
    return compose_train_config([f"pe={pe}", f"attention={attention}", "model.d_model=32", "model.n_heads=4", "model.n_layers=1",
                                 "data.seq_len=16"])


@pytest.mark.parametrize("pe,attention,precision", fast_loop_covers(PE_TYPES, ["sdpa", "explicit"],
                                                                      ["32-true", "bf16-mixed", "bf16-true"]))
def test_every_pe_and_attention_trains_a_step_in_each_cpu_precision(pe, attention, precision):
    import lightning as L
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    from pe_geometry.training.task import LanguageModelTask

    cfg = copy.deepcopy(_composed(pe, attention))
    model = build_model(cfg, SimpleNamespace(vocab_size=50, mask_token_id=1))
    before = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    blocks = torch.randint(2, 50, (8, 17), generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", precision=precision, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LanguageModelTask(model, instantiate(cfg.optimizer, warmup_steps=1), max_steps=1), DataLoader(blocks, batch_size=4))
    assert trainer.global_step == 1
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v.float(), before[k])]
    assert changed and all(torch.isfinite(v.float()).all() for v in model.state_dict().values())


def test_rope_angles_are_float32_even_in_a_bf16_model():
    from pe_geometry.model.positional import RotaryPE

    pe = RotaryPE(d_model=64, n_heads=1).to(torch.bfloat16)  # as precision=bf16-true does to every buffer
    x = torch.ones(1, 1, 2048, 64, dtype=torch.bfloat16)
    rotated = pe.rotate(x)
    assert rotated.dtype == torch.bfloat16
    exact = RotaryPE(d_model=64, n_heads=1).rotate(x.float())
    # bf16 angles (an 8-bit mantissa) put position ~2000 off by up to a radian; float32 angles cast once stay at bf16 rounding
    assert (rotated.float() - exact).abs().max() < 0.02


def test_alibi_bias_takes_the_scores_dtype_in_the_explicit_kernel():
    from pe_geometry.model.attention import ExplicitAttention
    from pe_geometry.model.positional import ALiBiPE

    attn = ExplicitAttention(32, 4, pe=ALiBiPE(32, 4)).to(torch.bfloat16)
    y = attn(torch.randn(2, 8, 32, dtype=torch.bfloat16), causal=True)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


# -- 8. leftovers and checkpoint names across resumes --------------------------------------------------
def test_half_written_files_of_a_killed_run_are_removed_on_start(tmp_path, tiny_corpus, cache_dir):
    run = tmp_path / "run"
    leftovers = [run / "checkpoints" / ".last.ckpt.k1l2e3d4.tmp", run / "csv" / ".metrics.csv.a1b2c3.tmp", run / ".config.yaml.x9.tmp"]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a file")
    (run / "notes.tmp").write_text("not ours: kept")  # only our writer's .<name>.<random>.tmp pattern is removed
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir))
    assert not any(p.exists() for p in leftovers)
    assert (run / "notes.tmp").exists() and (run / "checkpoints" / "last.ckpt").exists()


def test_resume_from_an_older_checkpoint_continues_last_ckpt_itself(tmp_path, tiny_corpus, cache_dir):
    steps = ["trainer.max_steps=6", "trainer.val_check_interval=6"]
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, steps))
    ckpts = tmp_path / "run" / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["last.ckpt", "step000002.ckpt", "step000004.ckpt", "step000006.ckpt"]
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*steps, f"ckpt_path={ckpts / 'step000002.ckpt'}"]))
    assert sorted(p.name for p in ckpts.iterdir()) == names  # no step...-v1.ckpt, no last-v1.ckpt
    assert load_ckpt(ckpts / "last.ckpt")["global_step"] == 6 and load_ckpt(ckpts / "step000004.ckpt")["global_step"] == 4


# -- 9. metrics.csv: crash-safe rewrites, final rows kept -----------------------------------------------
def test_a_crash_during_the_csv_rewrite_leaves_the_previous_complete_file(tmp_path, monkeypatch):
    from pe_geometry.training.callbacks import _CrashSafeMetricsWriter

    writer = _CrashSafeMetricsWriter(str(tmp_path))
    for step in range(5):
        writer.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    writer.save()
    before = (tmp_path / "metrics.csv").read_text()
    writer.log_metrics({"val/loss": 0.5}, step=4)  # a new column: the whole file is rewritten

    def killed_mid_write(self, rows):
        raise KeyboardInterrupt  # stands for the kill: the header is out, no row yet

    monkeypatch.setattr(csv.DictWriter, "writerows", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        writer.save()
    assert (tmp_path / "metrics.csv").read_text() == before
    monkeypatch.undo()
    writer.save()
    rows = read_rows(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == ["0", "1", "2", "3", "4", "4"] and rows[-1]["val/loss"] == "0.5"
    assert not temp_files(tmp_path)


def test_a_row_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    (tmp_path / "csv" / "resume-step5").mkdir(parents=True)
    (tmp_path / "csv" / "metrics.csv").write_text("step,train/loss\n0,1.0\n1,0.9\n2,0.")  # killed mid-append
    (tmp_path / "csv" / "resume-step5" / "metrics.csv").write_text("step,train/loss\n5,0.5\n")
    assert read_run_rows(tmp_path) == [{"step": "0", "train/loss": "1.0"}, {"step": "1", "train/loss": "0.9"},
                                       {"step": "5", "train/loss": "0.5"}]


@pytest.mark.skipif(not HAS_GEOMETRY, reason="no geometry callback configured")
def test_rerunning_the_resume_of_a_finished_run_keeps_its_final_rows(tmp_path, tiny_corpus, cache_dir):
    args = ["trainer.max_steps=4", "trainer.val_check_interval=4", "callbacks.geometry.every_n_steps=2",
            "callbacks.geometry.measures=[input]"]
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, args))
    run = tmp_path / "run"
    finished = read_run_rows(run)
    assert logged_steps(run, "geometry/abs_cos_mean")[-1] == 4
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*args, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"]))
    assert read_run_rows(run) == finished


# -- 10. Ctrl-C / SIGTERM resume as exactly as kill -9 --------------------------------------------------
def interrupted_run_args(corpus: dict[str, Path]) -> list[str]:
    return [*corpus_args(corpus), *RUN, "model=encoder", *(["~callbacks.geometry"] if HAS_GEOMETRY else [])]


@pytest.fixture(scope="module")
def straight_encoder_run(tmp_path_factory, tiny_corpus, cache_dir):
    """The uninterrupted run test 10 compares with, for SIGINT and SIGTERM alike (the same arguments: one run, not two).
    Started by the first test that asks, beside its interrupted run as before; ``finished()`` waits for it and checks
    its exit code."""
    run = tmp_path_factory.mktemp("straight") / "straight"
    proc = start(run, interrupted_run_args(tiny_corpus), cache_dir)
    result = []

    def finished() -> Path:
        if not result:
            result.append(finish(proc))
        assert result[0].returncode == 0, result[0].stderr[-3000:]
        return run

    yield finished
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.slow  # runs train.py in a subprocess
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_then_resume_matches_the_uninterrupted_run(sig, tmp_path, tiny_corpus, cache_dir, straight_encoder_run):
    """The checkpoint an interrupt saves has step, data position and RNG of one same moment: the resume is exact.
    (Geometry is off: it measures at the resume step, an extra row after an off-grid resume; see the doc.)"""
    args = interrupted_run_args(tiny_corpus)
    run = tmp_path / "stopped"
    stopped = start(run, args, cache_dir)
    wait_until(lambda: max(logged_steps(run), default=-1) >= 24, stopped, "step 24")
    stopped.send_signal(sig)
    assert_stopped_with_a_resumable_last_ckpt(finish(stopped, timeout=120), sig, run, tmp_path)  # (as test 2 checks it)
    last = load_ckpt(run / "checkpoints" / "last.ckpt")
    # the interrupt's own save: at or after the step seen when the signal went out (the periodic one before it is step 20);
    # where it stops depends on timing, and it may fall on the periodic grid too
    assert 24 <= last["global_step"] < STEPS
    position = last["TextDataModule"]  # the datamodule's state: training batches consumed in the current epoch
    n_batches = 34  # training blocks per epoch / batch size on the tiny corpus, as the RUN comment says
    assert position["epoch"] * n_batches + position["batches"] == last["global_step"]  # the data position agrees with the step
    resumed = finish(start(tmp_path / "resumed", [*args, f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}"], cache_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = straight_encoder_run()
    assert_same_series(read_run_rows(run), read_run_rows(straight))
    a, b = load_ckpt(run / "checkpoints" / "last.ckpt"), load_ckpt(straight / "checkpoints" / "last.ckpt")
    for name, tensor in b["state_dict"].items():
        assert torch.equal(a["state_dict"][name], tensor), f"{name} differs after the resume"
    assert not temp_files(tmp_path, straight)


# -- 11. a sweep goes on past a failed job ----------------------------------------------------------------
@pytest.mark.slow  # runs train.py in a subprocess
def test_a_failed_sweep_job_is_reported_and_the_sweep_goes_on(tmp_path, tiny_corpus, cache_dir):
    env = {**os.environ, "PE_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    args = [*corpus_args(tiny_corpus), *RUN, "trainer.max_steps=2", "model.n_heads=3,4", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    result = forkserver.run([sys.executable, str(ROOT / "train.py"), "-m", *args], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = error_lines(result.stderr)
    assert re.match(r"error: sweep job 0 \(.*model.n_heads=3.*\): ConfigError: model.d_model=32 is not divisible by model.n_heads=3",
                    lines[0])
    assert lines[1] == "error: 1 sweep job(s) failed:" and "job 0 (" in result.stderr.split(lines[1])[1]
    jobs = sorted((tmp_path / "sweep").iterdir())
    assert [p.name.split("_")[0] for p in jobs if p.is_dir()][:2] == ["0", "1"]
    assert load_ckpt(jobs[1] / "checkpoints" / "last.ckpt")["global_step"] == 2  # the job after the failure ran
    assert not (jobs[0] / "checkpoints").exists()


# -- 12. non-finite weights: never saved, never measured ---------------------------------------------------
def test_a_huge_learning_rate_stops_before_non_finite_weights_are_saved(tmp_path, tiny_corpus, cache_dir):
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, [
        "optimizer.lr=1000", "optimizer.warmup_steps=1", "trainer.max_steps=30", "trainer.val_check_interval=30",
        "callbacks.checkpoint.every_n_train_steps=1", "data.seq_len=32", "data.batch_size=8",
        *(["callbacks.geometry.every_n_steps=1"] if HAS_GEOMETRY else []),  # (it measured the NaN weights: LinAlgError)
    ])
    stopped = r"^(weights became non-finite \(\S+ holds nan/inf\) in the optimiser step of|training loss is \S+ at) step \d+; stopping"
    with pytest.raises(NonFiniteLossError, match=stopped):
        train(cfg)
    ckpts = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts, "it trained at least one step"
    for path in ckpts:
        assert all(torch.isfinite(t).all() for t in load_ckpt(path)["state_dict"].values()), f"{path.name} holds nan/inf weights"
    assert not temp_files(tmp_path)


def test_the_weight_check_names_the_step_and_the_parameter(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    from pe_geometry.training.task import LanguageModelTask

    real_step = LanguageModelTask.optimizer_step

    def poison_at_step_3(self, epoch, batch_idx, optimizer, optimizer_closure):
        def closure():  # the loss is finite; one gradient entry, set after clipping, makes the update NaN
            loss = optimizer_closure()
            if self.global_step == 3:
                self.model.W_E.grad[0, 0] = float("nan")
            return loss

        return real_step(self, epoch, batch_idx, optimizer, closure)

    monkeypatch.setattr(LanguageModelTask, "optimizer_step", poison_at_step_3)
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=6", "callbacks.checkpoint.every_n_train_steps=1"])
    with pytest.raises(NonFiniteLossError, match=r"weights became non-finite \(\S+ holds nan/inf\) in the optimiser step of step 3; "):
        train(cfg)
    assert load_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 3


# -- 13. SIGTERM under DDP -----------------------------------------------------------------------------------
@pytest.mark.slow  # runs train.py in a subprocess (two DDP processes)
@pytest.mark.parametrize("target", ["rank0", "every_rank"])
def test_sigterm_under_ddp_saves_once_and_every_rank_exits_143(target, tmp_path, tiny_corpus, cache_dir):
    """``kill <rank 0>`` (the other rank learns of it at the next step) and a scheduler's SIGTERM to every process."""
    run = tmp_path / "run"
    args = [*corpus_args(tiny_corpus), *RUN, "trainer=ddp", "trainer.max_steps=5000", *(["~callbacks.geometry"] if HAS_GEOMETRY else [])]
    proc = start(run, args, cache_dir)
    wait_until(lambda: max(logged_steps(run), default=-1) >= 14, proc, "step 14")
    if target == "rank0":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
    result = finish(proc, timeout=60)
    assert result.returncode == 143, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert error_lines(result.stderr) == [f"error: stopped by SIGTERM; resume with ckpt_path={run}/checkpoints/last.ckpt"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # rank 1 exits too (same process group)
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("rank 1 did not exit")
    steps = [int(m) for m in re.findall(r"interrupted at step (\d+) by SIGTERM", (run / "train.log").read_text())]
    rank1 = (run / "train_ddp_process_1.log").read_text()
    assert steps and re.findall(r"interrupted at step (\d+) by SIGTERM", rank1) == [str(steps[0])]  # both ranks stopped at one step
    assert "stopped by SIGTERM; exit code 143" in rank1
    assert load_ckpt(run / "checkpoints" / "last.ckpt")["global_step"] == steps[0]
    assert not temp_files(tmp_path)


def test_sigterm_during_the_final_validation_lets_the_run_finish_its_rows(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    """Lightning abandoned the final validation on SIGTERM, and a resume at the last step never repeats it."""
    from pe_geometry.training.task import LanguageModelTask

    real_step = LanguageModelTask.validation_step

    def sigterm_in_final_validation(self, block, batch_idx):
        if self.global_step == 4 and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this very process
        return real_step(self, block, batch_idx)

    monkeypatch.setattr(LanguageModelTask, "validation_step", sigterm_in_final_validation)
    geometry = ["callbacks.geometry.every_n_steps=2", "callbacks.geometry.measures=[input]"] if HAS_GEOMETRY else []
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=4", "trainer.val_check_interval=4",
                                                               "trainer.limit_val_batches=3", *geometry])
    train(cfg)  # finishes: the signal came after the last step
    metrics = tmp_path / "run"
    assert logged_steps(metrics, "val/loss") == [3]  # Lightning logs a validation at the step it follows
    if HAS_GEOMETRY:
        assert logged_steps(metrics, "geometry/abs_cos_mean")[-1] == 4
    assert load_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == 4


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_the_non_finite_weight_check_names_the_bad_tensor_and_clears_huge_finite_ones(bad):
    from pe_geometry.training.task import first_non_finite_parameter

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with torch.no_grad():
        if bad is None:  # finite, but its norm overflows float32: the fast pass flags it, the exact pass clears it
            module[1].weight.fill_(1e30)
        else:
            module[1].bias[2] = bad
    assert first_non_finite_parameter(module) == (None if bad is None else "1.bias")
