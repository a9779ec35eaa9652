"""``pe-train init_from=DIR``: a new run starts from a transformers checkpoint folder (training/pipeline.py's
``init_weights_from``, model/export/folder.py's ``read_folder``), and a folder that does not match the run's config is
one error line."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from pe_geometry.cli.export import main as export_main  # noqa: E402
from pe_geometry.training.pipeline import init_weights_from, train  # noqa: E402
from pe_geometry.training.run_loader import build_datamodule, build_model, load_trained_run  # noqa: E402
from pe_geometry.training.validate import ConfigError  # noqa: E402
from tests.conftest import ROOT, tiny_train_config  # noqa: E402

GEOMETRY = "geometry/attn/head1/positional_share"  # one of the geometry callback's records (analysis/metric_names.py)


def read_rows(path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def geometry_at(run_dir, step: int) -> float:
    rows = [r for r in read_rows(run_dir / "csv" / "metrics.csv") if r.get(GEOMETRY) and int(r["step"]) == step]
    assert rows, f"no {GEOMETRY} record at step {step}"
    return float(rows[0][GEOMETRY])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_corpus, cache_dir):
    """A tiny RoPE run (its geometry recorded at its last step, 3) and the folder pe-export wrote from it."""
    root = tmp_path_factory.mktemp("source")
    train(tiny_train_config(root, tiny_corpus, cache_dir, ["pe=rope", "pe.rotary_fraction=0.5"]))
    export_main([str(root / "run"), "--out", str(root / "hf")])
    return root / "run", root / "hf"


def start(tmp_path, tiny_corpus, cache_dir, overrides: list[str]):
    """A new run's config, datamodule and model as the pipeline builds them, its weights from ``init_from``."""
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, overrides)
    datamodule = build_datamodule(cfg)
    model = build_model(cfg, datamodule).eval()
    init_weights_from(cfg, model, datamodule)
    return cfg, datamodule, model


def test_a_run_from_an_export_starts_as_the_exported_run(exported, tmp_path, tiny_corpus, cache_dir):
    source_dir, folder = exported
    source = load_trained_run(source_dir)
    _, datamodule, model = start(tmp_path, tiny_corpus, cache_dir, ["pe=rope", "pe.rotary_fraction=0.5",
                                                                      f"init_from={folder}"])
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.model.state_dict().values()))
    ids = torch.as_tensor(datamodule.streams["validation"][:64].astype("int64"))[None]  # 4x the training length
    with torch.no_grad():
        assert torch.equal(model(ids), source.model(ids))
    _, _, fresh = start(tmp_path / "fresh", tiny_corpus, cache_dir, ["pe=rope", "pe.rotary_fraction=0.5"])
    with torch.no_grad():
        assert not torch.equal(fresh(ids), source.model(ids))  # without init_from: the run's own init


def test_the_geometry_callback_records_the_exported_model_at_step_0(exported, tmp_path, tiny_corpus, cache_dir):
    source_dir, folder = exported
    cfg = tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=rope", "pe.rotary_fraction=0.5", f"init_from={folder}"])
    train(cfg)
    assert geometry_at(tmp_path / "run", 0) == pytest.approx(geometry_at(source_dir, 3), rel=1e-6)
    assert geometry_at(tmp_path / "run", 0) != pytest.approx(geometry_at(source_dir, 0), rel=1e-3)


@pytest.mark.parametrize("overrides,says", [
    (["pe=rope", "pe.rotary_fraction=0.5", "model.d_model=48"], r"hidden_size=32 where this run's model has 48 \(model.d_model\)"),
    (["pe=rope", "pe.rotary_fraction=0.5", "model.n_layers=3"], r"num_hidden_layers=2 where this run's model has 3 \(model.n_layers\)"),
    (["pe=rope"], r"rope_parameters.partial_rotary_factor=0.5 where this run's model has 1.0 \(pe.rotary_fraction\)"),
    (["pe=rope", "pe.rotary_fraction=0.5", "pe.base=500"], r"rope_parameters.rope_theta=10000.0 where .* 500.0 \(pe.base\)"),
    (["pe=rope", "pe.rotary_fraction=0.5", "embedding.tie_weights=false"], r"tie_word_embeddings=True .*embedding.tie_weights"),
    (["pe=learned"], r"is a 'gpt_neox' checkpoint and this run's model \(pe=learned\) is a 'gpt2' one"),
    (["pe=alibi"], r"this run's model has no transformers architecture to read: pe=alibi: "),
    (["pe=rope", "pe.rotary_fraction=0.5", "data.vocab_size=280"], r"vocab_size=300 where this run's model has 280"),
])
def test_a_folder_that_does_not_match_the_config_is_one_line(overrides, says, exported, tmp_path, tiny_corpus, cache_dir):
    _, folder = exported
    with pytest.raises(ConfigError, match=f"^init_from={folder}.*{says}") as refusal:
        start(tmp_path, tiny_corpus, cache_dir, [*overrides, f"init_from={folder}"])
    assert "\n" not in str(refusal.value)


def test_another_tokenizer_or_no_checkpoint_is_one_line(exported, tmp_path, tiny_corpus, cache_dir):
    _, folder = exported
    swapped = [f"data.corpus.train_files=[{tiny_corpus['validation']}]", f"data.corpus.val_files=[{tiny_corpus['train']}]"]
    with pytest.raises(ConfigError, match=r"its tokenizer's vocabulary differs from this run's"):
        start(tmp_path, tiny_corpus, cache_dir, ["pe=rope", "pe.rotary_fraction=0.5", *swapped, f"init_from={folder}"])
    with pytest.raises(ConfigError, match=r"^init_from=\S+nothing: no such folder"):
        start(tmp_path, tiny_corpus, cache_dir, ["pe=rope", f"init_from={tmp_path / 'nothing'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^init_from=\S+empty: no config.json there"):
        start(tmp_path, tiny_corpus, cache_dir, ["pe=rope", f"init_from={tmp_path / 'empty'}"])


@pytest.mark.slow
def test_pe_train_refuses_a_mismatch_in_one_line_with_exit_code_2(exported, tmp_path, tiny_corpus, cache_dir):
    _, folder = exported
    command = [sys.executable, str(ROOT / "train.py"), "pe=rope", "model.d_model=48", "model.n_heads=4", "data=text_files",
               f"data.corpus.train_files=[{tiny_corpus['train']}]", f"data.corpus.val_files=[{tiny_corpus['validation']}]",
               "data.vocab_size=300", "data.seq_len=16", f"paths.cache_dir={cache_dir}", "logger=csv",
               f"paths.output_dir={tmp_path / 'run'}", f"init_from={folder}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and "model.d_model" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
