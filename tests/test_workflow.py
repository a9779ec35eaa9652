"""The advertised workflow end to end: W&B runs per sweep job, checked resume, logger options, a run that talks.

W&B runs are read back with W&B's own reader of its offline transaction log (``wandb leet inspect --json``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pe_geometry.analysis.readers.runs import read_run_rows
from pe_geometry.training.pipeline import train
from pe_geometry.training.resume import contradictions, is_fixed_on_resume, overridden_keys
from pe_geometry.training.validate import ConfigError
from tests import forkserver
from tests.conftest import ROOT, compose_train_config, tiny_train_config


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def fingerprint(run: Path) -> dict[str, str]:
    """Every file of a run directory (W&B's folder aside) -> a hash of its bytes."""
    return {str(p.relative_to(run)): hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
            if p.is_file() and "wandb" not in p.parts}


def wandb_run(offline_dir: Path) -> dict:
    """An offline W&B run as W&B's reader gives it: run record, config, history items."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline_dir)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    run = next(r["run"] for r in records if r["type"] == "run")
    config = {k: v for k, v in run["config"]["update"].items()}
    for r in records:
        if r["type"] == "config":
            config |= r["config"].get("update", {})
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    return {"run": run, "config": config, "history": history, "exit": next(r for r in records if r["type"] == "exit")}


# -- resume rules (no training) -------------------------------------------------------------------
def test_overridden_keys_cover_groups_experiments_and_plain_keys():
    keys = overridden_keys(["pe=rope", "model.d_model=64", "~callbacks.progress_bar", "experiment=quick", "hydra.run.dir=x"])
    assert {"pe._target_", "model.d_model", "callbacks.progress_bar", "data.seq_len", "trainer.max_steps"} <= keys
    assert not any(k.startswith("hydra") for k in keys)


def test_only_what_is_trained_is_fixed_on_resume():
    assert is_fixed_on_resume("model.d_model") and is_fixed_on_resume("pe._target_") and is_fixed_on_resume("data.seq_len")
    assert not is_fixed_on_resume("trainer.max_steps") and not is_fixed_on_resume("data.cache_dir")
    saved = {"model": {"d_model": 32}, "trainer": {"max_steps": 10}}
    now = {"model": {"d_model": 64}, "trainer": {"max_steps": 20}}
    assert contradictions(now, saved, {"model.d_model", "trainer.max_steps"}) == {"model.d_model": (32, 64)}
    assert contradictions(now, saved, set()) == {}  # a default that differs is taken from the checkpoint, not an error


# -- resume (in-process training) -----------------------------------------------------------------
@pytest.fixture(scope="module")
def rope_run(tmp_path_factory, tiny_corpus, cache_dir) -> Path:
    """A finished 3-step RoPE run (checkpoint every 2 steps), to resume from."""
    root = tmp_path_factory.mktemp("rope")
    train(tiny_train_config(root, tiny_corpus, cache_dir, ["pe=rope"]))
    return root / "run"


def test_checkpoint_carries_the_resolved_run_config(rope_run):
    ckpt = torch.load(rope_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["run_config"]["pe"]["_target_"] == "pe_geometry.model.RotaryPE"
    assert ckpt["run_config"]["model"]["d_model"] == 32 and ckpt["run_config"]["data"]["vocab_size"] == 300


def test_resume_with_a_contradicting_override_fails_naming_the_keys_and_touches_nothing(rope_run, tmp_path, tiny_corpus, cache_dir):
    before = fingerprint(rope_run)
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir,
                            ["pe=sinusoidal", "model.d_model=64", f"ckpt_path={rope_run}/checkpoints/step000002.ckpt"])
    with pytest.raises(ConfigError) as err:
        train(cfg)
    assert "model.d_model: checkpoint 32, command line 64" in str(err.value)
    assert "pe._target_: checkpoint 'pe_geometry.model.RotaryPE', command line 'pe_geometry.model.SinusoidalPE'" in str(err.value)
    assert fingerprint(rope_run) == before  # config.yaml, metrics.csv, checkpoints: byte for byte


def test_resume_rebuilds_the_checkpoint_model_and_keeps_the_first_config(rope_run, tmp_path, tiny_corpus, cache_dir):
    """No pe= on the command line: the resume builds the RoPE model of the checkpoint, not the default."""
    run = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(rope_run), str(run)], check=True)
    first_config = (run / "config.yaml").read_text()
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=5", f"ckpt_path={run}/checkpoints/last.ckpt"])
    train(cfg)
    saved = [torch.load(p, map_location="cpu", weights_only=False) for p in (run / "checkpoints").glob("*.ckpt")]
    ckpt = max(saved, key=lambda c: c["global_step"])
    assert ckpt["global_step"] == 5 and ckpt["run_config"]["pe"]["_target_"] == "pe_geometry.model.RotaryPE"
    assert (run / "config.yaml").read_text() == first_config
    resumed = (run / "config-resume-step3.yaml").read_text()
    assert "RotaryPE" in resumed and "trainer.max_steps" in resumed  # the change is recorded


def test_a_matching_resume_continues_the_same_curves(tmp_path, tiny_corpus, cache_dir):
    def losses(run):
        return {int(r["step"]): float(r["train/loss"]) for r in read_run_rows(run) if r["train/loss"]}

    first = tiny_train_config(tmp_path / "b", tiny_corpus, cache_dir, ["trainer.max_steps=6", "trainer.val_check_interval=6"])
    train(first)
    a = losses(tmp_path / "b" / "run")  # the straight run's curve (a second identical run: the same, as test_train shows)
    # the same run, resumed from its step-2 checkpoint (the rows from step 2 on are logged again)
    step2 = tmp_path / "b" / "run" / "checkpoints" / "step000002.ckpt"
    resumed = tiny_train_config(tmp_path / "b", tiny_corpus, cache_dir,
                                ["trainer.max_steps=6", "trainer.val_check_interval=6", f"ckpt_path={step2}"])
    train(resumed)
    b = losses(tmp_path / "b" / "run")
    assert (tmp_path / "b" / "run" / "csv" / "resume-step2" / "metrics.csv").is_file()  # b's rows are the resume's
    assert sorted(a) == sorted(b) == list(range(6))
    assert all(math.isclose(a[s], b[s], rel_tol=1e-6) for s in a), (a, b)
    assert (tmp_path / "b" / "run" / "config-resume-step2.yaml").is_file()


# -- logger options, end-of-run validation --------------------------------------------------------
def test_logger_none_trains_and_validates_at_the_end(tmp_path, tiny_corpus, cache_dir):
    """No logger: the LR monitor is left out instead of stopping the run; a run shorter than
    val_check_interval still ends with a validation loss."""
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["logger=none", "trainer.max_steps=2", "trainer.val_check_interval=50"])
    metrics = train(cfg)
    assert math.isfinite(metrics["val/loss"])
    assert not (tmp_path / "run" / "csv").exists()


def test_csv_hparams_hold_the_whole_config(tmp_path, tiny_corpus, cache_dir):
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=alibi", "trainer.max_steps=1"]))
    hparams = (tmp_path / "run" / "csv" / "hparams.yaml").read_text()
    assert "pe_geometry.model.ALiBiPE" in hparams and "d_model: 32" in hparams and "vocab_size: 300" in hparams


# -- sweeps through the CLI: one W&B run per job, one group ---------------------------------------
def sweep_args(tiny_corpus, tmp_path: Path) -> list[str]:
    return [
        "-m", "pe=sinusoidal,learned", "data=text_files",
        f"data.corpus.train_files=[{tiny_corpus['train']}]", f"data.corpus.val_files=[{tiny_corpus['validation']}]",
        f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "model.d_model=32", "model.n_heads=4", "model.n_layers=1", "data.seq_len=16", "data.batch_size=4", "data.vocab_size=300",
        "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.val_check_interval=50", "trainer.enable_model_summary=false",
        "callbacks.geometry.every_n_steps=1", "callbacks.geometry.measures=[input]", "callbacks.progress_bar.log_every_n_steps=1",
    ]


@pytest.mark.slow  # runs train.py -m in a subprocess
@pytest.mark.parametrize("launcher", ["basic", "local_parallel"])
def test_sweep_jobs_are_separate_wandb_runs_in_one_group(launcher, tmp_path, tiny_corpus):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = forkserver.run([sys.executable, str(ROOT / "train.py"), *sweep_args(tiny_corpus, tmp_path), f"hydra/launcher={launcher}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=500, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    offline = sorted((tmp_path / "sweep").glob("*/wandb/offline-run-*"))
    assert len(offline) == 2, offline
    runs = [wandb_run(d) for d in offline]
    run_config = compose_train_config([a for a in sweep_args(tiny_corpus, tmp_path) if a != "-m" and "," not in a])
    run_config_keys = list(run_config.keys())
    assert len({r["run"]["run_id"] for r in runs}) == 2
    assert len({r["run"]["run_group"] for r in runs}) == 1 and runs[0]["run"]["run_group"] == f"{tmp_path.name}_sweep"
    assert [r["run"]["display_name"] for r in runs] == ["decoder-sinusoidal-s0", "decoder-learned-s0"]
    assert [r["config"]["pe"]["_target_"] for r in runs] == ["pe_geometry.model.SinusoidalPE", "pe_geometry.model.LearnedPE"]
    assert [r["config"]["choices"]["pe"] for r in runs] == ["sinusoidal", "learned"]  # groupable by option name
    for r in runs:
        assert r["run"]["job_type"] == "default" and r["exit"]["exit"]["exit_code"] in (0, None)
        assert r["config"]["model"]["d_model"] == 32 and r["config"]["data"]["vocab_size"] == 300 and r["config"]["seed"] == 0
        # one source of each setting, the nested config: no flat copy (lr, betas, max_steps from saved hyperparameters)
        assert {k for k in r["config"] if not k.startswith("_wandb")} <= set(run_config_keys) | {"choices"}, sorted(r["config"])
        assert r["config"]["optimizer"]["lr"] == run_config.optimizer.lr and r["config"]["trainer"]["max_steps"] == 2
        steps = [h["trainer/global_step"] for h in r["history"] if "geometry/overlap_k8" in h]
        assert steps == [0, 1, 2]
        # the end-of-run W&B table (cos/angle rows) and the chart of overlap_k8 against its chance
        logged = {k: v for h in r["history"] for k, v in h.items()}
        assert logged["tables/angle_table._type"] == "table-file" and logged["tables/angle_table.nrows"] >= 4
        assert logged["charts/overlap_k8_vs_chance_table.nrows"] > 0
    # the log lines of a run whose stdout is not a terminal, and the end-of-run summary
    output = result.stdout + result.stderr
    assert "step 2/2 | train/loss" in output and "tokens/s | ETA" in output
    assert "final val/loss" in output and "wandb sync" in output and "report:     pe-report" in output
    # one output folder per job, each with its checkpoint and Hydra's record of its config (this was
    # tests/test_train.py's test_cli_runs_a_sweep, a sweep of its own)
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert jobs == ["0_decoder-sinusoidal-s0", "1_decoder-learned-s0"]
    for job in jobs:
        assert (tmp_path / "sweep" / job / "checkpoints" / "last.ckpt").exists()
        assert (tmp_path / "sweep" / job / ".hydra" / "config.yaml").exists()


@pytest.mark.slow  # runs train.py in a subprocess and interrupts it
def test_ctrl_c_prints_the_resume_override(tmp_path, tiny_corpus):
    run = tmp_path / "run"
    single = [a for a in sweep_args(tiny_corpus, tmp_path) if a not in ("-m", "pe=sinusoidal,learned") and not a.startswith("hydra.")]
    args = [*single, "trainer.max_steps=5000", "logger=csv", f"hydra.run.dir={run}"]
    proc = forkserver.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not (run / "csv" / "metrics.csv").is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130  # 128 + SIGINT
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: stopped by SIGINT (Ctrl-C); resume with ckpt_path={run}/checkpoints/last.ckpt"
    ]
    assert (run / "checkpoints" / "last.ckpt").is_file()


# -- run names (no training) ---------------------------------------------------------------------
def test_run_folder_names_say_what_ran_and_can_be_passed_back_as_ckpt_path():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from pe_geometry.training.names import run_folder_name

    assert run_folder_name(None, "decoder", "sinusoidal", "") == "default_decoder-sinusoidal"
    name = run_folder_name("quick", "decoder", "rope", "model.d_model-64+trainer.max_steps-20")
    assert name == "quick_decoder-rope_model.d_model-64+trainer.max_steps-20"
    long = run_folder_name("quick", "decoder", "rope", "+".join(f"key{i}.x-{i}" for i in range(40)))
    assert len(long) <= 120 and long != run_folder_name("quick", "decoder", "rope", "+".join(f"key{i}.x-{i}" for i in range(41)))
    # a layer pattern reads as its entries (it was model.layer_pattern------------pe--none--)
    pattern = run_folder_name(None, "decoder", "rope", "model.layer_pattern-[{},{},{},{pe: none}]")
    assert pattern == "default_decoder-rope_model.layer_pattern--same-same-same-pe-none"
    for folder in (name, long, pattern, run_folder_name(None, "decoder", "rope", "~callbacks.progress_bar+x-[a,b]")):
        override = OverridesParser.create().parse_override(f"ckpt_path=/runs/{folder}/checkpoints/last.ckpt")
        assert override.value() == f"/runs/{folder}/checkpoints/last.ckpt"


def test_control_arms_get_their_own_run_names():
    """Five arms of one sweep once shared the name decoder-learned-s0 (in W&B and in the job folders)."""
    names = {arm: compose_train_config([f"control={arm}", "pe=learned", "seed=1"]).run_name
             for arm in ("baseline", "untied_head", "mixed_init")}
    assert names == {"baseline": "decoder-learned-s1", "untied_head": "decoder-learned-untied_head-s1",
                     "mixed_init": "decoder-learned-mixed_init-s1"}
    assert compose_train_config(["pe=rope"]).run_name == "decoder-rope-s0"  # no control arm: the name as before
    assert compose_train_config(["control=learned_baseline"]).run_name == "decoder-learned-s0"
