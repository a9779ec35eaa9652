"""Corpus conversion, tokenizer, content-keyed cache and block packing."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from data.corpus import VALIDATION_PLAYS, CorpusError, ShakespeareCorpus, TextFilesCorpus, markdown_to_text
from data.datamodule import BlockDataset, TextDataModule

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
    corpus = TextFilesCorpus([str(tmp_path / "train.txt")], val_files)
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
    with caplog.at_level(logging.INFO, logger="data.datamodule"):
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
        TextFilesCorpus([str(bad)]).splits()
    splits = TextFilesCorpus([str(bad)], encoding_errors="replace").splits()
    assert "\ufffd" in splits["train"][0].text


def test_missing_file_is_named(tmp_path):
    with pytest.raises(CorpusError, match="not found.*nope.txt"):
        TextFilesCorpus([str(tmp_path / "nope.txt")]).splits()


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
    splits = TextFilesCorpus([str(path)], val_fraction=0.1).splits()
    assert splits["train"][0].text == "a" * 900 and splits["validation"][0].text == "b" * 100
