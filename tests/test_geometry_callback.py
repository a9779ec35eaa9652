"""The geometry callback logs from step 0 at its cadence, for every PE type, and never changes training."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pe_geometry.analysis.geometry_callback import GeometryCallback
from pe_geometry.analysis.measures.attention_split import first_layer_attention_split
from pe_geometry.analysis.measures.probes import frequent_token_ids
from pe_geometry.model import DecoderLM, ExplicitAttention, SinusoidalPE
from pe_geometry.training.pipeline import train
from tests import forkserver
from tests.conftest import PE_TYPES, fast_loop_keeps, tiny_train_config

CADENCE = ["trainer.max_steps=5", "callbacks.geometry.every_n_steps=2",
           "callbacks.geometry.n_tokens=50", "callbacks.geometry.probe_batch_size=4", "callbacks.checkpoint.every_n_train_steps=10"]


def read_rows(run):
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("pe", fast_loop_keeps(PE_TYPES, keep=["learned", "rope"]))  # a table; a rotation's null
def test_geometry_logged_at_init_cadence_and_end(pe, tmp_path, tiny_corpus, cache_dir):
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [f"pe={pe}", *CADENCE]))
    rows = read_rows(tmp_path / "run")
    hidden_key = "geometry/hidden/layer0/position_var_share"
    steps = sorted(int(r["step"]) for r in rows if r.get(hidden_key))
    assert steps == [0, 2, 4, 5]  # initialisation, every 2 steps, the end
    has_table = pe in ("sinusoidal", "learned")
    assert ("geometry/abs_cos_mean" in rows[0]) == has_table
    if has_table:
        init = next(r for r in rows if r.get("geometry/abs_cos_mean") and int(r["step"]) == 0)
        assert float(init["geometry/abs_cos_mean_chance"]) == pytest.approx(np.sqrt(2 / (np.pi * 32)), rel=0.05)
    # every family on one axis: block 0's positional share and each head's attention distance, at every record
    init = next(r for r in rows if r.get(hidden_key) and int(r["step"]) == 0)
    assert float(init["geometry/attn/n_positional_heads_all_terms"]) in range(5)  # 0..n_heads
    share = float(init["geometry/attn/head0/positional_share"])
    assert share == 0.0 if pe in ("none", "cope") else share != 0.0  # CoPE's table starts at zeros
    end = next(r for r in rows if r.get(hidden_key) and int(r["step"]) == 5)
    end_share = float(end["geometry/attn/head0/positional_share"])
    assert end_share == 0.0 if pe == "none" else end_share != 0.0
    assert bool(init.get("geometry/attn/head0/positional_share_null_mean")) == (pe in ("rope", "xpos"))
    assert float(init["geometry/attn/head0/mean_distance_chance"]) == pytest.approx((16 - 1) / 4)  # causal, seq_len 16
    assert 0.0 < float(init["geometry/attn/head0/mean_distance"]) < 15
    tokens = json.loads((tmp_path / "run" / "geometry_tokens.json").read_text())
    assert "most frequent training tokens" in tokens["word_rows"] and len(tokens["tokens"]) == 50


def test_geometry_callback_does_not_change_training(tmp_path, tiny_corpus, cache_dir):
    def losses(sub, callbacks):
        train(tiny_train_config(tmp_path / sub, tiny_corpus, cache_dir, ["model=encoder", *callbacks]))
        return [r["train/loss"] for r in read_rows(tmp_path / sub / "run") if r["train/loss"]]

    with_geometry = losses("a", CADENCE)
    without = losses("b", ["trainer.max_steps=5", "callbacks=no_geometry"])
    assert with_geometry == without and len(without) == 5


def test_frequent_tokens_skip_specials_and_unseen_rows():
    stream = np.array([0, 5, 5, 5, 7, 7, 2, 9, 0, 0, 0], dtype=np.uint16)
    ids, counts = frequent_token_ids(stream, vocab_size=12, n=10, exclude=[0, 1, 2])
    assert ids.tolist() == [5, 7, 9] and counts.tolist() == [3, 2, 1]


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_attention_shares_come_from_the_real_first_layer_scores(norm):
    """The block 0 terms' shares sum to 1 per head, and a model whose word embeddings are zero
    has nothing but position and bias terms."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=40, d_model=16, n_heads=2, n_layers=1, norm=norm, pe=SinusoidalPE, attention=ExplicitAttention)
    idx = torch.randint(40, (3, 10))
    with torch.no_grad():
        shares = first_layer_attention_split(model, idx)
        total = sum(v for k, v in shares.items() if k != "positional")
        torch.testing.assert_close(total, torch.ones(2, dtype=torch.float64))
        model.W_E.zero_()
        only_position = first_layer_attention_split(model, idx)
    torch.testing.assert_close(only_position["word_word"], torch.zeros(2, dtype=torch.float64))
    assert (only_position["pos_pos"] + only_position["pos_bias"] + only_position["bias_bias"] > 0.999).all()


