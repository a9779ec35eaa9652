"""The GPT-2 small preset (experiment=gpt2_small) and the GPU trainer option (trainer=gpu).

The preset must compose, pass every check and build GPT-2 small's shape; it trains here for two steps (slow);
``trainer=gpu`` must set the GPU speed options, build fused AdamW, and be one clear error on a machine without CUDA.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate

from pe_geometry.model import DecoderLM
from pe_geometry.training.optimizer import adamw_warmup_cosine
from pe_geometry.training.run_loader import build_model
from pe_geometry.training.validate import ConfigError, check_config
from tests import forkserver
from tests.conftest import ROOT, compose_train_config

# GPT-2 small (Radford et al. 2019) with this preset's vocabulary
D, LAYERS, HEADS, D_FF, SEQ, VOCAB = 768, 12, 12, 3072, 1024, 32768
# per block: q, k, v, o (4 d^2 weights + 4 d biases), MLP up and down (2 d d_ff + d_ff + d), two LayerNorms (4 d)
PER_BLOCK = 4 * D * D + 4 * D + 2 * D * D_FF + D_FF + D + 4 * D  # 7,087,872
NON_EMBEDDING = LAYERS * PER_BLOCK + 2 * D  # + the final LayerNorm: 85,056,000
EMBEDDING = VOCAB * D + SEQ * D  # E (tied to the output head) + the learned 1024-row position table
TOKENS_PER_STEP = 524_288  # GPT-2 / GPT-3 small: 0.5 M tokens per optimiser step


def gpu_available(monkeypatch) -> None:
    """The machine check only (a CUDA GPU is there): the rest of check_config runs as it would on a GPU."""
    monkeypatch.setattr("pe_geometry.training.validate.torch_cuda_available", lambda: True)


def test_the_formula_is_gpt2_smalls():
    assert NON_EMBEDDING == 85_056_000
    assert NON_EMBEDDING + 50257 * D + SEQ * D == 124_439_808  # GPT-2 small with its own vocabulary: "124 M"


def test_gpt2_small_composes_validates_and_builds_gpt2_smalls_shape(tmp_path):
    cfg = compose_train_config(["experiment=gpt2_small"], output_dir=tmp_path)
    check_config(cfg)
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_heads, m.d_ff, m.norm) == (D, LAYERS, HEADS, D_FF, "pre")
    assert (cfg.data.seq_len, cfg.data.vocab_size, cfg.pe.max_len) == (SEQ, VOCAB, SEQ)
    assert cfg.pe._target_.endswith("LearnedPE") and cfg.embedding.tie_weights
    assert cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * cfg.data.seq_len == TOKENS_PER_STEP
    # val_check_interval counts micro-batches: validation falls on optimiser steps, on the geometry cadence
    interval, accumulate = cfg.trainer.val_check_interval, cfg.trainer.accumulate_grad_batches
    assert interval % accumulate == 0 and interval // accumulate == cfg.callbacks.geometry.every_n_steps
    assert cfg.optimizer.warmup_steps < cfg.trainer.max_steps
    with torch.device("meta"):  # shapes only: no 444 MB of weights to initialise
        model = build_model(cfg, SimpleNamespace(vocab_size=VOCAB, mask_token_id=1))
    assert isinstance(model, DecoderLM)
    total = sum(p.numel() for p in model.parameters())  # the tied head is E: counted once
    embedding = model.W_E.numel() + model.W_pos.numel()
    assert (total - embedding, embedding, total) == (NON_EMBEDDING, EMBEDDING, 111_008_256)


def test_gpt2_small_with_an_encoding_without_a_table_drops_max_len(tmp_path):
    """rope, alibi and none have no table: the preset's pe.max_len is one error naming the key, and
    ``~pe.max_len`` (the command in the preset's comment) composes."""
    with pytest.raises(ConfigError, match=r"pe.max_len is not a setting of pe=rope; valid: \['base', 'high_freq_factor', .*'scaling'"):
        check_config(compose_train_config(["experiment=gpt2_small", "pe=rope"], output_dir=tmp_path))
    for pe in ("rope", "alibi", "none"):
        cfg = compose_train_config(["experiment=gpt2_small", f"pe={pe}", "~pe.max_len"], output_dir=tmp_path)
        check_config(cfg)
        assert cfg.data.seq_len == SEQ
    check_config(compose_train_config(["experiment=gpt2_small", "pe=sinusoidal"], output_dir=tmp_path))


def test_gpt2_small_settings_carry_over_to_data_hf(tmp_path):
    cfg = compose_train_config(["experiment=gpt2_small", "data=hf", "data.path=parquet",
                                "data.data_files={train: t.parquet, validation: v.parquet}"], output_dir=tmp_path)
    check_config(cfg)
    assert (cfg.data.seq_len, cfg.data.vocab_size, cfg.data.batch_size) == (SEQ, VOCAB, 16)


def test_trainer_gpu_sets_the_gpu_speed_options(tmp_path, monkeypatch, default_train_config):
    gpu_available(monkeypatch)
    default = default_train_config
    cfg = compose_train_config(["trainer=gpu"], output_dir=tmp_path)
    check_config(cfg)
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("gpu", 1, "bf16-mixed")
    assert (cfg.compile, cfg.matmul_precision, cfg.optimizer.fused) == (True, "high", True)
    # the rest of the trainer is trainer=default's
    same = {k for k in default.trainer if k not in ("accelerator", "precision")}
    assert {k: cfg.trainer[k] for k in same} == {k: default.trainer[k] for k in same}
    # each is overridable on the command line, and the preset goes with it
    cfg = compose_train_config(["trainer=gpu", "compile=false", "matmul_precision=highest", "optimizer.fused=false"], output_dir=tmp_path)
    assert (cfg.compile, cfg.matmul_precision, cfg.optimizer.fused) == (False, "highest", False)
    cfg = compose_train_config(["experiment=gpt2_small", "trainer=gpu"], output_dir=tmp_path)
    check_config(cfg)
    assert (cfg.trainer.precision, cfg.trainer.accumulate_grad_batches, cfg.model.d_model) == ("bf16-mixed", 32, D)


def test_optimizer_fused_is_checked_by_the_schema(tmp_path, monkeypatch):
    gpu_available(monkeypatch)
    cfg = compose_train_config(["trainer=gpu", "optimizer.fused=yes"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"optimizer.fused=yes must be true or false"):
        check_config(cfg)


def test_fused_adamw_is_built_when_asked_and_takes_the_same_step(tmp_path, monkeypatch):
    gpu_available(monkeypatch)
    factory = instantiate(compose_train_config(["trainer=gpu"], output_dir=tmp_path).optimizer)

    def one_step(build) -> tuple[torch.optim.Optimizer, torch.Tensor]:
        torch.manual_seed(0)
        model = DecoderLM(vocab_size=300, d_model=32, n_heads=4, n_layers=2)
        optimizer = build(model, max_steps=10)["optimizer"]
        model.loss(torch.randint(0, 300, (2, 17))).backward()
        optimizer.step()
        return optimizer, torch.cat([p.detach().flatten() for p in model.parameters()])

    fused, after_fused = one_step(factory)
    assert fused.defaults["fused"] is True
    plain, after_plain = one_step(adamw_warmup_cosine)
    # off is torch's own choice (None), not False, which would also turn off its multi-tensor loop on a GPU
    assert plain.defaults["fused"] is None
    torch.testing.assert_close(after_fused, after_plain)


# the line names trainer.accelerator=gpu, or the option that set it (trainer=gpu)
NO_GPU = r"^trainer(=gpu|\.accelerator=gpu)\b.*no CUDA GPU"


def test_trainer_gpu_without_cuda_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("pe_geometry.training.validate.torch_cuda_available", lambda: False)  # any machine
    cfg = compose_train_config(["experiment=gpt2_small", "trainer=gpu"], output_dir=tmp_path)
    with pytest.raises(ConfigError, match=NO_GPU):
        check_config(cfg)


@pytest.mark.slow  # runs train.py in a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_trainer_gpu_without_cuda_is_one_error_line_and_no_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    result = forkserver.run(
        [sys.executable, str(ROOT / "train.py"), "experiment=gpt2_small", "trainer=gpu", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env={**os.environ, "PE_CACHE_DIR": str(tmp_path / "cache")}, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match(NO_GPU, errors[0].removeprefix("error: ")), result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()  # refused before anything was written


@pytest.mark.slow  # ~111 M parameters trained for two steps of one 1024-token block on the CPU
def test_gpt2_small_trains_two_steps_on_cpu(tmp_path, cache_dir):
    from pe_geometry.training.pipeline import train

    # only the run's length, batch, validation, cadences and checkpoints differ from the preset: not its shape
    overrides = [
        "experiment=gpt2_small", f"paths.cache_dir={cache_dir}", "logger=csv",
        "data.batch_size=1", "trainer.accumulate_grad_batches=1",
        "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
        "callbacks.geometry=null", "callbacks.sample.max_new_tokens=4", "~callbacks.progress_bar",
        "callbacks.checkpoint=null", "+trainer.enable_checkpointing=false",  # no 1.3 GB checkpoint (Lightning's default one either)
    ]
    cfg = compose_train_config(overrides, output_dir=tmp_path / "run")
    started = time.perf_counter()
    metrics = train(cfg)
    seconds = time.perf_counter() - started
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])
    assert metrics["val/loss"] < math.log(VOCAB) + 1  # an untrained model's loss, give or take
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert (info["vocab_size"], info["n_parameters"]) == (VOCAB, NON_EMBEDDING + EMBEDDING)  # the plays fill 32768 tokens
    with open(tmp_path / "run" / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {int(r["step"]) for r in rows if r.get("train/loss")} == {0, 1}
    assert not list((tmp_path / "run").rglob("*.ckpt"))
    print(f"experiment=gpt2_small: 2 steps of 1 x {SEQ} tokens in {seconds:.0f} s (setup, validation and sample included)")
