"""Throughput logging: FLOPs per batch against the analytic count; tokens/s reach the CSV log."""

from __future__ import annotations

import csv

import pytest

from pe_geometry.model import DecoderLM
from pe_geometry.training.pipeline import train
from pe_geometry.training.throughput import training_flops_per_batch
from tests.conftest import tiny_train_config


@pytest.mark.parametrize("d,L,V,T", [(128, 4, 2048, 128), (32, 2, 300, 16)])
def test_decoder_flops_match_the_analytic_count(d, L, V, T):
    """Per token, forward matmuls: 12 d^2 per layer (q, kv, o, MLP) x 2, the head 2 d V, attention
    4 T d per layer (QK^T and AV over all T keys: SDPA's causal kernel is counted dense). Training = 3x."""
    model = DecoderLM(vocab_size=V, d_model=d, n_heads=4, n_layers=L)
    per_token = 3 * (24 * d * d * L + 2 * d * V + 4 * T * d * L)
    assert training_flops_per_batch(model, batch_size=2, seq_len=T) == 2 * T * per_token


def test_throughput_is_logged(tmp_path, tiny_corpus, cache_dir):
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["trainer.max_steps=6", "callbacks.throughput.window_size=2"]))
    with open(tmp_path / "run" / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    tokens_per_s = [float(r["train/device/items_per_sec"]) for r in rows if r.get("train/device/items_per_sec")]
    flops_per_s = [float(r["train/device/flops_per_sec"]) for r in rows if r.get("train/device/flops_per_sec")]
    samples_per_s = [float(r["train/device/samples_per_sec"]) for r in rows if r.get("train/device/samples_per_sec")]
    assert tokens_per_s and all(t > 0 for t in tokens_per_s)
    seq_len = 16  # TINY
    assert tokens_per_s == pytest.approx([s * seq_len for s in samples_per_s], rel=1e-6)  # every token of every block
    assert flops_per_s and all(f > 0 for f in flops_per_s)


def test_benchmark_baseline_has_the_project_decoders_shape():
    """The plain-PyTorch baseline in experiments/benchmark.py must do the same work as the project's
    decoder with learned PE (same parameters, same matmul FLOPs), or its speed ratio means nothing."""
    from functools import partial

    from experiments.benchmark import PlainGPT
    from pe_geometry.model import LearnedPE

    V, d, L, H, T = 300, 32, 2, 4, 16
    project = DecoderLM(vocab_size=V, d_model=d, n_heads=H, n_layers=L, pe=partial(LearnedPE, max_len=T))
    plain = PlainGPT(V, d, L, H, max_len=T)
    assert sum(p.numel() for p in project.parameters()) == sum(p.numel() for p in plain.parameters())
    assert training_flops_per_batch(project, batch_size=2, seq_len=T) == training_flops_per_batch(plain, batch_size=2, seq_len=T)


def test_the_fused_loss_is_counted_as_the_same_flops():
    """model.loss_chunk runs the head's three matmuls inside the loss's forward pass: the count (MFU) must still see
    them, on the meta copy that has no target values."""
    plain = DecoderLM(vocab_size=300, d_model=32, n_heads=4, n_layers=2, loss_chunk=None)
    fused = DecoderLM(vocab_size=300, d_model=32, n_heads=4, n_layers=2, loss_chunk=7)
    assert training_flops_per_batch(fused, batch_size=2, seq_len=16) == training_flops_per_batch(plain, batch_size=2, seq_len=16)


def test_the_fused_loss_holds_less_than_the_full_logits():
    """The point of model.loss_chunk: a step's peak allocation drops by about the (tokens, vocab) logits, their
    log-softmax and their gradients, here 512 x 4096 floats = 8 MiB each, to one chunk of 64 rows (1 MiB)."""
    import torch

    from experiments.benchmark import peak_allocated_bytes

    block = torch.randint(4096, (8, 65))
    peaks = {}
    for chunk in (None, 64):
        torch.manual_seed(0)
        model = DecoderLM(vocab_size=4096, d_model=32, n_heads=4, n_layers=1, loss_chunk=chunk)
        peaks[chunk] = peak_allocated_bytes(lambda model=model: model.loss(block).backward())
    logits_bytes = 8 * 64 * 4096 * 4
    assert peaks[64] < peaks[None] - 2 * logits_bytes


def test_the_benchmarks_speed_options_are_real_settings():
    """experiments/benchmark.py --options sets these overrides; a renamed key would fail there after minutes."""
    from experiments.benchmark import SPEED_OPTIONS, compose_cfg

    chunks = {compose_cfg(overrides).model.loss_chunk for overrides, _ in SPEED_OPTIONS.values()}
    assert None in chunks and any(isinstance(c, int) and c >= 1 for c in chunks)