def test_bad_measure_name_is_rejected():
    with pytest.raises(ValueError, match=r"geometry.measures=\[.*\"angles\"\] must be a list of \['input', 'hidden', 'attention'\]"):
        GeometryCallback(measures=["input", "angles"])


def test_records_keep_each_logged_step():
    """End-of-run code reads init and final geometry from callback.records, without a logger."""
    from types import SimpleNamespace

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=40, d_model=16, n_heads=2, n_layers=2, pe=SinusoidalPE)
    callback = GeometryCallback(n_tokens=20, fixed_k=2)
    callback.token_ids, callback.seq_len = torch.arange(3, 23), 8
    callback.probe = torch.randint(40, (4, 8))
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, loggers=[])
    for step in (0, 0, 3):  # a repeated step is recorded once
        trainer.global_step = step
        callback._record(trainer, SimpleNamespace(model=model))
    assert sorted(callback.records) == [0, 3]
    assert "geometry/abs_cos_mean" in callback.records[0] and "geometry/hidden/layer2/position_var_share" in callback.records[3]
    assert model.training  # put back in training mode


@pytest.mark.parametrize("pe", ["learned", "rope", "alibi"])
def test_record_on_a_model_and_a_batch_is_what_the_callback_logs(pe):
    """analysis.record.record (no Lightning: what a checkpoint reader calls) on the callback's rows and settings gives
    the very dict the callback logs, at a step with the position probe and at one without."""
    from types import SimpleNamespace

    from pe_geometry.analysis.record import record
    from tests.test_attention import build

    model = build(DecoderLM, pe, ExplicitAttention)
    callback = GeometryCallback(n_tokens=20, fixed_k=2, null_draws=4, probe_batch_size=3, position_probe_blocks=6,
                                position_probe_permutations=3, attention_null_draws=3, position_probe_every_n_steps=4)
    stream = np.random.default_rng(0).zipf(1.3, 4000) % 50
    callback.choose_rows(stream[:3000], stream[3000:], 50, 8, specials=[0])
    logged = {}
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.__setitem__(step, metrics))
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, loggers=[logger])
    for step in (0, 2):
        trainer.global_step = step
        callback._record(trainer, SimpleNamespace(model=model))
    settings = {"fixed_k": 2, "null_draws": 4, "position_probe_permutations": 3, "attention_null_draws": 3}
    model.eval()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        with_probe = record(model, callback.probe, word_ids=callback.token_ids, position_blocks=callback.position_blocks,
                            **settings)
        without = record(model, callback.probe, word_ids=callback.token_ids, **settings)
    assert logged[0] == with_probe and logged[2] == without
    assert "geometry/hidden/layer0/position_r2" in with_probe and "geometry/attn/head0/mean_distance" in without
    assert ("geometry/abs_cos_mean" in without) == (pe == "learned")


