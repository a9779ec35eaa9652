"""End to end through train.py's config: a few real optimiser steps for every model x PE."""

from __future__ import annotations

import csv
import math
import subprocess
import sys

import pytest
import torch

from pe_geometry.training.pipeline import train
from tests.conftest import MODEL_TYPES, PE_TYPES, ROOT, tiny_train_config


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("pe", PE_TYPES)
@pytest.mark.parametrize("model", MODEL_TYPES)
def test_fit_every_model_and_pe(model, pe, tmp_path, tiny_corpus, cache_dir):
    # every callback still runs (each family's geometry path included), with its smallest nulls, probe and sample:
    # the 30 fits once spent most of their time drawing nulls no assertion reads
    cheap = ["callbacks.geometry.null_draws=2", "callbacks.geometry.position_probe_permutations=2",
             "callbacks.geometry.position_probe_blocks=5", "callbacks.geometry.attention_null_draws=2",
             "callbacks.geometry.n_tokens=50", "callbacks.sample.max_new_tokens=4"]
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, [f"model={model}", f"pe={pe}", *cheap])
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    run = tmp_path / "run"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3
    rows = read_csv(run / "csv" / "metrics.csv")
    assert {int(r["step"]) for r in rows if r["train/loss"]} == {0, 1, 2}
    assert any(r["val/loss"] for r in rows)
    assert (run / "config.yaml").exists() and (run / "run_info.json").exists()


def test_training_lowers_the_loss(tmp_path, tiny_corpus, cache_dir):
    cfg = tiny_train_config(
        tmp_path, tiny_corpus, cache_dir,
        ["trainer.max_steps=40", "trainer.val_check_interval=40", "optimizer.lr=3e-3", "optimizer.warmup_steps=5"],
    )
    train(cfg)
    losses = [float(r["train/loss"]) for r in read_csv(tmp_path / "run" / "csv" / "metrics.csv") if r["train/loss"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # ln(300) = 5.7 at the start


def test_same_seed_same_losses_different_seed_different(tmp_path, tiny_corpus, cache_dir):
    def losses(seed, sub):
        train(tiny_train_config(tmp_path / sub, tiny_corpus, cache_dir, [f"seed={seed}"]))
        return [r["train/loss"] for r in read_csv(tmp_path / sub / "run" / "csv" / "metrics.csv") if r["train/loss"]]

    first = losses(0, "a")
    assert first == losses(0, "b")
    assert first != losses(1, "c")


def test_wandb_offline_run_files_are_written(tmp_path, tiny_corpus, cache_dir):
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["logger=default"])
    train(cfg)
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


@pytest.mark.slow  # runs train.py in a subprocess
def test_cli_runs_a_sweep(tmp_path, tiny_corpus):
    """``python train.py -m pe=a,b`` makes one output dir per run, each with a checkpoint."""
    args = [
        "-m", "pe=rope,alibi", "logger=csv", "data=text_files",
        f"data.corpus.train_files=[{tiny_corpus['train']}]", f"data.corpus.val_files=[{tiny_corpus['validation']}]",
        f"paths.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "model.d_model=32", "model.n_layers=1", "data.seq_len=16", "data.batch_size=4", "data.vocab_size=300",
        "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.val_check_interval=2", "~callbacks.progress_bar",
    ]
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert runs == ["0_decoder-rope-s0", "1_decoder-alibi-s0"]
    for run in runs:
        assert (tmp_path / "sweep" / run / "checkpoints" / "last.ckpt").exists()
        assert (tmp_path / "sweep" / run / ".hydra" / "config.yaml").exists()


def test_speed_options_train(tmp_path, tiny_corpus, cache_dir):
    """bf16 autocast and gradient accumulation (issue: options users expect) run through the normal path:
    4 optimiser steps of 2 micro-batches each, finite losses, the step counter counts optimiser steps."""
    cfg = tiny_train_config(
        tmp_path, tiny_corpus, cache_dir,
        ["trainer.precision=bf16-mixed", "trainer.accumulate_grad_batches=2", "trainer.max_steps=4",
         "trainer.val_check_interval=8", "matmul_precision=medium"],
    )
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4


def test_compiled_model_trains_and_matches_eager_loss(tmp_path, tiny_corpus, cache_dir):
    """compile=true wraps the model with torch.compile; the first step's loss equals eager's (same seed)."""
    def first_loss(sub, compiled):
        train(tiny_train_config(tmp_path / sub, tiny_corpus, cache_dir, [f"compile={compiled}", "trainer.max_steps=2"]))
        return float(next(r["train/loss"] for r in read_csv(tmp_path / sub / "run" / "csv" / "metrics.csv") if r["train/loss"]))

    assert first_loss("compiled", "true") == pytest.approx(first_loss("eager", "false"), rel=1e-4)
