"""End to end through train.py's config: a few real optimiser steps for every model x PE."""

from __future__ import annotations

import csv
import math
import os
import signal

import pytest
import torch

from pe_geometry.training.pipeline import train
from pe_geometry.training.validate import ConfigError
from tests.conftest import MODEL_TYPES, PE_TYPES, STOP_SIGNALS, causal_only, fast_loop_keeps, tiny_train_config


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("model,pe", fast_loop_keeps(
    [(model, pe) for model in MODEL_TYPES for pe in PE_TYPES],
    keep=[("decoder", "rope"), ("encoder", "learned"), ("encoder_decoder", "alibi")]))  # a stack, a table, a bias
def test_fit_every_model_and_pe(model, pe, tmp_path, tiny_corpus, cache_dir):
    # every callback still runs (each family's geometry path included), with its smallest nulls, probe and sample:
    # the 30 fits once spent most of their time drawing nulls no assertion reads
    cheap = ["callbacks.geometry.null_draws=2", "callbacks.geometry.position_probe_permutations=2",
             "callbacks.geometry.position_probe_blocks=5", "callbacks.geometry.attention_null_draws=2",
             "callbacks.geometry.n_tokens=50", "callbacks.sample.max_new_tokens=4"]
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, [f"model={model}", f"pe={pe}", *cheap])
    if model != "decoder" and causal_only(pe):  # pe=forgetting: a bidirectional stack is refused before anything runs
        with pytest.raises(ConfigError, match=rf"^pe={pe}: .* causal only: .* it works with model=decoder$"):
            train(cfg)
        return
    metrics = train(cfg)
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    run = tmp_path / "run"
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3
    rows = read_csv(run / "csv" / "metrics.csv")
    assert {int(r["step"]) for r in rows if r["train/loss"]} == {0, 1, 2}
    assert any(r["val/loss"] for r in rows)
    assert (run / "config.yaml").exists() and (run / "run_info.json").exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_corpus, cache_dir):
    """One 40-step run with the default loggers (CSV and W&B offline), read by the three tests below; with the stop
    signals' handlers just before and just after it (``pipeline.train`` in this process, as a notebook calls it)."""
    root = tmp_path_factory.mktemp("finished")
    cfg = tiny_train_config(
        root, tiny_corpus, cache_dir,
        ["logger=default", "trainer.max_steps=40", "trainer.val_check_interval=40", "optimizer.lr=3e-3", "optimizer.warmup_steps=5"],
    )
    handlers = [{sig: signal.getsignal(sig) for sig in STOP_SIGNALS}]
    train(cfg)
    handlers.append({sig: signal.getsignal(sig) for sig in STOP_SIGNALS})
    return root / "run", handlers


def test_training_lowers_the_loss(finished_run):
    run, _ = finished_run
    losses = [float(r["train/loss"]) for r in read_csv(run / "csv" / "metrics.csv") if r["train/loss"]]
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5  # ln(300) = 5.7 at the start


def test_a_finished_in_process_run_leaves_the_signal_handlers_as_it_found_them(finished_run):
    """GracefulStop replaces the stop signals' handlers while a run trains; once ``train`` returns, Ctrl-C must be
    the caller's again (pytest's, a notebook's), not the run's."""
    from pe_geometry.training.interrupt import GracefulStop, _log_finished

    _, (before, after) = finished_run
    assert after == before
    # (before: Python's default_int_handler, or SIG_IGN where a shell started pytest in the background)
    assert not [h for h in after.values() if isinstance(getattr(h, "__self__", None), GracefulStop) or h is _log_finished]


def test_wandb_offline_run_files_are_written(finished_run):
    run, _ = finished_run
    runs = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_ctrl_c_during_an_in_process_run_ends_pytest(tmp_path, tiny_corpus, cache_dir, monkeypatch):
    """A Ctrl-C while a test's run trains used to be taken by the run (a stop after the step, or ignored after the last
    step) and pytest went on with the next test; tests/conftest.py makes it KeyboardInterrupt, which ends the session."""
    from pe_geometry.training.task import LanguageModelTask

    real_step = LanguageModelTask.training_step

    def ctrl_c_at_step_1(self, block, batch_idx):
        if self.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)  # as the terminal sends it to pytest
        return real_step(self, block, batch_idx)

    monkeypatch.setattr(LanguageModelTask, "training_step", ctrl_c_at_step_1)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["~callbacks.geometry", "~callbacks.sample"]))
    assert signal.getsignal(signal.SIGINT) is before


def test_same_seed_same_losses_different_seed_different(tmp_path, tiny_corpus, cache_dir):
    def losses(seed, sub):
        train(tiny_train_config(tmp_path / sub, tiny_corpus, cache_dir, [f"seed={seed}"]))
        return [r["train/loss"] for r in read_csv(tmp_path / sub / "run" / "csv" / "metrics.csv") if r["train/loss"]]

    first = losses(0, "a")
    assert first == losses(0, "b")
    assert first != losses(1, "c")


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


@pytest.mark.slow  # torch.compile's code generation: ~10 s, most of the fast loop's longest test
def test_compiled_model_trains_and_matches_eager_loss(tmp_path, tiny_corpus, cache_dir):
    """compile=true wraps the model with torch.compile; the first step's loss equals eager's (same seed)."""
    def first_loss(sub, compiled):
        train(tiny_train_config(tmp_path / sub, tiny_corpus, cache_dir, [f"compile={compiled}", "trainer.max_steps=2"]))
        return float(next(r["train/loss"] for r in read_csv(tmp_path / sub / "run" / "csv" / "metrics.csv") if r["train/loss"]))

    assert first_loss("compiled", "true") == pytest.approx(first_loss("eager", "false"), rel=1e-4)