def test_a_record_in_one_block_chunks_equals_one_chunk_and_the_probe_shares_its_pass():
    """chunk_tokens changes how much is held at once, not the figures: one block per chunk vs every block in one
    (float32 forwards of different batch sizes round differently: 1e-5), with the position probe (whose pass feeds
    the hidden measures too) and without it (the hidden measures alone, the same numbers)."""
    torch.manual_seed(0)
    model = DecoderLM(vocab_size=60, d_model=16, n_heads=2, n_layers=2, pe=SinusoidalPE).eval()
    rng = np.random.default_rng(0)
    stream = rng.zipf(1.3, 4000) % 60
    records = []
    for chunk_tokens in (8, 10_000):
        callback = GeometryCallback(n_tokens=20, fixed_k=2, null_draws=4, probe_batch_size=3, position_probe_blocks=10,
                                    position_probe_permutations=3, chunk_tokens=chunk_tokens)
        callback.choose_rows(stream[:3000], stream[3000:], 60, 8, specials=[0])
        with torch.no_grad():
            records.append((callback.measure(model, position_probe_now=True), callback.measure(model)))
    (small_probe, small), (large_probe, large) = records
    assert small_probe.keys() == large_probe.keys() and "geometry/hidden/layer2/position_r2" in small_probe
    for name, value in large_probe.items():
        assert small_probe[name] == pytest.approx(value, rel=1e-5, abs=1e-5), name
        if name in large:
            assert large[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name  # the probe's pass, same hidden figures
    assert small.keys() == large.keys() and not any("position_r2" in name for name in large)
    idx = torch.from_numpy(stream[:16].astype(np.int64)).view(2, 8)
    with torch.no_grad():
        for one, each in zip(model.hidden_states(idx), model.iter_hidden_states(idx), strict=True):
            assert one.equal(each)


@pytest.mark.slow  # runs experiments/benchmark_geometry_scaling.py in a subprocess
def test_the_scaling_benchmark_quick_mode_prints_the_table_shares_and_cost_law():
    script = Path(__file__).resolve().parents[1] / "experiments" / "benchmark_geometry_scaling.py"
    result = forkserver.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^versions: python [\d.]+, torch \S+", out, re.MULTILINE), out
    rows = re.findall(r"^\| (\d+) \| \d+ / \d+ \| \d+ \|.*\| ([\d.]+) % \|", out, re.MULTILINE)
    assert [d for d, _ in rows] == ["64", "128"], out
    assert all(0 < float(share) < 100 for _, share in rows), out
    assert re.search(r"^cost law .*input d\^-?[\d.]+, hidden d\^-?[\d.]+", out, re.MULTILINE), out


def test_the_settings_offer_the_measures_the_recorder_has():
    """pe_geometry.settings (torch-free) lists the measures a config may name; they are analysis.record's."""
    from pe_geometry.analysis.record import MEASURES
    from pe_geometry.settings.training import MEASURES as OFFERED

    assert OFFERED == MEASURES and tuple(GeometryCallback().measures) == MEASURES


def test_a_resumed_run_summarises_from_step_0(tmp_path, tiny_corpus, cache_dir):
    """The records travel in the checkpoint: after a resume the summary's start is the initialisation (step 0), not
    the step the run resumed at (issue 53 item 6)."""
    args = [*CADENCE, "callbacks.checkpoint.every_n_train_steps=2"]
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*args, "trainer.max_steps=4"]))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, [*args, "trainer.max_steps=6", f"ckpt_path={last}"]))
    checkpoint = torch.load(last, map_location="cpu", weights_only=False)
    saved = next(state for key, state in checkpoint["callbacks"].items() if key.startswith("GeometryCallback"))
    assert sorted(saved["records"]) == [0, 2, 4, 6]  # the first segment's records, and the resumed one's
    callback = GeometryCallback()
    callback.load_state_dict(saved)
    assert "step 0:" in callback.summary_lines()[0] and "step 6:" in callback.summary_lines()[0]
