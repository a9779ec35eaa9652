"""Corpus conversion, any datasets source, tokenizer, checksummed token-file cache and block packing."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import string
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra.utils import instantiate

from pe_geometry.data.cache import atomic_write_tokens, token_dtype
from pe_geometry.data.corpus import VALIDATION_PLAYS, CorpusError, ShakespeareCorpus, TextFilesCorpus, markdown_to_text
from pe_geometry.data.datamodule import BlockDataset, TextDataModule
from pe_geometry.data.hf import HFDataModule
from pe_geometry.data.tokenizer import MAX_RUN_CHARS, check_tokenizer_settings, train_tokenizer, training_sample
from pe_geometry.settings import SettingsError
from tests import forkserver
from tests.conftest import ROOT, TINY, compose_train_config

PLAY = """# A Play

## ACT I

### SCENE I. A heath.

_Thunder. Enter two Witches_

**First Witch**  
When shall we meet again?  
_\\[Aside]_ In thunder\\--or rain?

**Second Witch**  
_Exit_

**ALL**  
Fair is foul.
"""


def test_markdown_to_text_keeps_speech_and_speakers_and_drops_directions():
    text = markdown_to_text(PLAY)
    assert text == "First Witch:\nWhen shall we meet again?\n In thunder--or rain?\n\nALL:\nFair is foul.\n"


def test_shakespeare_corpus_holds_out_whole_plays():
    splits = ShakespeareCorpus().splits()
    train_names = {d.name for d in splits["train"]}
    val_names = {d.name for d in splits["validation"]}
    assert val_names == set(VALIDATION_PLAYS) and not train_names & val_names
    assert len(train_names) + len(val_names) == 38
    n_chars = sum(len(d.text) for d in splits["train"])
    assert 3_500_000 < n_chars < 5_000_000
    assert not any("**" in d.text or "##" in d.text for d in splits["train"])


def test_unknown_validation_play_is_named():
    with pytest.raises(CorpusError, match="unknown validation play.*'hamlett'"):
        ShakespeareCorpus(validation_plays=["hamlett"]).splits()


def make_datamodule(tmp_path, train_text: str, val_text: str | None = None, **kw) -> TextDataModule:
    (tmp_path / "train.txt").write_text(train_text, encoding="utf-8")
    val_files = None
    if val_text is not None:
        (tmp_path / "val.txt").write_text(val_text, encoding="utf-8")
        val_files = [str(tmp_path / "val.txt")]
    corpus = TextFilesCorpus(train_files=[str(tmp_path / "train.txt")], val_files=val_files)
    settings = dict(tokenizer="bpe", vocab_size=300, seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    return TextDataModule(corpus, **{**settings, **kw})


def test_tokenizer_round_trips_text_and_streams_end_with_eos(tmp_path, tiny_corpus):
    text = tiny_corpus["train"].read_text()
    dm = make_datamodule(tmp_path, text, text[:3000])
    dm.prepare_data()
    assert dm.vocab_size == 300
    stream = dm.streams["train"]
    assert stream[-1] == dm.tokenizer.token_to_id("<eos>")
    assert dm.tokenizer.decode(stream[:-1].tolist()) == text


def test_char_tokenizer(tmp_path):
    dm = make_datamodule(tmp_path, "to be or not to be\n" * 20, "that is the question\n" * 5, tokenizer="char", vocab_size=64)
    dm.prepare_data()
    assert dm.tokenizer.decode(dm.streams["train"][:18].tolist()) == "to be or not to be"
    assert dm.vocab_size == 3 + len(set("to be or not to be\n"))  # specials + seen characters


def test_cache_is_reused_and_keyed_by_settings(tmp_path, tiny_corpus, caplog):
    text = tiny_corpus["train"].read_text()
    first = make_datamodule(tmp_path, text, text[:3000])
    first.prepare_data()
    with caplog.at_level(logging.INFO, logger="pe_geometry.data.datamodule"):
        second = make_datamodule(tmp_path, text, text[:3000])
        second.prepare_data()
    assert "training a bpe tokenizer" not in caplog.text  # served from the cache
    assert second.cache_entry == first.cache_entry
    np.testing.assert_array_equal(first.streams["train"], second.streams["train"])
    other_vocab = make_datamodule(tmp_path, text, text[:3000], vocab_size=320)
    other_vocab.prepare_data()
    assert other_vocab.cache_entry != first.cache_entry and other_vocab.vocab_size == 320
    changed_text = make_datamodule(tmp_path, text + " more", text[:3000])
    changed_text.prepare_data()
    assert changed_text.cache_entry != first.cache_entry


@pytest.mark.parametrize("damage", ["truncate_stream", "garbage_tokenizer", "bad_meta"])
def test_corrupt_cache_is_reported_and_rebuilt(tmp_path, tiny_corpus, caplog, damage):
    text = tiny_corpus["train"].read_text()
    dm = make_datamodule(tmp_path, text, text[:3000])
    dm.prepare_data()
    expected = dm.streams["train"].copy()
    entry = dm.cache_entry
    if damage == "truncate_stream":
        data = (entry / "train.npy").read_bytes()
        (entry / "train.npy").write_bytes(data[: len(data) // 2])
    elif damage == "garbage_tokenizer":
        (entry / "tokenizer.json").write_text("{not json")
    else:
        (entry / "meta.json").write_text("[]")
    with caplog.at_level(logging.WARNING):
        again = make_datamodule(tmp_path, text, text[:3000])
        again.prepare_data()
    assert "corrupt" in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_array_equal(again.streams["train"], expected)
    assert not list(entry.glob(".*.tmp"))  # no half-written files left behind


def test_empty_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="empty: its train split has no text"):
        make_datamodule(tmp_path, "  \n\n\t ", "some text").prepare_data()


def test_too_small_corpus_says_how_many_tokens_are_needed(tmp_path):
    with pytest.raises(CorpusError, match=r"validation split has \d+ tokens, data.seq_len=16 needs at least 17"):
        make_datamodule(tmp_path, "word " * 500, "tiny").prepare_data()


def test_non_utf8_file_is_named_or_replaced(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good text \xff\xfe more text " * 50)
    with pytest.raises(CorpusError, match=r"bad.txt is not valid UTF-8 \(byte 10"):
        TextFilesCorpus(train_files=[str(bad)]).splits()
    splits = TextFilesCorpus(train_files=[str(bad)], encoding_errors="replace").splits()
    assert "\ufffd" in splits["train"][0].text


def test_val_fraction_outside_zero_one_is_a_clear_error(tmp_path):
    with pytest.raises(SettingsError, match=r"data.corpus.val_fraction=1.5 must be a fraction in \(0, 1\)"):
        TextFilesCorpus(train_files=[str(tmp_path / "a.txt")], val_fraction=1.5)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CorpusError, match="not found.*nope.txt"):
        TextFilesCorpus(train_files=[str(tmp_path / "nope.txt")]).splits()


def test_blocks_overlap_by_one_so_every_token_is_a_target_once():
    stream = np.arange(50, dtype=np.uint16)
    blocks = BlockDataset(stream, seq_len=8)
    assert len(blocks) == 6
    assert blocks[0].tolist() == list(range(9)) and blocks[1].tolist() == list(range(8, 17))
    targets = np.concatenate([blocks[i][1:].numpy() for i in range(len(blocks))])
    assert targets.tolist() == list(range(1, 49))


def test_single_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a" * 900 + "b" * 100)
    splits = TextFilesCorpus(train_files=[str(path)], val_fraction=0.1).splits()
    assert splits["train"][0].text == "a" * 900 and splits["validation"][0].text == "b" * 100


# -- the shared path: token files, checksums, long runs --------------------------------------------------------------


def test_streams_are_memory_mapped_token_files_read_lazily(tmp_path, tiny_corpus):
    text = tiny_corpus["train"].read_text()
    dm = make_datamodule(tmp_path, text, text[:3000])
    dm.prepare_data()
    assert isinstance(dm.streams["train"], np.memmap) and dm.streams["train"].dtype == np.uint16
    blocks = BlockDataset(dm.streams["train"], dm.seq_len)
    assert blocks.stream is dm.streams["train"]  # no copy of the whole stream
    assert blocks[3].dtype == torch.int64 and blocks[3].tolist() == dm.streams["train"][48:65].tolist()
    sent = pickle.loads(pickle.dumps(blocks))  # as to a spawned DataLoader worker: the file, not a copy
    assert len(pickle.dumps(blocks)) < 1000 and isinstance(sent.stream, np.memmap)
    assert sent[3].tolist() == blocks[3].tolist() and len(sent) == len(blocks)


def test_token_files_use_uint32_beyond_65536_tokens_and_round_trip(tmp_path):
    assert token_dtype(2**16) == np.uint16 and token_dtype(2**16 + 1) == np.uint32
    ids = [np.array([0, 70_000, 2**32 - 1], dtype=np.uint32), np.array([5], dtype=np.uint32)]
    n_tokens, _ = atomic_write_tokens(tmp_path / "x.npy", iter(ids), np.dtype(np.uint32))
    loaded = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert n_tokens == 4 and loaded.dtype == np.uint32 and loaded.tolist() == [0, 70_000, 2**32 - 1, 5]


def test_vocabulary_beyond_uint32_is_a_clear_error():
    with pytest.raises(ValueError, match=r"data.vocab_size=4294967297 is larger than uint32 token files can hold"):
        check_tokenizer_settings("bpe", 2**32 + 1)


def test_same_size_corruption_of_a_token_file_is_detected_and_rebuilt(tmp_path, tiny_corpus, caplog):
    text = tiny_corpus["train"].read_text()
    dm = make_datamodule(tmp_path, text, text[:3000])
    dm.prepare_data()
    expected = np.array(dm.streams["train"])
    path = dm.cache_entry / "train.npy"
    data = bytearray(path.read_bytes())
    data[-200:-100] = bytes(100)  # valid-looking ids (zeros), same size
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = make_datamodule(tmp_path, text, text[:3000])
        again.prepare_data()
    assert "train.npy does not match its checksum" in caplog.text and "rebuilding" in caplog.text
    np.testing.assert_array_equal(again.streams["train"], expected)


def test_long_run_without_whitespace_is_cut_and_trains_fast(caplog):
    run = "".join(random.Random(0).choice(string.ascii_lowercase) for _ in range(200_000))
    tokenizer = train_tokenizer(["short words here\n", run], "bpe", 300)
    pieces = tokenizer.pre_tokenizer.pre_tokenize_str("a b " + run[:150])
    assert max(len(p) for p, _ in pieces) == MAX_RUN_CHARS
    assert tokenizer.decode(tokenizer.encode(run).ids) == run
    with caplog.at_level(logging.INFO, logger="pe_geometry.data.tokenizer"):
        started = time.perf_counter()
        train_tokenizer(training_sample([["ok", run]], max_chars=10**9), "bpe", 300)
    assert time.perf_counter() - started < 30  # minutes before the cut: BPE rescanned the whole run per merge
    assert "1 runs of more than 64 characters without whitespace were cut" in caplog.text


def test_tokenizer_trains_on_a_bounded_sample(caplog):
    batches = [["a" * 10, "b" * 10], ["c" * 10]]
    assert list(training_sample(batches, max_chars=15)) == ["a" * 10, "b" * 5]


# -- data=hf: any datasets source ------------------------------------------------------------------------------


def play_lines(tiny_corpus, split: str) -> list[str]:
    return [p for p in tiny_corpus[split].read_text().split("\n\n") if p.strip()]


def hf_datamodule(tmp_path, **kw) -> HFDataModule:
    settings = dict(vocab_size=300, seq_len=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    return HFDataModule(**{**settings, **kw})


def expected_stream(tokenizer, texts: list[str]) -> list[int]:
    eos = tokenizer.token_to_id("<eos>")
    return [i for text in texts for i in [*tokenizer.encode(text).ids, eos]]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_encoding_keeps_every_document_boundary_in_order_map_style_and_streamed(tmp_path, tiny_corpus, dtype):
    """Each document's ids, then <eos>, in document order: across batches, for empty and missing texts, in
    both token dtypes, whether datasets.map writes Arrow files or a streamed dataset is encoded as it is read."""
    from pe_geometry.data import encode

    lines = play_lines(tiny_corpus, "train")[:40]
    texts = [*lines[:5], None, "", *lines[5:]]  # (None: a missing value, read as an empty document)
    tokenizer = train_tokenizer(lines, "bpe", 300)
    dataset = datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
    expected = expected_stream(tokenizer, [t or "" for t in texts])
    for i, source in enumerate([dataset, dataset.to_iterable_dataset(num_shards=1)]):
        (tmp_path / str(i)).mkdir()
        old, encode.MAP_BATCH_DOCS = encode.MAP_BATCH_DOCS, 7  # several batches, one of them holding the empty documents
        try:
            chunks = list(encode.encode_documents(source, "text", tokenizer, np.dtype(dtype), tmp_path / str(i)))
        finally:
            encode.MAP_BATCH_DOCS = old
        assert len(chunks) > 1 and all(chunk.dtype == dtype and chunk.ndim == 1 for chunk in chunks)
        assert np.concatenate(chunks).tolist() == expected


def test_save_to_disk_folder_is_loaded_and_tokenized(tmp_path, tiny_corpus):
    train, val = play_lines(tiny_corpus, "train"), play_lines(tiny_corpus, "validation")
    folder = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": train, "id": list(range(len(train)))}),
        "validation": datasets.Dataset.from_dict({"text": val, "id": list(range(len(val)))}),
    }).save_to_disk(str(folder))
    dm = hf_datamodule(tmp_path, path=str(folder))
    dm.prepare_data()
    assert dm.streams["train"].tolist() == expected_stream(dm.tokenizer, train)
    assert dm.streams["validation"].tolist() == expected_stream(dm.tokenizer, val)
    assert not list((tmp_path / "cache").glob(".encode-*"))  # the map's work folder is gone
    assert not list(folder.rglob("cache-*.arrow"))  # and nothing was written beside the user's data


@pytest.fixture
def parquet_files(tmp_path, tiny_corpus) -> dict[str, Path]:
    out = {}
    for split in ("train", "validation"):
        out[split] = tmp_path / f"{split}.parquet"
        lines = play_lines(tiny_corpus, split)
        pq.write_table(pa.table({"story": lines, "n": list(range(len(lines)))}), out[split])
    return out


def test_parquet_splits_and_streaming_give_the_same_streams(tmp_path, tiny_corpus, parquet_files):
    files = {split: str(p) for split, p in parquet_files.items()}
    mapped = hf_datamodule(tmp_path, path="parquet", data_files=files, text_column="story", num_proc=2)
    mapped.prepare_data()
    assert mapped.streams["train"].tolist() == expected_stream(mapped.tokenizer, play_lines(tiny_corpus, "train"))
    streamed = hf_datamodule(tmp_path, path="parquet", data_files=files, text_column="story", streaming=True)
    streamed.prepare_data()
    assert streamed.cache_entry != mapped.cache_entry
    for split in ("train", "validation"):
        np.testing.assert_array_equal(streamed.streams[split], mapped.streams[split])


def test_one_split_holds_out_its_first_documents_and_max_docs_limits(tmp_path, tiny_corpus, parquet_files):
    lines = play_lines(tiny_corpus, "train")
    dm = hf_datamodule(tmp_path, path="parquet", data_files=str(parquet_files["train"]), text_column="story", val_size=10, max_docs=60)
    dm.prepare_data()
    assert dm.streams["validation"].tolist() == expected_stream(dm.tokenizer, lines[:10])
    assert dm.streams["train"].tolist() == expected_stream(dm.tokenizer, lines[10:60])
    fraction = hf_datamodule(tmp_path, path="parquet", data_files=str(parquet_files["train"]), text_column="story", val_size=0.5)
    fraction.prepare_data()
    eos = fraction.tokenizer.token_to_id("<eos>")
    assert int((fraction.streams["validation"] == eos).sum()) == round(len(lines) * 0.5)


def test_changed_parquet_file_gets_a_new_cache_entry(tmp_path, parquet_files):
    files = {split: str(p) for split, p in parquet_files.items()}
    first = hf_datamodule(tmp_path, path="parquet", data_files=files, text_column="story")
    first.prepare_data()
    table = pq.read_table(parquet_files["train"])
    pq.write_table(table.slice(0, table.num_rows - 5), parquet_files["train"])
    second = hf_datamodule(tmp_path, path="parquet", data_files=files, text_column="story")
    second.prepare_data()
    assert second.cache_entry != first.cache_entry and second.n_tokens("train") < first.n_tokens("train")


def test_hf_bad_input_is_one_clear_line(tmp_path, parquet_files):
    files = {split: str(p) for split, p in parquet_files.items()}
    with pytest.raises(CorpusError, match=r"data.text_column='text' is not a column of the train split .*; columns: \['story', 'n'\]"):
        hf_datamodule(tmp_path, path="parquet", data_files=files).prepare_data()
    with pytest.raises(CorpusError, match=r"data.text_column='n' holds Value\((dtype=)?'int64'.*\), not text"):
        hf_datamodule(tmp_path, path="parquet", data_files=files, text_column="n").prepare_data()
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["some text"] * 40}),
        "validation": datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})),
    }).save_to_disk(str(saved))
    # datasets >= 3 refuses to load the empty split; 2.x loads it and the corpus refuses it: one clear line either way
    no_documents = (r"could not be loaded \(.*\): a file or split with no documents"
                    r"|the corpus is empty: its validation split has no documents")
    with pytest.raises(CorpusError, match=no_documents):
        hf_datamodule(tmp_path, path=str(saved)).prepare_data()
    blank = tmp_path / "blank"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["some text"] * 40}),
                          "validation": datasets.Dataset.from_dict({"text": ["  ", "\n", None]})}).save_to_disk(str(blank))
    with pytest.raises(CorpusError, match="the corpus is empty: its validation split has no text"):
        hf_datamodule(tmp_path, path=str(blank)).prepare_data()
    with pytest.raises(CorpusError, match=r"data.train_split='training' is not a split of .*; splits: \['train', 'validation'\]"):
        hf_datamodule(tmp_path, path=str(blank), train_split="training").prepare_data()
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"story": pa.array([], pa.string())}), empty)
    with pytest.raises(CorpusError, match=r"'parquet' could not be loaded \(.*\).*no documents"):
        files_with_empty = {"train": files["train"], "validation": str(empty)}
        hf_datamodule(tmp_path, path="parquet", data_files=files_with_empty, text_column="story").prepare_data()
    header_only = tmp_path / "header_only.csv"
    header_only.write_text("story\n")
    with pytest.raises(CorpusError, match=r"'csv' could not be loaded \(.*corresponds to no data.*\): a file or split with no documents"):
        hf_datamodule(tmp_path, path="csv", data_files=str(header_only), text_column="story").prepare_data()
    with pytest.raises(CorpusError, match=r"HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 python train.py .*data.path=parquet"):
        hf_datamodule(tmp_path, path="someone/not-downloaded-corpus").prepare_data()
    with pytest.raises(CorpusError, match=r"data.path='parquet' could not be loaded \(FileNotFoundError: .*nope.parquet"):
        hf_datamodule(tmp_path, path="parquet", data_files=str(tmp_path / "nope.parquet")).prepare_data()
    with pytest.raises(CorpusError, match=r"data.val_size=0.1 is a fraction, but a streamed dataset has no known length"):
        hf_datamodule(tmp_path, path="parquet", data_files=files["train"], text_column="story", streaming=True, val_size=0.1).prepare_data()


def test_data_hf_config_takes_load_dataset_keys(tmp_path, parquet_files):
    cfg = compose_train_config([
        "data=hf", "data.path=parquet", f"data.data_files={{train: {parquet_files['train']}, validation: {parquet_files['validation']}}}",
        "data.text_column=story", "data.vocab_size=300", "data.seq_len=16", f"paths.cache_dir={tmp_path}",
    ])
    dm = instantiate(cfg.data)
    dm.prepare_data()
    assert isinstance(dm, HFDataModule) and dm.vocab_size == 300 and dm.n_tokens("validation") > 17


@pytest.mark.slow
def test_train_py_with_data_hf_and_relative_parquet_files(tmp_path, parquet_files):
    """The README's command, run from the folder holding a.parquet and b.parquet."""
    parquet_files["train"].rename(tmp_path / "a.parquet")
    parquet_files["validation"].rename(tmp_path / "b.parquet")
    args = ["data=hf", "data.path=parquet", "data.data_files={train: a.parquet, validation: b.parquet}", "data.text_column=story",
            *TINY, "logger=csv", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PE_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    result = forkserver.run([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["vocab_size"] == 300 and info["tokens"]["train"] > 5_000 and info["tokens"]["validation"] > 5_000


def test_a_bpe_vocabulary_the_text_cannot_fill_is_a_warning_naming_both_sizes(tmp_path, tiny_corpus, caplog):
    """12 k characters hold far fewer than 32768 merges: the run goes on with what BPE learned, and says so."""
    text = tiny_corpus["train"].read_text(encoding="utf-8")
    dm = make_datamodule(tmp_path, text, tiny_corpus["validation"].read_text(encoding="utf-8"), vocab_size=32768)
    with caplog.at_level("WARNING", logger="pe_geometry.data.datamodule"):
        dm.prepare_data()
        dm.setup("fit")
    assert dm.vocab_size < 32768
    assert f"the BPE tokenizer learned {dm.vocab_size} tokens, not data.vocab_size=32768" in caplog.text


@pytest.mark.slow
def test_data_benchmark_quick_mode_compares_the_project_with_tokenizers_alone():
    """The data benchmark's smoke run: both paths build the same token streams, and it prints their ratio and memory."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(ROOT / "experiments" / "benchmark_data.py"), "--quick"], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    for size in ("2 MB", "5 MB"):
        assert re.search(rf"^{size}: [\d,]+ tokens \(identical in both\); project [\d.]+ s", result.stdout, re.MULTILINE), result.stdout
        assert re.search(rf"^{size}: ratio \d+\.\d\d \(project / tokenizers alone, wall\)", result.stdout, re.MULTILINE), result.stdout
        assert re.search(rf"^{size}: project peak memory: anonymous \d+ MB", result.stdout, re.MULTILINE), result.stdout


def test_the_data_position_counts_the_batches_consumed_and_hands_a_resume_over_once():
    """Both data modules keep their resumable position in one mixin: per epoch (a corpus: each epoch a permutation)
    or over the run (a task); validation batches are not counted; a loaded position starts the next loader only."""
    from types import SimpleNamespace

    from pe_geometry.data.position import DataPosition

    class PerEpoch(DataPosition):
        counts_epochs = True

    for cls, consumed in ((PerEpoch, {"epoch": 1, "batches": 1}), (DataPosition, {"batches": 3})):
        dm = cls()
        dm.trainer = SimpleNamespace(training=True, current_epoch=0)
        assert dm.start_position() == ({key: 0 for key in consumed}, False)
        for epoch in (0, 0, 1):
            dm.trainer.current_epoch = epoch
            dm.on_before_batch_transfer("batch", 0)
        dm.trainer.training = False
        dm.on_before_batch_transfer("a validation batch", 0)
        assert dm.state_dict() == consumed
        dm.load_state_dict({**consumed, "batches": 7})
        assert dm.state_dict() == consumed  # until the training loader is built from it
        assert dm.start_position() == ({**consumed, "batches": 7}, True)
        assert dm.start_position() == ({**consumed, "batches": 7}, False)


def test_hf_corpus_reads_the_data_modules_settings_and_a_count_is_an_integer(tmp_path):
    dm = HFDataModule(path="parquet", data_files="a.parquet", val_size=100, cache_dir=str(tmp_path))
    assert dm.corpus.settings == dm.settings and dm.corpus.settings.val_size == 100 and dm.seq_len == 128
    with pytest.raises(SettingsError, match=r"data.val_size=100.0 must be a fraction in \(0, 1\) or a number of documents >= 1"):
        HFDataModule(path="parquet", val_size=100.0)
    with pytest.raises(SettingsError, match=r"data.max_docs=0 must be a positive integer, or null for every document"):
        HFDataModule(path="parquet", max_docs=0)


def test_the_vocabulary_range_counts_the_byte_alphabet_of_the_tokenizer():
    """pe_geometry.settings (torch- and tokenizers-free) states byte-level BPE's alphabet; it is the library's."""
    from tokenizers import pre_tokenizers

    from pe_geometry.settings.data import BYTE_ALPHABET

    assert len(pre_tokenizers.ByteLevel.alphabet()) == BYTE_ALPHABET
